"""Pure-ASGI middleware that refuses requests before they reach a route: API keys and tenants,
body size, tenant rate limits and quotas.

This is the only module that authenticates a request and the only one that asks the tenant
limiter (`server.tenants`); routes and serving never see a tenant.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import GatewayError, InsufficientQuotaError, RateLimitExceededError, error_body
from server.metrics import GatewayMetrics
from server.tenants.keys import Tenant
from server.tenants.limiter import QUOTA, REQUESTS, Bucket, Decision, period_of, seconds_to_next_period
from server.tenants.reservation import reserved_tokens
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway.tenants")

# The generation routes tenant limits apply to, and whether their body is a chat request.
LIMITED_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}


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
            scope.setdefault("state", {})["tenant"] = directory.default
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
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(message)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:  # raised outside FastAPI's handlers (e.g. a streaming read)
            if not started:
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


def refusal_error(decision: Decision, now: float) -> GatewayError:
    """The 429 for a refused request, in OpenAI's words and shape, with its retry headers."""
    tenant, limits, reserved = decision.tenant, decision.tenant.limits, decision.reserved
    headers = ratelimit_headers(decision)
    if decision.reason == QUOTA:
        left = seconds_to_next_period(now)
        renews = period_of(now + left + 1)
        headers.update({"Retry-After": str(math.ceil(left)), "x-should-retry": "false"})
        used = decision.quota_used or 0
        why = (f"this request may use up to {reserved} tokens, more than the whole quota; lower max_tokens"
               if decision.never else f"this request may use up to {reserved} tokens (its prompt plus max_tokens x n)")
        return InsufficientQuotaError(
            f"You exceeded your current quota: tenant {tenant.name} has used {used} of its "
            f"{limits.monthly_tokens} tokens for {decision.period}, and {why}. The quota renews "
            f"with {renews} (UTC).", headers=headers)
    bucket: Bucket | None = decision.requests if decision.reason == REQUESTS else decision.tokens
    unit = "requests per min (RPM)" if decision.reason == REQUESTS else "tokens per min (TPM)"
    limit = bucket.limit if bucket else 0
    if decision.never:
        headers["x-should-retry"] = "false"
        return RateLimitExceededError(
            f"Request too large for tenant {tenant.name} on {unit}: Limit {limit}, Requested {reserved} "
            "(the prompt plus max_tokens x n, or the whole context when max_tokens is not set). "
            "Lower max_tokens or shorten the prompt.", param="max_tokens", headers=headers)
    wait = decision.retry_after_s
    headers.update({"Retry-After": str(max(math.ceil(wait), 1)), "retry-after-ms": str(max(math.ceil(wait * 1000), 1))})
    requested = "" if decision.reason == REQUESTS else f", Requested {reserved}"
    return RateLimitExceededError(
        f"Rate limit reached for tenant {tenant.name} on {unit}: Limit {limit}, "
        f"Remaining {bucket.remaining if bucket else 0}{requested}. Please try again in {duration_text(wait)}.",
        headers=headers)


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


class TenantLimitMiddleware:
    """Before a generation request: ask the tenant's limiter (429 when over a limit or the quota).
    After it (the last byte sent, or the client gone): settle the reservation with the tokens the
    request really used, which serving reports in the request's stats (`scope["state"]["stats"]`,
    the object the access log reads too), and record the tenant's usage and metrics.

    Runs inside BodyLimitMiddleware, so the body it reads to size the reservation is capped.
    """

    def __init__(self, app: ASGIApp, tenancy: Tenancy, metrics: GatewayMetrics,
                 context_length: Callable[[], int | None]) -> None:
        self.app = app
        self.tenancy = tenancy
        self.metrics = metrics
        self.context_length = context_length
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _counter(self, family: Any, *label_values: str) -> Any:
        """A counter's child, looked up once: labels() takes a lock and builds a key on every call."""
        key = (id(family), label_values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*label_values)
        return child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LIMITED_ROUTES or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        tenant: Tenant = state.get("tenant") or self.tenancy.default
        decision: Decision | None = None
        if self.tenancy.enabled and tenant.limits.any:
            reserved = 0
            if tenant.limits.counts_tokens:
                body, receive = await buffered_body(receive)
                reserved = reserved_tokens(parse_json(body), LIMITED_ROUTES[scope["path"]], self.context_length())
            try:
                decision = await self._decide(tenant, reserved)
            except GatewayError as exc:  # no Redis and tenants.on_redis_error: reject
                self._counter(self.metrics.tenant_requests, tenant.name, str(exc.status)).inc()
                await send_gateway_error(send, exc)
                return
            if not decision.allowed:
                await self._refuse(send, state, decision)
                return
        await self._run(scope, receive, send, state, tenant, decision)

    async def _decide(self, tenant: Tenant, reserved: int) -> Decision:
        started = time.perf_counter()
        try:
            decision = await self.tenancy.admit(tenant, reserved)
        except GatewayError:
            self.metrics.limiter_degraded.inc()
            raise
        assert decision is not None  # the tenant has limits
        self.metrics.limiter_duration.labels(backend=decision.backend).observe(time.perf_counter() - started)
        if decision.degraded:
            self.metrics.limiter_degraded.inc()
        if decision.quota_used is not None:
            self.metrics.tenant_quota_used.labels(tenant=tenant.name).set(decision.quota_used)
        return decision

    async def _refuse(self, send: Send, state: dict[str, Any], decision: Decision) -> None:
        name = decision.tenant.name
        state["rejection_reason"] = "quota" if decision.reason == QUOTA else "rate_limit"
        self._counter(self.metrics.tenant_rate_limited, name, decision.reason or "").inc()
        self._counter(self.metrics.tenant_requests, name, "429").inc()
        self.tenancy.refused(decision.tenant)
        await send_gateway_error(send, refusal_error(decision, self.tenancy.clock()))

    async def _run(self, scope: Scope, receive: Receive, send: Send, state: dict[str, Any],
                   tenant: Tenant, decision: Decision | None) -> None:
        if decision is not None:
            extra = [(k.encode(), v.encode()) for k, v in ratelimit_headers(decision).items()]
            downstream = send

            async def send_with_headers(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = list(message.get("headers", [])) + extra
                await downstream(message)

            send = send_with_headers
        try:
            await self.app(scope, receive, send)
        finally:
            stats = state.get("stats")
            prompt = stats.prompt_tokens if stats is not None else 0
            completion = stats.completion_tokens if stats is not None else 0
            # MetricsMiddleware (outermost) notes the status as the response starts.
            self._counter(self.metrics.tenant_requests, tenant.name, str(state.get("status", 500))).inc()
            self._counter(self.metrics.tenant_tokens, tenant.name, "prompt").inc(prompt)
            self._counter(self.metrics.tenant_tokens, tenant.name, "completion").inc(completion)
            if self.tenancy.enabled:
                await self._finish(tenant, decision, prompt, completion)

    async def _finish(self, tenant: Tenant, decision: Decision | None, prompt: int, completion: int) -> None:
        try:
            used = await self.tenancy.finish(tenant, decision, prompt, completion)
        except Exception:  # a failed settlement must not turn a served request into an error
            logger.exception("settling tenant %s's request failed", tenant.name)
            return
        if used is not None:
            self.metrics.tenant_quota_used.labels(tenant=tenant.name).set(used)
