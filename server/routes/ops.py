"""Operational routes: /health, /ready, /metrics and the admin routes (/admin/status, /admin/usage,
/admin/reload)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request

from server.errors import error_body
from server.lifecycle.holder import EngineHolder, EngineState
from server.lifecycle.slot import ReloadResult
from server.metrics import GatewayMetrics, exposition
from server.tenants.service import Tenancy

Reloader = Callable[[str | None, dict[str, Any]], Awaitable[ReloadResult]]
"""(another config file or None for the current one, overrides) -> the reload's result; raises a
GatewayError when the reload is refused before it starts."""

DAY_PATTERN = r"^\d{4}-\d{2}-\d{2}$"


class ReloadRequest(BaseModel):
    """Optional body of POST /admin/reload."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = None
    """Another YAML file to load instead of the current one."""

    engine: dict[str, Any] | None = None
    """Engine profile overrides, e.g. {"max_model_len": 2048}."""

    reload: dict[str, Any] | None = None
    """Reload overrides, e.g. {"strategy": "blue-green"}."""


def build_router(holder: EngineHolder, gateway_metrics: GatewayMetrics, tenancy: Tenancy,
                 reloader: Reloader | None) -> APIRouter:
    """The operational routes over this engine holder, metrics, tenants and reloader."""
    router = APIRouter()

    @router.get("/health", summary="200 while the engine lives and moves (or idles), 503 once it died or stalled")
    async def health() -> JSONResponse:
        if holder.is_alive():
            return JSONResponse({"status": "ok", "state": holder.state.value})
        if holder.state is EngineState.STALLED:
            body = {"status": "stalled", "state": holder.state.value, "reason": holder.stall_reason}
        else:
            body = {"status": "dead", "state": holder.state.value}
        return JSONResponse(body, status_code=503)

    @router.get("/ready", summary="200 once the engine serves, 503 before that and while draining")
    async def ready() -> JSONResponse:
        ok = holder.is_ready() and holder.is_alive()
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "state": holder.state.value},
            status_code=200 if ok else 503,
        )

    @router.get("/metrics", summary="Prometheus metrics: gateway_* and vLLM's vllm:* families")
    async def metrics(request: Request) -> Response:
        accept = request.headers.get("accept", "")
        body, content_type = exposition(gateway_metrics, openmetrics="application/openmetrics-text" in accept)
        return Response(body, media_type=content_type)

    @router.get("/admin/status", summary="Engine state, active profile, in-flight requests (admin key)")
    async def admin_status() -> JSONResponse:
        status = holder.status()
        engine = holder.engine
        status["engine_unfinished_requests"] = await engine.num_unfinished_requests() if engine else 0
        progress = engine.progress() if engine else None
        status["engine_quiet_s"] = round(progress.quiet_s, 3) if progress else 0.0
        return JSONResponse(status)

    @router.get("/admin/usage", summary="Usage per tenant and UTC day from the usage store (admin key)")
    async def admin_usage(
        start: str | None = Query(None, alias="from", pattern=DAY_PATTERN, description="first UTC day, YYYY-MM-DD"),
        end: str | None = Query(None, alias="to", pattern=DAY_PATTERN, description="last UTC day, YYYY-MM-DD"),
        tenant: str | None = Query(None, max_length=64, description="only this tenant"),
    ) -> JSONResponse:
        return JSONResponse(await tenancy.usage_report(tenant, start, end))

    @router.post("/admin/reload", summary="Re-read the keys file, and reload the engine profile if it changed or "
                 "the body asks for changes (admin key)")
    async def admin_reload(body: ReloadRequest | None = None) -> JSONResponse:
        if reloader is None:
            return JSONResponse(error_body("reload is not available on this server", 503), status_code=503)
        overrides = {k: v for k, v in {"engine": body.engine, "reload": body.reload}.items() if v} if body else {}
        result = await reloader(body.config if body else None, overrides)
        if result.outcome == "success":
            return JSONResponse(result.as_dict())
        # A reload cut short by a shutdown is the server's state, not a bad configuration.
        status = 503 if holder.closing else 422
        payload = error_body(
            f"reload {result.outcome}: {result.error}; the previous profile is serving"
            if result.outcome == "rolled_back" else f"reload failed: {result.error}",
            status,
        )
        payload["reload"] = result.as_dict()
        return JSONResponse(payload, status_code=status)

    return router
