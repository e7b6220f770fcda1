"""Server-sent events: the framing, the stream a route sends, and the final error event of a stream
that failed after it started."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from server.errors import GatewayError, InternalError

logger = logging.getLogger("llm_gateway.serving")

DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class EventStream:
    """SSE strings for a streaming response; `aclose` releases the engine lease."""

    events: AsyncIterator[str]
    aclose: Callable[[], Awaitable[None]]


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def stream_failure(exc: BaseException, request_id: str) -> GatewayError:
    """What a stream that failed after it started tells the client (logged here, once)."""
    if not isinstance(exc, GatewayError):
        logger.error("stream %s failed", request_id, exc_info=exc)
        return InternalError(f"generation failed: {exc!r}")
    logger.warning("stream %s failed: %s", request_id, exc.message)
    return exc


def sse_error(exc: BaseException, request_id: str) -> str:
    """The final SSE event of a stream that failed after it started."""
    return sse(json.dumps(stream_failure(exc, request_id).body(), ensure_ascii=False))
