"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages API): parse, call the
serving layer, respond. Errors here are in Anthropic's shape (server.errors.error_body_for)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.metrics import GatewayMetrics
from server.protocol.anthropic import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
)
from server.routes.openai import serve_generation
from server.serving.messages import MessagesService

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": AnthropicErrorResponse, "description": "Invalid request (`invalid_request_error`)"},
    401: {"model": AnthropicErrorResponse,
          "description": "Missing or wrong API key (`x-api-key` or `Authorization: Bearer`)"},
    404: {"model": AnthropicErrorResponse, "description": "Unknown model"},
    413: {"model": AnthropicErrorResponse, "description": "Request body too large"},
    429: {"model": AnthropicErrorResponse, "description": "Too many requests in flight, or over the key's rate limits "
          "or token budget (`rate_limit_error`)"},
    503: {"model": AnthropicErrorResponse, "description": "No engine can serve right now (`overloaded_error`)"},
}
MESSAGE_EVENTS = {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "The message, or with `stream: true` server-sent `event:`/`data:` pairs from "
                  "`message_start` to `message_stop` (or `error`)"}


def build_router(messages: MessagesService, metrics: GatewayMetrics) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", response_model=Message, responses={**ERROR_RESPONSES, 200: MESSAGE_EVENTS},
                 summary="Create a message (Anthropic Messages API; text and client tools, plain or streaming)")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await serve_generation(
            request, metrics, "/v1/messages", lambda rid, stats: messages.create(body, rid, stats), "msg", "_"
        )

    @router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ERROR_RESPONSES,
                 summary="Count a messages request's input tokens")
    async def count_message_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(body)

    return router
