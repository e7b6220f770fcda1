"""Pure-ASGI middleware that refuses requests before they reach a route: API keys and tenants,
body size, tenant limits and budgets.

This is the only module that authenticates a request and the only one that asks the tenant
limiter (`server.tenants`); routes and serving never see a tenant.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import (
    GatewayError,
    InsufficientQuotaError,
    ModelNotFoundError,
    RateLimitExceededError,
    error_body,
    responses_error_event,
    sse_error_event,
)
from server.metrics import GatewayMetrics
from server.settings.keys_file import Tenant
from server.tenants.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    Bucket,
    Decision,
    period_of,
    seconds_to_next_period,
)
from server.tenants.reservation import reserved_tokens
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway.tenants")

# The generation routes tenant limits apply to, and the kind of body each takes (server.tenants.reservation).
LIMITED_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses"}


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None,
                     *, body: dict[str, Any] | None = None) -> None:
    payload = json.dumps(body if body is not None else error_body(message, status)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


async def send_gateway_error(send: Send, error: GatewayError) -> None:
    await send_error(send, error.status, error.message, error.headers, body=error.body())


def _bearer(scope: Scope) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant time in the token's content: every key is compared, no early exit."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class AuthMiddleware:
    """`Authorization: Bearer <key>` on the API, naming the request's tenant; a separate admin key
    on /admin/*.

    No API key configured (no keys file, no `auth.api_keys`) means the API is open and every
    request is tenant `default`. /admin/* takes an admin key; without one it is open only while
    the API is open too, and refused (403) otherwise.
    """

    def __init__(self, app: ASGIApp, tenancy: Tenancy, admin_keys: list[str], open_paths: list[str]) -> None:
        self.app = app
        self.tenancy = tenancy
        self.admin_keys = [k.encode() for k in admin_keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        directory = self.tenancy.directory  # read once: a keys-file reload swaps it whole
        if path.startswith("/admin"):
            if not self.admin_keys:
                if not directory.open:
                    await send_error(send, 403, "Admin routes are disabled: set auth.admin_keys to use them.")
                    return
                await self.app(scope, receive, send)
                return
            token = await self._bearer_or_401(scope, send)
            if token is None:
                return
            if not key_matches(token, self.admin_keys):
                await send_error(send, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"})
                return
            await self.app(scope, receive, send)
            return
        if path in self.open_paths or directory.open:
            scope.setdefault("state", {})["tenant"] = directory.unnamed
            await self.app(scope, receive, send)
            return
        token = await self._bearer_or_401(scope, send)
        if token is None:
            return
        tenant = directory.lookup(token)
        if tenant is None:
            await send_error(send, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    @staticmethod
    async def _bearer_or_401(scope: Scope, send: Send) -> bytes | None:
        token = _bearer(scope)
        if token is None:
            await send_error(send, 401, "Missing API key: send `Authorization: Bearer <key>`.",
                             {"WWW-Authenticate": "Bearer"})
        return token


class _BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI's body parsing re-raises it (it turns other errors into 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=413, detail=message)


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"Request body too large: the limit is {self.max_bytes} bytes."
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await send_error(send, 413, message)
                    return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(message)
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:  # raised outside FastAPI's handlers (e.g. a streaming read)
            # MetricsMiddleware (outermost) notes the status as a response starts; reading it here
            # spares every streamed chunk a send wrapper of this middleware's own.
            if "status" not in scope.get("state", {}):
                await send_error(send, 413, message)


# -- tenant limits ------------------------------------------------------------------------------


def duration_text(seconds: float) -> str:
    """A reset time as OpenAI's x-ratelimit-reset-* headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the per-minute limits the tenant has."""
    headers: dict[str, str] = {}
    for kind, bucket in (("requests", decision.requests), ("tokens", decision.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration_text(bucket.reset_s)
    return headers


def budget_spent(tenant: Tenant, used: int | None, period: str, now: float) -> InsufficientQuotaError:
    per = tenant.limits.budget_period
    renews = period_of(now + seconds_to_next_period(now, per) + 1, per)
    return InsufficientQuotaError(
        f"You exceeded your current quota: tenant {tenant.name} has used {used or 0} of its "
        f"{tenant.limits.budget_tokens} tokens for {period}. The budget renews with {renews} (UTC).")


def refusal_error(decision: Decision, now: float, max_tokens_param: str = "max_tokens") -> GatewayError:
    """The 429 for a refused request, in OpenAI's words and shape, with its retry headers;
    `max_tokens_param` is the route's name for it (/v1/responses: max_output_tokens)."""
    tenant, reserved = decision.tenant, decision.reserved
    headers = ratelimit_headers(decision)
    if decision.reason == BUDGET:
        error = budget_spent(tenant, decision.budget_used, decision.period, now)
        error.headers = {**headers, "Retry-After": str(math.ceil(decision.retry_after_s)), "x-should-retry": "false"}
        return error
    if decision.never:
        headers["x-should-retry"] = "false"
        return RateLimitExceededError(
            f"Request too large for tenant {tenant.name} on tokens per min (TPM): Limit "
            f"{tenant.limits.tokens_per_minute}, Requested {reserved} (the prompt plus {max_tokens_param} x n, or "
            f"the whole context when {max_tokens_param} is not set). Lower {max_tokens_param} or shorten the prompt.",
            param=max_tokens_param, headers=headers)
    wait = decision.retry_after_s
    headers.update({"Retry-After": str(max(math.ceil(wait), 1)), "retry-after-ms": str(max(math.ceil(wait * 1000), 1))})
    if decision.reason == CONCURRENCY:
        return RateLimitExceededError(
            f"Too many concurrent requests for tenant {tenant.name}: Limit {tenant.limits.max_concurrent}. "
            "Please try again when one of them has finished.", headers=headers)
    bucket: Bucket | None = decision.requests if decision.reason == REQUESTS else decision.tokens
    unit = "requests per min (RPM)" if decision.reason == REQUESTS else "tokens per min (TPM)"
    requested = "" if decision.reason == REQUESTS else f", Requested {reserved}"
    return RateLimitExceededError(
        f"Rate limit reached for tenant {tenant.name} on {unit}: Limit {bucket.limit if bucket else 0}, "
        f"Remaining {bucket.remaining if bucket else 0}{requested}. Please try again in {duration_text(wait)}.",
        headers=headers)


def model_refused(model: str) -> ModelNotFoundError:
    # OpenAI's words for a model a key may not use: it does not say whether the model exists.
    return ModelNotFoundError(f"The model `{model}` does not exist or you do not have access to it.", param="model")


async def buffered_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a receive that hands it to the app again."""
    messages: list[Message] = []
    body = bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            messages = [{"type": "http.request", "body": bytes(body), "more_body": False}]
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return bytes(body), replay


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None  # the route refuses it with 400; nothing is reserved for it


def next_sequence_number(chunk: bytes) -> int:
    """The number after the last /v1/responses event in `chunk` (each chunk the app sends holds
    whole events; the top-level `sequence_number` is the only one in an event)."""
    at = chunk.rfind(b'"sequence_number":')
    if at < 0:
        return 0
    digits = re.match(rb"\s*(\d+)", chunk[at + len(b'"sequence_number":'):])
    return int(digits.group(1)) + 1 if digits else 0


class _StreamEnded(Exception):
    """Raised into the app to stop a stream this middleware has already ended."""


class TenantLimitMiddleware:
    """Before a generation request: the tenant's model allow-list (404) and limiter (429 over a
    limit or the budget). After it (the last byte sent, or the client gone): settle the decision
    with the tokens the request really used, which serving reports as it runs in the request's
    stats (`scope["state"]["stats"]`, the object the access log reads too), and record the
    tenant's usage and metrics. With `auth.end_streams_over_budget`, a stream that runs past its
    share of the budget is ended with a final `insufficient_quota` event.

    Runs inside BodyLimitMiddleware, so the body it reads is capped.
    """

    def __init__(self, app: ASGIApp, tenancy: Tenancy, metrics: GatewayMetrics,
                 context_length: Callable[[], int | None], served_model: Callable[[], str]) -> None:
        self.app = app
        self.tenancy = tenancy
        self.metrics = metrics
        self.context_length = context_length
        self.served_model = served_model
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # A reloaded keys file may remove a tenant's budget gauges: look the children up afresh.
        tenancy.add_directory_listener(lambda _: self._children.clear())

    def _child(self, family: Any, *label_values: str) -> Any:
        """A metric's child, looked up once: labels() takes a lock and builds a key on every call."""
        key = (id(family), label_values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*label_values)
        return child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path not in LIMITED_ROUTES or scope["method"] != "POST":
            if path == "/v1/models" and scope["method"] == "GET":
                tenant = scope.get("state", {}).get("tenant")
                if tenant is not None and tenant.limits.models is not None and self.served_model() not in tenant.limits.models:
                    await self._send_json(send, 200, {"object": "list", "data": []})
                    return
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        tenant: Tenant = state.get("tenant") or self.tenancy.unnamed
        limits = tenant.limits
        decision: Decision | None = None
        if self.tenancy.enabled and (limits.any or limits.models is not None):
            body: Any = None
            if limits.counts_tokens or limits.models is not None:
                raw, receive = await buffered_body(receive)
                body = parse_json(raw)
            if limits.models is not None:
                model = (body.get("model") if isinstance(body, dict) else None) or self.served_model()
                if model not in limits.models:
                    await self._refuse(send, state, tenant, model_refused(str(model)))
                    return
            if limits.any:
                reserved = reserved_tokens(body, LIMITED_ROUTES[path], self.context_length()) if limits.counts_tokens else 0
                decision = await self._decide(tenant, reserved)
                if not decision.allowed:
                    state["rejection_reason"] = "budget" if decision.reason == BUDGET else "rate_limit"
                    self._child(self.metrics.tenant_rate_limited, tenant.name, decision.reason or "").inc()
                    param = "max_output_tokens" if LIMITED_ROUTES[path] == "responses" else "max_tokens"
                    await self._refuse(send, state, tenant, refusal_error(decision, self.tenancy.clock(), param))
                    return
        await self._run(scope, receive, send, state, tenant, decision)

    async def _decide(self, tenant: Tenant, reserved: int) -> Decision:
        started = time.perf_counter()
        decision = await self.tenancy.admit(tenant, reserved)
        assert decision is not None  # the tenant has limits
        self._child(self.metrics.limiter_duration, decision.backend).observe(time.perf_counter() - started)
        if decision.degraded:
            self.metrics.limiter_degraded.inc()
        if decision.budget_used is not None:
            self._child(self.metrics.tenant_budget_used, tenant.name).set(decision.budget_used)
        return decision

    @staticmethod
    async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
        await send_error(send, status, "", body=payload)

    async def _refuse(self, send: Send, state: dict[str, Any], tenant: Tenant, error: GatewayError) -> None:
        self._child(self.metrics.tenant_requests, tenant.name, str(error.status)).inc()
        self.tenancy.refused(tenant)
        await send_gateway_error(send, error)

    async def _run(self, scope: Scope, receive: Receive, send: Send, state: dict[str, Any],
                   tenant: Tenant, decision: Decision | None) -> None:
        ended = False
        if decision is not None:
            # MetricsMiddleware (outermost) adds them to the response's start.
            state["response_headers"] = [(k.encode(), v.encode()) for k, v in ratelimit_headers(decision).items()]
        if decision is not None and self.tenancy.auth.end_streams_over_budget and tenant.limits.budget_tokens is not None:
            downstream, streaming = send, False
            responses = scope["path"] == "/v1/responses"  # its events are numbered, and there is no [DONE]

            async def send_limited(message: Message) -> None:
                nonlocal streaming, ended
                if ended:  # the app's next step after the end this middleware sent: stop it
                    raise _StreamEnded()
                if message["type"] == "http.response.start":
                    streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
                elif streaming and message.get("more_body") and self._over_budget(state, decision):
                    error = budget_spent(tenant, decision.budget_used, decision.period, self.tenancy.clock())
                    if responses:
                        end = responses_error_event(error, next_sequence_number(message.get("body", b"")))
                    else:
                        end = sse_error_event(error) + "data: [DONE]\n\n"
                    message["body"] = message.get("body", b"") + end.encode()
                    message["more_body"] = False
                    ended = True
                await downstream(message)

            send = send_limited
        try:
            await self.app(scope, receive, send)
        except _StreamEnded:
            pass
        except Exception:
            if not ended:
                raise
        finally:
            stats = state.get("stats")
            prompt = stats.prompt_tokens if stats is not None else 0
            completion = stats.completion_tokens if stats is not None else 0
            # MetricsMiddleware (outermost) notes the status as the response starts.
            status = state.get("status", 500)
            self._child(self.metrics.tenant_requests, tenant.name, str(status)).inc()
            self._child(self.metrics.tenant_tokens, tenant.name, "prompt").inc(prompt)
            self._child(self.metrics.tenant_tokens, tenant.name, "completion").inc(completion)
            if ended:
                self._child(self.metrics.tenant_rate_limited, tenant.name, BUDGET).inc()
            if self.tenancy.enabled:
                await self._finish(tenant, decision, prompt, completion, error=status >= 400 or ended)

    @staticmethod
    def _over_budget(state: dict[str, Any], decision: Decision) -> bool:
        stats = state.get("stats")
        return stats is not None and stats.prompt_tokens + stats.completion_tokens > decision.budget_held

    async def _finish(self, tenant: Tenant, decision: Decision | None, prompt: int, completion: int,
                      *, error: bool) -> None:
        try:
            used = await self.tenancy.finish(tenant, decision, prompt, completion, error=error)
        except Exception:  # a failed settlement must not turn a served request into an error
            logger.exception("settling tenant %s's request failed", tenant.name)
            return
        if used is not None:
            self._child(self.metrics.tenant_budget_used, tenant.name).set(used)
