"""The outermost middleware: every request counted, timed and logged in one structured line."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import UNMEASURED_ROUTES, GatewayMetrics
from server.middleware.asgi import header
from server.request_state import STATE_KEY, RequestState

logger = logging.getLogger("llm_gateway.access")

MEASURED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                             "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize"})
"""Routes with a `route` label of their own; any other path counts as `other`."""


class AccessMiddleware:
    """Counts, times and logs every request, and makes its `RequestState` (pure ASGI, so
    streaming is not buffered). `weights` names the weights serving now (in-place reloads swap
    them), for the access line of a generation request."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, weights: Callable[[], str | None]) -> None:
        self.app = app
        self.metrics = metrics
        self.weights = weights

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        path = scope["path"]
        state = RequestState(started=started, request_id=_request_id(scope))
        scope.setdefault("state", {})[STATE_KEY] = state
        measured = path not in UNMEASURED_ROUTES
        route = path if path in MEASURED_ROUTES else "other"
        request_id_header = (b"x-request-id", state.request_id.encode("latin-1", "replace"))

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                state.status = message["status"]
                # Inner layers leave theirs in the state (the tenant's x-ratelimit-*), which
                # spares every streamed chunk a send wrapper of their own.
                message["headers"] = [*message.get("headers", ()), *state.response_headers, request_id_header]
            await send(message)

        if measured:
            self.metrics.in_flight.labels(route=route).inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            duration = time.monotonic() - started
            status = state.status if state.status is not None else 500
            if measured:
                self.metrics.in_flight.labels(route=route).dec()
                self.metrics.requests.labels(route=route, status=str(status)).inc()
                self.metrics.request_duration.labels(route=route).observe(duration)
                if route != "other" and 400 <= status < 600 and status != 499:
                    # Unknown paths (scanners, typos) are not rejected traffic.
                    self.metrics.observe_rejection(status, state.rejection_reason)
                weights = self.weights() if state.stats is not None else None
                logger.info(access_line(scope.get("method"), path, state, status, duration, weights))


def access_line(method: str | None, path: str, state: RequestState, status: int, duration: float,
                weights: str | None) -> str:
    """One structured line per request; never the prompt or the output."""
    parts = [f"request_id={state.request_id}", f"method={method}", f"route={path}", f"status={status}"]
    if state.tenant is not None:
        parts.append(f"tenant={state.tenant.name}")
    stats = state.stats
    if stats is not None:
        parts.append(f"completion_id={state.completion_id}")
        parts.append(f"prompt_tokens={stats.prompt_tokens} completion_tokens={stats.completion_tokens}")
        if stats.first_token_at is not None:
            parts.append(f"ttft_ms={(stats.first_token_at - state.started) * 1000:.1f}")
        parts.append(f"finish={','.join(sorted(set(stats.finish_reasons))) or '-'}")
        parts.append(f"completed={str(stats.completed).lower()}")
        if weights is not None:  # which version answered (in-place reloads)
            parts.append(f"weights={weights}")
    parts.append(f"duration_ms={duration * 1000:.1f}")
    return " ".join(parts)


def _request_id(scope: Scope) -> str:
    """The client's X-Request-ID if it is printable (cut to 128 characters), else a new one."""
    value = header(scope, b"x-request-id")
    if value is not None:
        text = value.decode("latin-1")[:128]
        if text and text.isprintable():
            return text
    return uuid.uuid4().hex
