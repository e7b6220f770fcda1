"""OpenAI wire models: requests, responses, stream chunks and the error body.

Requests accept and ignore unknown fields, as `vllm serve` does; response models carry the
fields the OpenAI API defines plus vLLM's `stop_reason` (see tests/integration for the list of
deliberate differences from vLLM's own server).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

Prompt = str | list[str] | list[int] | list[list[int]]


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _find_invalid(value: Any, path: str) -> tuple[str, str] | None:
    """The path of the first unacceptable value and why: a string that is not valid Unicode (lone
    surrogates from JSON escapes), or an integer beyond 64 bits (vLLM's engine cannot carry it;
    `vllm serve` bounds `seed` the same way)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path, "contains a lone surrogate (invalid Unicode)"
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return path, f"must be a 64-bit integer (from {INT64_MIN} to {INT64_MAX})"
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := _find_invalid(item, f"{path}.{key}" if path else str(key))) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _find_invalid(item, f"{path}[{i}]")) is not None:
                return found
    return None


class ApiRequest(BaseModel):
    """Base of request bodies: unknown fields are accepted (and ignored), as `vllm serve` does;
    strings must be valid Unicode (JSON allows lone surrogate escapes, tokenizers do not) and
    integers must fit in 64 bits (JSON allows any size)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        if (found := _find_invalid(data, "")) is not None:
            path, problem = found
            # The top-level field becomes the error's `param` (see server.app).
            field = path.split(".", 1)[0].split("[", 1)[0]
            raise PydanticCustomError("invalid_value", "{path} {problem}",
                                      {"path": path, "problem": problem, "field": field})
        return data


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    """Send a last chunk with the `usage` block and no choices."""

    continuous_usage_stats: bool | None = False
    """Accepted for vLLM compatibility; per-chunk usage is not sent."""


class CompletionRequest(ApiRequest):
    """`POST /v1/completions` body (OpenAI legacy completions, plus vLLM's extensions)."""

    model: str | None = None
    prompt: Prompt = Field(..., description="Text, list of texts, token ids, or list of token-id lists.")
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    best_of: int | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of the conversation. Text content only (the served models are text-only)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant message's earlier calls (OpenAI's shape; checked in server.serving.tools)."""
    tool_call_id: str | None = None
    """A `tool` message: the id of the call it answers."""


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(ApiRequest):
    """`POST /v1/chat/completions` body (OpenAI chat completions, plus vLLM's sampling extensions)."""

    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ChatLogprobTop(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning: str | None = None
    """The model's reasoning, split off by the profile's reasoning parser; vLLM's field name
    (0.26 and 0.32 alike; they no longer send `reasoning_content`)."""


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llm-gateway"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
