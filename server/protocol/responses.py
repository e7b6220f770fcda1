"""`/v1/responses` wire models (OpenAI Responses API: text, function tools and reasoning, nothing stored).

The response object carries the fields the OpenAI SDK's `Response` model reads and `vllm serve`
sends, less vLLM's own plumbing (see tests/integration/test_vllm_parity_responses.py for the
deliberate differences). Streams are SSE `event: <type>` + `data: <event>` pairs, each event
numbered by `sequence_number`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from server.protocol.openai import ApiRequest


class InputText(BaseModel):
    """A text part of an input message; `output_text` is how earlier assistant turns come back."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(BaseModel):
    """An earlier call of the model (an output item sent back): joins the assistant turn before it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="The call's arguments, a JSON object as text.")
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of an earlier `function_call` (same `call_id`): a `tool` message to the model."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """An earlier turn's reasoning, sent back as the SDK returns it. Like `vllm serve`, it opens
    the assistant turn its message and calls join; the text itself does not reach the template
    (the chat templates here drop an earlier turn's reasoning)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A function the model may call (the Responses shape: name and schema at the top level)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema object for the arguments.")
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(ApiRequest):
    """`POST /v1/responses` body. Sampling extensions beyond OpenAI's are those vLLM accepts here too."""

    model: str | None = None
    input: str | list[InputItem] = Field(
        ..., description="A user message as text, or a list of items: messages, `function_call` items the "
        "model made earlier and `function_call_output` items answering them.")
    instructions: str | None = Field(None, description="A system message put before `input`.")
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stream: bool = False
    store: bool = Field(True, description="Accepted and ignored, as by `vllm serve`: responses are never stored.")
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = Field(
        None, description="Refused (404, like an unknown id): responses are not stored, so none can be continued.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call (`function_call` "
                                            "output items).")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description='"auto" (the default with tools), "none", "required" or {"type": "function", "name": ...}.')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per response.")
    user: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A call the model made: run it and send it back with a `function_call_output` of the same call_id."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningOutput(BaseModel):
    """The model's reasoning, split off by the profile's `reasoning_parser` (before the message)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    # Required by the OpenAI SDK's Response model; the gateway reports no prompt cache writes.
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    max_output_tokens: int
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "none"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    background: bool = False
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: Any = None
    service_tier: Literal["auto"] = "auto"
    text: Any = None
    top_logprobs: int | None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None


# -- stream events --------------------------------------------------------------------------


class StreamEvent(BaseModel):
    type: str
    sequence_number: int


class ResponseEvent(StreamEvent):
    """response.created / response.in_progress / response.completed."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    """response.output_item.added / response.output_item.done."""

    output_index: int = 0
    item: OutputItem


class ContentEvent(StreamEvent):
    """An event about one content part of an output item (a message's text, a reasoning text)."""

    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(ContentEvent):
    """response.content_part.added / response.content_part.done."""

    part: OutputText | ReasoningText


class FunctionCallArgumentsDeltaEvent(StreamEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(StreamEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    arguments: str
    name: str


class TextDeltaEvent(ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDeltaEvent(ContentEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    delta: str


class ReasoningTextDoneEvent(ContentEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    text: str


# A failed stream's last event, `error`, is built by server.errors.responses_error_event.
