"""A tenant's limits around each generation request: before it, the model allow-list (404) and the
limiter (429 over a rate limit or the budget); after it (the last byte sent, or the client gone),
the decision settled with the tokens the request really used, and the tenant's usage and metrics.

A tenant that counts tokens (tokens_per_minute, budget_tokens) is decided once serving has
tokenized the prompt, on the exact reservation (`server.tenants.reservation`): this middleware
hands serving the admission (`RequestState.admission`) instead of guessing from the body. A
request refused before that point (validation, no engine) takes nothing from the limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import GatewayError, RequestTimeoutError, anthropic_error_event, responses_error_event, sse_error_event
from server.metrics import GatewayMetrics
from server.middleware.asgi import buffered_body, send_error, send_gateway_error
from server.request_state import RequestState, RequestStats, Turn, request_state
from server.settings.keys_file import Tenant
from server.tenants.limiter import BUDGET, Decision
from server.tenants.refusals import budget_spent, model_refused, ratelimit_headers, refusal_error
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway.tenants")

# The generation routes tenant limits apply to, and the kind of body each takes.
LIMITED_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
                  "/v1/messages": "messages"}


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


class _Admission:
    """One request's trip through its tenant's limiter: decided in this middleware (a tenant that
    counts no tokens) or when serving calls `admit` with the exact reservation."""

    def __init__(self, owner: TenantLimitMiddleware, state: RequestState, tenant: Tenant, param: str) -> None:
        self.owner = owner
        self.state = state
        self.tenant = tenant
        self.param = param  # the route's name for max_tokens, for the "request too large" 429
        self.decision: Decision | None = None
        self._pending: asyncio.Future[Decision] | None = None

    def admitted(self, decision: Decision) -> None:
        self.decision = decision
        # The access middleware (outermost) adds them to the response's start.
        self.state.response_headers = [(k.encode(), v.encode()) for k, v in ratelimit_headers(decision).items()]

    def refused(self, decision: Decision) -> None:
        self.decision = decision
        self.state.rejection_reason = "budget" if decision.reason == BUDGET else "rate_limit"
        self.owner._child(self.owner.metrics.tenant_rate_limited, self.tenant.name, decision.reason or "").inc()

    async def admit(self, reserved: int) -> None:
        """Serving's call (`RequestStats.admit`): take `reserved` tokens, or raise the 429."""
        if self._pending is not None:  # one decision per request
            return
        self._pending = asyncio.ensure_future(self.owner._decide(self.tenant, reserved))
        # Shielded: a client gone while Redis answers must not lose a decision that took tokens
        # and a slot; `settled` waits for it and the middleware gives them back.
        decision = await asyncio.shield(self._pending)
        if not decision.allowed:
            self.refused(decision)
            raise refusal_error(decision, self.owner.tenancy.clock(), self.param)
        self.admitted(decision)


    async def settled(self) -> Decision | None:
        """The decision, once a pending one (its request cancelled) has come back."""
        if self.decision is None and self._pending is not None and not self._pending.cancelled():
            try:
                self.decision = await self._pending
            except Exception:  # the limiter failed: nothing was taken
                return None
        return self.decision


class TenantLimitMiddleware:
    """Before a generation request: the tenant's model allow-list (404) and limiter (429 over a
    limit or the budget; for a tenant that counts tokens, when serving calls the admission with the
    exact reservation, see the module docstring). After it (the last byte sent, or the client gone): settle the decision
    with the tokens the request really used, which serving reports as it runs in the request's
    stats (`RequestState.stats`, the object the access log reads too), and record the
    tenant's usage and metrics. With `auth.end_streams_over_budget`, a stream that runs past its
    share of the budget is ended with a final `insufficient_quota` event.

    Runs inside BodyLimitMiddleware, so the body it reads is capped.
    """

    def __init__(self, app: ASGIApp, tenancy: Tenancy, metrics: GatewayMetrics,
                 served_model: Callable[[], str],
                 queue_timeout: Callable[[], float | None] = lambda: None) -> None:
        self.app = app
        self.tenancy = tenancy
        self.metrics = metrics
        self.served_model = served_model
        self.queue_timeout = queue_timeout
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # A reloaded keys file may remove a tenant's budget gauges: look the children up afresh.
        tenancy.add_directory_listener(lambda _: self._children.clear())
        if tenancy.fair is not None:
            tenancy.fair.listeners.append(
                lambda name, waiting: self._child(self.metrics.tenant_queued, name).set(waiting))

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
                tenant = request_state(scope).tenant
                if tenant is not None and tenant.limits.models is not None and self.served_model() not in tenant.limits.models:
                    await self._send_json(send, 200, {"object": "list", "data": []})
                    return
            await self.app(scope, receive, send)
            return
        state = request_state(scope)
        tenant: Tenant = state.tenant or self.tenancy.unnamed
        limits = tenant.limits
        admission: _Admission | None = None
        if self.tenancy.enabled and (limits.any or limits.models is not None):
            if limits.models is not None:
                raw, receive = await buffered_body(receive)
                body = parse_json(raw)
                model = (body.get("model") if isinstance(body, dict) else None) or self.served_model()
                if model not in limits.models:
                    await self._refuse(send, path, tenant, model_refused(str(model)))
                    return
            if limits.any:
                param = "max_output_tokens" if LIMITED_ROUTES[path] == "responses" else "max_tokens"
                admission = _Admission(self, state, tenant, param)
                if limits.counts_tokens:
                    # Decided once serving has tokenized the prompt: the exact reservation.
                    state.admission = admission.admit
                else:
                    decision = await self._decide(tenant, 0)
                    if not decision.allowed:
                        admission.refused(decision)
                        await self._refuse(send, path, tenant, refusal_error(decision, self.tenancy.clock(), param))
                        return
                    admission.admitted(decision)
        if self.tenancy.fair is not None:
            state.turn = self._turn(tenant)
        await self._run(scope, receive, send, state, tenant, admission)

    def _turn(self, tenant: Tenant) -> Turn:
        """The request's turn in a full engine (`Tenancy.fair`), timed into the tenant's metrics."""
        fair = self.tenancy.fair
        assert fair is not None

        @contextlib.asynccontextmanager
        async def turn(stats: RequestStats) -> AsyncIterator[None]:
            started = time.monotonic()
            timeout = self.queue_timeout()
            place = None
            try:
                place = await fair.acquire(tenant.name, tenant.limits.share, stats.sequences,
                                           stats.prompt_tokens, timeout)
            except asyncio.TimeoutError:
                stats.prompt_tokens = 0  # it never reached the engine: nothing to charge
                raise RequestTimeoutError(
                    f"no place in the engine within {timeout} s (limits.first_token_timeout_s): other "
                    "requests held every place; aborted") from None
            finally:
                waited = time.monotonic() - started
                self._child(self.metrics.tenant_queue, tenant.name).observe(waited)
                if place is None or place.queued:  # a timeout waited too
                    stats.queue_s = waited
            try:
                yield
            finally:
                fair.release(place, stats.completion_tokens)

        return turn

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

    async def _refuse(self, send: Send, path: str, tenant: Tenant, error: GatewayError) -> None:
        self._child(self.metrics.tenant_requests, tenant.name, str(error.status)).inc()
        self.tenancy.refused(tenant)
        await send_gateway_error(send, error, path)

    async def _run(self, scope: Scope, receive: Receive, send: Send, state: RequestState,
                   tenant: Tenant, admission: _Admission | None) -> None:
        ended = False
        if admission is not None and self.tenancy.auth.end_streams_over_budget and tenant.limits.budget_tokens is not None:
            downstream, streaming = send, False
            # /v1/responses numbers its events and /v1/messages has its own `error` event; neither ends in [DONE].
            kind = LIMITED_ROUTES[scope["path"]]

            async def send_limited(message: Message) -> None:
                nonlocal streaming, ended
                if ended:  # the app's next step after the end this middleware sent: stop it
                    raise _StreamEnded()
                decision = admission.decision
                if message["type"] == "http.response.start":
                    streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in message.get("headers", ()))
                elif (streaming and message.get("more_body") and decision is not None and decision.allowed
                      and self._over_budget(state, decision)):
                    error = budget_spent(tenant, decision.budget_used, decision.period, self.tenancy.clock())
                    if kind == "responses":
                        end = responses_error_event(error, next_sequence_number(message.get("body", b"")))
                    elif kind == "messages":
                        end = anthropic_error_event(error)
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
            stats = state.stats
            decision = await admission.settled() if admission is not None else None
            refused = decision is not None and not decision.allowed
            # A request its admission refused used nothing, though its prompt was tokenized.
            prompt = stats.prompt_tokens if stats is not None and not refused else 0
            completion = stats.completion_tokens if stats is not None and not refused else 0
            # The access middleware (outermost) notes the status as the response starts.
            status = state.status if state.status is not None else 500
            self._child(self.metrics.tenant_requests, tenant.name, str(status)).inc()
            self._child(self.metrics.tenant_tokens, tenant.name, "prompt").inc(prompt)
            self._child(self.metrics.tenant_tokens, tenant.name, "completion").inc(completion)
            if ended:
                self._child(self.metrics.tenant_rate_limited, tenant.name, BUDGET).inc()
            if self.tenancy.enabled:
                await self._finish(tenant, None if refused else decision, prompt, completion,
                                   error=status >= 400 or ended, queue_s=stats.queue_s if stats is not None else None)

    @staticmethod
    def _over_budget(state: RequestState, decision: Decision) -> bool:
        stats = state.stats
        return stats is not None and stats.prompt_tokens + stats.completion_tokens > decision.budget_held

    async def _finish(self, tenant: Tenant, decision: Decision | None, prompt: int, completion: int,
                      *, error: bool, queue_s: float | None = None) -> None:
        try:
            used = await self.tenancy.finish(tenant, decision, prompt, completion, error=error, queue_s=queue_s)
        except Exception:  # a failed settlement must not turn a served request into an error
            logger.exception("settling tenant %s's request failed", tenant.name)
            return
        if used is not None:
            self._child(self.metrics.tenant_budget_used, tenant.name).set(used)
