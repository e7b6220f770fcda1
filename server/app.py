"""`build_app(...)`: the FastAPI application from the parts it serves with: its routes, middleware
and error handlers. Its owner (`server.runner.gateway`, or a test) makes the parts and runs their
lifecycles."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server import __version__
from server.errors import GatewayError, error_body_for, gateway_error_body
from server.lifecycle.holder import EngineHolder
from server.metrics import GatewayMetrics
from server.middleware.access import AccessMiddleware
from server.middleware.auth import AuthMiddleware
from server.middleware.body_limit import BodyLimitMiddleware
from server.middleware.tenant_limits import TenantLimitMiddleware
from server.routes import anthropic as anthropic_routes
from server.routes import openai as openai_routes
from server.routes import ops as ops_routes
from server.routes import tokenize as tokenize_routes
from server.routes.ops import Reloader
from server.serving.chat import ChatService
from server.serving.completions import CompletionService
from server.serving.messages import MessagesService
from server.serving.responses import ResponsesService
from server.settings import Settings
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway.access")


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
    metrics: GatewayMetrics,
    tenancy: Tenancy,
    *,
    reloader: Reloader | None = None,
) -> FastAPI:
    """The gateway application over `holder`'s engine. The caller starts and stops the engine
    and the tenants' background work (`tenancy.start()` / `stop()`); `reloader` serves
    POST /admin/reload (None: 503)."""
    app = FastAPI(
        title="llm-gateway",
        version=__version__,
        description="OpenAI-compatible API (and Anthropic's Messages API) over vLLM's in-process engine.",
    )
    fingerprint = f"llm-gateway-{__version__}"
    metrics.set_engine_state(holder.state.value)
    holder.add_state_listener(lambda state: metrics.set_engine_state(state.value))
    holder.add_reload_listener(metrics.observe_reload)
    tenancy.add_directory_listener(lambda directory: metrics.add_tenants(directory.tenants.values()))
    tenancy.add_keys_reload_listener(lambda outcome: metrics.keys_reloads.labels(outcome=outcome).inc())

    def weights() -> str | None:
        return holder.weights.fingerprint if holder.weights is not None else None

    # Each body in the dialect of the route asked for (Anthropic's on /v1/messages).
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(gateway_error_body(request.scope["path"], exc), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body_for(request.scope["path"], message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body_for(request.scope["path"], str(exc.detail), exc.status_code), status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body_for(request.scope["path"], "Internal server error.", 500), status_code=500)

    chat = ChatService(holder, fingerprint=fingerprint)
    app.include_router(openai_routes.build_router(
        completions=CompletionService(holder, fingerprint=fingerprint),
        chat=chat,
        responses=ResponsesService(holder, fingerprint=fingerprint),
        holder=holder,
        metrics=metrics,
    ))
    app.include_router(anthropic_routes.build_router(MessagesService(chat), metrics))
    app.include_router(tokenize_routes.build_router(holder))
    app.include_router(ops_routes.build_router(holder, metrics, tenancy, reloader))
    # Starlette wraps in reverse order: access sees everything, auth runs before the body is read,
    # and the tenant limiter reads a body already capped.
    if tenancy.fair is not None:  # the places of the profile serving now (a reload may change them)
        tenancy.fair.capacity = lambda: holder.settings.engine.max_num_seqs
    app.add_middleware(TenantLimitMiddleware, tenancy=tenancy, metrics=metrics,
                       served_model=lambda: holder.settings.served_model_name,
                       queue_timeout=lambda: holder.settings.limits.first_token_timeout_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    app.add_middleware(
        AuthMiddleware,
        tenancy=tenancy,
        admin_keys=settings.auth.resolved_admin_keys(),
        open_paths=settings.auth.open_paths,
    )
    app.add_middleware(AccessMiddleware, metrics=metrics, weights=weights)
    return app
