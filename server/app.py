"""`build_app(settings, holder)`: the FastAPI application, its middleware and error handlers."""

from __future__ import annotations

import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import __version__
from server.errors import GatewayError, error_body
from server.lifecycle.holder import EngineHolder
from server.metrics import UNMEASURED_ROUTES, GatewayMetrics
from server.middleware import AuthMiddleware, BodyLimitMiddleware, TenantLimitMiddleware
from server.routes import openai as openai_routes
from server.routes import ops as ops_routes
from server.routes import tokenize as tokenize_routes
from server.serving.chat import ChatService
from server.serving.completions import CompletionService
from server.serving.responses import ResponsesService
from server.settings import Settings
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway.access")

MEASURED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                             "/tokenize", "/detokenize"})


class MetricsMiddleware:
    """Counts, times and logs every request (pure ASGI, so streaming is not buffered)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        scope.setdefault("state", {})["started"] = started
        path = scope["path"]
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        scope["state"]["request_id"] = request_id
        measured = path not in UNMEASURED_ROUTES
        route = path if path in MEASURED_ROUTES else "other"
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                scope["state"]["status"] = status  # for inner middleware that count once the app is done
                # Inner middleware leave theirs in the state (the tenant's x-ratelimit-*), which
                # spares every streamed chunk a send wrapper of their own.
                message["headers"] = [*message.get("headers", ()), *scope["state"].get("response_headers", ()),
                                      (b"x-request-id", request_id.encode("latin-1", "replace"))]
            await send(message)

        if measured:
            self.metrics.in_flight.labels(route=route).inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            duration = time.monotonic() - started
            if measured:
                self.metrics.in_flight.labels(route=route).dec()
                self.metrics.requests.labels(route=route, status=str(status)).inc()
                self.metrics.request_duration.labels(route=route).observe(duration)
                if route != "other" and 400 <= status < 600 and status != 499:
                    # Unknown paths (scanners, typos) are not rejected traffic.
                    self.metrics.observe_rejection(status, scope["state"].get("rejection_reason"))
                logger.info(access_line(scope, request_id, path, status, duration, started))


def access_line(scope: Scope, request_id: str, path: str, status: int, duration: float, started: float) -> str:
    """One structured line per request; never the prompt or the output."""
    parts = [f"request_id={request_id}", f"method={scope.get('method')}", f"route={path}", f"status={status}"]
    state = scope.get("state", {})
    if (tenant := state.get("tenant")) is not None:
        parts.append(f"tenant={tenant.name}")
    stats = state.get("stats")
    if stats is not None:
        parts.append(f"completion_id={state.get('completion_id')}")
        parts.append(f"prompt_tokens={stats.prompt_tokens} completion_tokens={stats.completion_tokens}")
        if stats.first_token_at is not None:
            parts.append(f"ttft_ms={(stats.first_token_at - started) * 1000:.1f}")
        parts.append(f"finish={','.join(sorted(set(stats.finish_reasons))) or '-'}")
        parts.append(f"completed={str(stats.completed).lower()}")
        holder = getattr(getattr(scope.get("app"), "state", None), "holder", None)
        if holder is not None and holder.weights is not None:  # which version answered (in-place reloads)
            parts.append(f"weights={holder.weights.fingerprint}")
    parts.append(f"duration_ms={duration * 1000:.1f}")
    return " ".join(parts)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            text = value.decode("latin-1")[:128]
            return text if text.isprintable() else None
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    parts = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx", {}) or {}
            return f"Request body is not valid JSON: {ctx.get('error', 'decode error')}.", None
        if not loc and "field" in (err.get("ctx") or {}):  # the message names the field itself
            parts.append(str(err.get("msg")))
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')}")
    first_loc = [str(p) for p in errors[0].get("loc", ()) if p != "body"]
    # Whole-body checks (server.protocol.openai.ApiRequest) name the field they refused in their context.
    param = first_loc[0] if first_loc else (errors[0].get("ctx") or {}).get("field")
    return "Invalid request: " + "; ".join(parts), param


def build_app(
    settings: Settings,
    holder: EngineHolder,
    *,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The gateway application. The caller owns the engine's lifecycle and the tenants' background
    work (`app.state.tenancy.start()` / `stop()`; see `server.runner.gateway`)."""
    app = FastAPI(
        title="llm-gateway",
        version=__version__,
        description="OpenAI-compatible API over vLLM's in-process engine.",
    )
    metrics = GatewayMetrics(registry)
    app.state.settings = settings
    app.state.holder = holder
    app.state.metrics = metrics
    fingerprint = f"llm-gateway-{__version__}"
    app.state.completions = CompletionService(holder, fingerprint=fingerprint)
    app.state.chat = ChatService(holder, fingerprint=fingerprint)
    app.state.responses = ResponsesService(holder, fingerprint=fingerprint)
    metrics.set_engine_state(holder.state.value)
    holder.add_state_listener(lambda state: metrics.set_engine_state(state.value))
    holder.add_reload_listener(metrics.observe_reload)
    app.state.reloader = None  # set by server.runner.gateway.Gateway, which knows how to load settings
    tenancy = Tenancy(settings)
    app.state.tenancy = tenancy
    tenancy.add_directory_listener(lambda directory: metrics.add_tenants(directory.tenants.values()))
    tenancy.add_keys_reload_listener(lambda outcome: metrics.keys_reloads.labels(outcome=outcome).inc())

    def context_length() -> int | None:
        engine = holder.engine
        return engine.info.max_model_len if engine is not None else holder.settings.engine.max_model_len

    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error.", 500), status_code=500)

    app.include_router(openai_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(ops_routes.router)
    # Starlette wraps in reverse order: metrics sees everything, auth runs before the body is read,
    # and the tenant limiter reads a body already capped.
    app.add_middleware(TenantLimitMiddleware, tenancy=tenancy, metrics=metrics, context_length=context_length,
                       served_model=lambda: holder.settings.served_model_name)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(
        AuthMiddleware,
        tenancy=tenancy,
        admin_keys=settings.auth.resolved_admin_keys(),
        open_paths=settings.auth.open_paths,
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
