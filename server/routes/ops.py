"""Operational routes: /health, /ready, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from server.errors import error_body
from server.lifecycle.holder import EngineHolder, EngineState
from server.metrics import exposition

router = APIRouter()


@router.get("/health", summary="200 while the engine lives and moves (or idles), 503 once it died or stalled")
async def health(request: Request) -> JSONResponse:
    holder: EngineHolder = request.app.state.holder
    if holder.is_alive():
        return JSONResponse({"status": "ok", "state": holder.state.value})
    if holder.state is EngineState.STALLED:
        body = {"status": "stalled", "state": holder.state.value, "reason": holder.stall_reason}
    else:
        body = {"status": "dead", "state": holder.state.value}
    return JSONResponse(body, status_code=503)


@router.get("/ready", summary="200 once the engine serves, 503 before that and while draining")
async def ready(request: Request) -> JSONResponse:
    holder: EngineHolder = request.app.state.holder
    ok = holder.is_ready() and holder.is_alive()
    return JSONResponse(
        {"status": "ready" if ok else "not ready", "state": holder.state.value},
        status_code=200 if ok else 503,
    )


@router.get("/metrics", summary="Prometheus metrics: gateway_* and vLLM's vllm:* families")
async def metrics(request: Request) -> Response:
    accept = request.headers.get("accept", "")
    body, content_type = exposition(
        request.app.state.metrics, openmetrics="application/openmetrics-text" in accept
    )
    return Response(body, media_type=content_type)


@router.get("/admin/status", summary="Engine state, active profile, in-flight requests (admin key)")
async def admin_status(request: Request) -> JSONResponse:
    holder: EngineHolder = request.app.state.holder
    status = holder.status()
    engine = holder.engine
    status["engine_unfinished_requests"] = await engine.num_unfinished_requests() if engine else 0
    progress = engine.progress() if engine else None
    status["engine_quiet_s"] = round(progress.quiet_s, 3) if progress else 0.0
    return JSONResponse(status)


DAY_PATTERN = r"^\d{4}-\d{2}-\d{2}$"


@router.get("/admin/usage", summary="Usage per tenant and UTC day from the usage store (admin key)")
async def admin_usage(
    request: Request,
    start: str | None = Query(None, alias="from", pattern=DAY_PATTERN, description="first UTC day, YYYY-MM-DD"),
    end: str | None = Query(None, alias="to", pattern=DAY_PATTERN, description="last UTC day, YYYY-MM-DD"),
    tenant: str | None = Query(None, max_length=64, description="only this tenant"),
) -> JSONResponse:
    return JSONResponse(await request.app.state.tenancy.usage_report(tenant, start, end))


class ReloadRequest(BaseModel):
    """Optional body of POST /admin/reload."""

    model_config = ConfigDict(extra="forbid")

    config: str | None = None
    """Another YAML file to load instead of the current one."""

    engine: dict[str, Any] | None = None
    """Engine profile overrides, e.g. {"max_model_len": 2048}."""

    reload: dict[str, Any] | None = None
    """Reload overrides, e.g. {"strategy": "blue-green"}."""


@router.post("/admin/reload", summary="Re-read the keys file, and reload the engine profile if it changed or "
             "the body asks for changes (admin key)")
async def admin_reload(request: Request, body: ReloadRequest | None = None) -> JSONResponse:
    reloader = request.app.state.reloader
    if reloader is None:
        return JSONResponse(error_body("reload is not available on this server", 503), status_code=503)
    overrides = {k: v for k, v in {"engine": body.engine, "reload": body.reload}.items() if v} if body else {}
    result = await reloader(body.config if body else None, overrides)
    if result.outcome == "success":
        return JSONResponse(result.as_dict())
    # A reload cut short by a shutdown is the server's state, not a bad configuration.
    status = 503 if request.app.state.holder.closing else 422
    payload = error_body(
        f"reload {result.outcome}: {result.error}; the previous profile is serving"
        if result.outcome == "rolled_back" else f"reload failed: {result.error}",
        status,
    )
    payload["reload"] = result.as_dict()
    return JSONResponse(payload, status_code=status)
