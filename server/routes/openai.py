"""`/v1/*` routes: parse, call the serving layer, turn its result into an HTTP response."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from server.lifecycle.holder import EngineHolder
from server.metrics import GatewayMetrics
from server.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from server.protocol.responses import ResponseObject, ResponsesRequest
from server.request_state import RequestStats, request_state
from server.serving.chat import ChatService
from server.serving.completions import CompletionService
from server.serving.models import list_models
from server.serving.responses import ResponsesService
from server.serving.sse import EventStream

T = TypeVar("T")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    429: {"model": ErrorResponse, "description": "Too many requests in flight (`code` 429), or over the "
          "key's rate limits (`rate_limit_exceeded`) or token budget (`insufficient_quota`)"},
    503: {"model": ErrorResponse, "description": "No engine can serve right now"},
}
STREAM_RESPONSE = {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                   "description": "The result, or with `stream: true` server-sent events ending in `data: [DONE]`"}
RESPONSE_EVENTS = {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                   "description": "The response, or with `stream: true` server-sent `event:`/`data:` pairs from "
                   "`response.created` to `response.completed` (or `error`)"}


class ClientDisconnected(Exception):
    pass


class EventStreamResponse(StreamingResponse):
    """SSE response that releases the engine lease however the stream ends."""

    def __init__(
        self,
        stream: EventStream,
        on_close: Callable[[], None],
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(stream.events, media_type="text/event-stream", headers=STREAM_HEADERS)
        self._stream = stream
        self._on_close = on_close
        self._on_disconnect = on_disconnect
        self.completed = False  # the last body message went out: the client got the whole stream

    async def stream_response(self, send: Send) -> None:
        # Marked here rather than by wrapping `send`: a wrapper is one more coroutine per chunk
        # on the event loop.
        await super().stream_response(send)
        self.completed = True  # the final body message went out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._stream.aclose()
            self._on_close()
            if not self.completed and self._on_disconnect is not None:
                self._on_disconnect()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client leaves.

    `work` runs in this task, not a new one: a new task and the wait for it cost every request two
    turns of the event loop before it reaches the engine, and a turn of a busy loop is a whole
    iteration of it (tests/unit/test_loop_turns.py). A watcher task cancels this one when the
    client leaves; that cancellation, and only it, becomes ClientDisconnected."""
    current = asyncio.current_task()
    assert current is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                left = True
                current.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        # ours when the watcher asked for it; a cancellation from outside (shutdown) stays one
        if left and current.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


def _observe_tokens(
    metrics: GatewayMetrics, route: str, stats: RequestStats, started: float, *, streamed: bool = False
) -> None:
    """Token counters and finish reasons for every request; TTFT and TPOT for streams only.

    A non-streamed response reaches the client in one piece, so its "first token" is its last
    byte (already in gateway_request_duration_seconds); mixing it into TTFT would hide the
    gateway's overhead over vLLM's own TTFT.
    """
    metrics.prompt_tokens.labels(route=route).inc(stats.prompt_tokens)
    metrics.completion_tokens.labels(route=route).inc(stats.completion_tokens)
    for reason in stats.finish_reasons:
        metrics.finished.labels(route=route, reason=reason).inc()
    if streamed and stats.first_token_at is not None:
        ttft = stats.first_token_at - started
        metrics.ttft.labels(route=route).observe(ttft)
        if stats.completion_tokens > 1:
            tpot = (time.monotonic() - stats.first_token_at) / (stats.completion_tokens - 1)
            metrics.tpot.labels(route=route).observe(tpot)


async def serve_generation(
    request: Request, metrics: GatewayMetrics, route: str, create: Callable[[str, RequestStats], Awaitable[Any]],
    id_prefix: str, id_separator: str = "-",
) -> Response:
    """Shared by the generation routes: run, cancel on disconnect, observe, respond."""
    state = request_state(request.scope)
    # Read by the tenant limits and the access line too; serving calls the tenant's admission.
    stats = state.stats = RequestStats(admit=state.admission, turn=state.turn)
    request_id = state.completion_id = f"{id_prefix}{id_separator}{uuid.uuid4().hex[:16]}"
    try:
        result = await cancel_on_disconnect(request, create(request_id, stats))
    except ClientDisconnected:
        metrics.disconnects.labels(route=route).inc()
        return Response(status_code=499)
    if isinstance(result, EventStream):
        return EventStreamResponse(
            result,
            on_close=lambda: _observe_tokens(metrics, route, stats, state.started, streamed=True),
            on_disconnect=metrics.disconnects.labels(route=route).inc,
        )
    _observe_tokens(metrics, route, stats, state.started)
    return JSONResponse(result.model_dump(mode="json"))


def build_router(*, completions: CompletionService, chat: ChatService, responses: ResponsesService,
                 holder: EngineHolder, metrics: GatewayMetrics) -> APIRouter:
    """The `/v1/*` routes over these services."""
    router = APIRouter()

    @router.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**ERROR_RESPONSES, 200: STREAM_RESPONSE},
        summary="Create a completion (plain or streaming)",
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await serve_generation(
            request, metrics, "/v1/completions", lambda rid, stats: completions.create(body, rid, stats), "cmpl"
        )

    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERROR_RESPONSES, 200: STREAM_RESPONSE},
        summary="Create a chat completion (plain or streaming)",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve_generation(
            request, metrics, "/v1/chat/completions", lambda rid, stats: chat.create(body, rid, stats), "chatcmpl"
        )

    @router.post(
        "/v1/responses",
        response_model=ResponseObject,
        responses={**ERROR_RESPONSES, 200: RESPONSE_EVENTS},
        summary="Create a response (OpenAI Responses API; text and function tools, nothing stored)",
    )
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await serve_generation(
            request, metrics, "/v1/responses", lambda rid, stats: responses.create(body, rid, stats), "resp", "_"
        )

    @router.get("/v1/models", response_model=ModelList, summary="List the served model")
    async def show_models() -> ModelList:
        return list_models(holder)

    return router
