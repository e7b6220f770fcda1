"""`/v1/messages` and `/v1/messages/count_tokens` wire models (Anthropic Messages API: text,
client tools, thinking blocks sent back, nothing stored).

Requests accept and ignore unknown fields (`cache_control`, `service_tier`, ...), as `vllm serve`
does; content blocks this gateway cannot feed to a text model (images, documents, server tools)
are refused with a 400 naming them. Streams are SSE `event: <type>` + `data: <event>` pairs
(see server.serving.messages for the order). The error body is built by server.errors.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from server.protocol.openai import ApiRequest


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call the model made in an earlier turn (sent back in an assistant message)."""

    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    """The result of an earlier `tool_use` (same id), in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An earlier turn's thinking, sent back as the SDK returns it: accepted and left out of the
    prompt (the chat templates here drop an earlier turn's reasoning)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_type(block: Any) -> str:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if isinstance(kind, str) else "text"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_type),
]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    """A client tool (`custom`): the model may call it with `input` matching `input_schema`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["custom"] | None = None
    name: str = Field(..., min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(..., description="A JSON schema object for the tool's input.")


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='The tool to call (type "tool").')
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one tool call.")


class MessagesRequest(ApiRequest):
    """`POST /v1/messages` body."""

    model: str
    messages: list[MessageParam] = Field(..., description="The conversation, user and assistant turns.")
    max_tokens: int = Field(..., description="The most tokens to generate (required, as in Anthropic's API).")
    system: str | list[TextBlock] | None = Field(None, description="The system prompt, text or text blocks.")
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="Accepted (`user_id`) and not used.")
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = Field(None, description='{"type": "auto"} (the default with tools), '
                                           '"any", "none", or {"type": "tool", "name": ...}.')


class CountTokensRequest(ApiRequest):
    """`POST /v1/messages/count_tokens` body: a messages request without the generation fields."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class TextOutput(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseOutput(BaseModel):
    """A call the model made: run it and send back a `tool_result` block with this id."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingOutput(BaseModel):
    """The model's reasoning (the profile's `reasoning_parser`); the signature is a random token
    (nothing here verifies it) so that clients that send thinking back keep working."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


OutputBlock = TextOutput | ToolUseOutput | ThinkingOutput

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class ErrorDetail(BaseModel):
    type: str = Field(..., description="`invalid_request_error`, `authentication_error`, `not_found_error`, "
                      "`request_too_large`, `rate_limit_error`, `api_error`, `overloaded_error`, `timeout_error`.")
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body (server.errors.anthropic_error_body builds it)."""

    type: Literal["error"] = "error"
    error: ErrorDetail
