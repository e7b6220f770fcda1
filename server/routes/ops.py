"""Operational routes: /health, /ready, /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.holder import EngineHolder
from server.metrics import exposition

router = APIRouter()


@router.get("/health", summary="200 while the engine lives, 503 once it died")
async def health(request: Request) -> JSONResponse:
    holder: EngineHolder = request.app.state.holder
    alive = holder.is_alive()
    return JSONResponse(
        {"status": "ok" if alive else "dead", "state": holder.state.value},
        status_code=200 if alive else 503,
    )


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
    return JSONResponse(holder.status())
