"""`/v1/responses` items and tools in the chat shapes, so the chat machinery serves them.

As `vllm serve` converts them: `instructions` is a system message; a `function_call` item joins
the assistant message before it (or starts one) as a tool call; a `function_call_output` item is
a `tool` message; a `reasoning` item opens an assistant turn. Responses-shaped tools and
tool_choice become chat's, and server.serving.tools plans and reads the calls; its calls come back
as `function_call` output items, the reasoning the profile's parser splits off as a `reasoning` item.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from server.engine import Engine
from server.errors import InvalidRequestError
from server.protocol.openai import ChatCompletionRequest, ChatMessage
from server.protocol.responses import (
    ContentPartEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionToolChoice,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningOutput,
    ReasoningText,
    ResponsesRequest,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from server.serving.chat import chat_message_dicts
from server.serving.tools import ToolPlan, plan_tools, read_tool_calls, tool_message_fields


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:16]}"


def new_reasoning_id() -> str:
    return f"rs_{uuid.uuid4().hex[:16]}"


def new_function_call_id() -> str:
    return f"fc_{uuid.uuid4().hex[:16]}"


# -- request ------------------------------------------------------------------------------------


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The Responses tools (`name`, `parameters`, ... at the top level) in chat's shape."""
    if not req.tools:
        return None
    return [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in req.tools]


def chat_tool_choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = req.tool_choice
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    if choice == "auto" and not req.tools:
        return None  # OpenAI's default, echoed as "none" without tools (as `vllm serve` does)
    return choice


def plan_response_tools(engine: Engine, req: ResponsesRequest) -> ToolPlan:
    """chat's plan (server.serving.tools.plan_tools) for the request's tools and tool_choice."""
    as_chat = ChatCompletionRequest.model_construct(
        tools=chat_tools(req), tool_choice=chat_tool_choice(req), parallel_tool_calls=req.parallel_tool_calls)
    return plan_tools(engine, as_chat)


def echoed_tool_choice(req: ResponsesRequest) -> str | FunctionToolChoice:
    """tool_choice as the response object carries it: the request's, "auto" by default with tools."""
    if not req.tools:
        return "none"
    return req.tool_choice if req.tool_choice is not None else "auto"


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` then `input` as chat messages with their tool fields (for the chat template)."""
    messages = _chat_messages(req)
    dicts = chat_message_dicts(messages, param="input")
    for message, extra in zip(dicts, tool_message_fields(messages), strict=True):
        message.update(extra)
    return dicts


def _chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if req.instructions is not None:
        messages.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        messages.append(ChatMessage(role="user", content=req.input))
        return messages
    if not req.input:
        raise InvalidRequestError("input must contain at least one message.", param="input")
    call_ids: set[str] = set()
    for i, item in enumerate(req.input):
        prev = messages[-1] if messages and messages[-1].role == "assistant" else None
        if isinstance(item, FunctionCallItem):
            _check_arguments(item, i)
            call_ids.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if prev is not None:
                prev.tool_calls = [*(prev.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                raise InvalidRequestError(
                    f"input[{i}] (reasoning) has encrypted_content, which this server cannot read; "
                    "send the reasoning as content, or leave the item out.", param="input")
            if prev is None:  # as vLLM: it opens the assistant turn its message and calls join
                messages.append(ChatMessage(role="assistant", content=None))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise InvalidRequestError(
                    f"input[{i}] (function_call_output) has call_id {item.call_id!r}, which answers no "
                    "earlier function_call item in input.", param="input")
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
            if item.role == "assistant" and prev is not None and prev.content is None:
                prev.content = content  # vLLM joins it to the calls-only turn before it
            else:
                messages.append(ChatMessage(role=item.role, content=content))
    return messages


def _check_arguments(item: FunctionCallItem, index: int) -> None:
    try:
        arguments = json.loads(item.arguments) if item.arguments.strip() else {}
    except ValueError as exc:
        raise InvalidRequestError(f"input[{index}].arguments (function_call) is not valid JSON.",
                                  param="input") from exc
    if not isinstance(arguments, dict):
        raise InvalidRequestError(f"input[{index}].arguments (function_call) must be a JSON object.",
                                  param="input")


# -- output -------------------------------------------------------------------------------------


def reasoning_items(reasoning: tuple[str, str] | None, status: str) -> list[OutputItem]:
    """The `reasoning` item of (item id, text), if any."""
    if reasoning is None:
        return []
    return [ReasoningOutput(id=reasoning[0], content=[ReasoningText(text=reasoning[1])],
                            status=status)]  # type: ignore[arg-type]


def output_items(plan: ToolPlan, text: str | None, finish_reason: str | None, status: str,
                 reasoning: tuple[str, str] | None = None) -> tuple[list[OutputItem], str | None]:
    """A finished generation as output items (and the finish reason for the stats): the text as
    one message; with tools, the text left beside the calls (if any) and one `function_call` per
    call, as `vllm serve` builds them. `reasoning` (item id, text) comes first as a `reasoning`
    item, and a reasoning parser's empty content gives no message (as `vllm serve`)."""
    items: list[OutputItem] = reasoning_items(reasoning, status)
    if not plan.parses_output:
        if text or reasoning is None:
            items.append(OutputMessage(id=new_message_id(), status=status,  # type: ignore[arg-type]
                                       content=[OutputText(text=text or "")]))
        return items, finish_reason
    content, calls, finish_reason = read_tool_calls(plan, text or "", finish_reason)
    if content:
        items.append(OutputMessage(id=new_message_id(), status=status,  # type: ignore[arg-type]
                                   content=[OutputText(text=content)]))
    # Parsed calls are whole; a named call's arguments are the raw output, which may be cut off.
    call_status = status if plan.mode == "named" else "completed"
    items.extend(
        FunctionCallOutput(id=new_function_call_id(), call_id=call.id, name=call.function.name,
                           arguments=call.function.arguments, status=call_status)  # type: ignore[arg-type]
        for call in calls
    )
    return items, finish_reason


Events = Iterator[tuple[type[StreamEvent], dict[str, Any]]]


def function_call_events(item: FunctionCallOutput, index: int) -> Events:
    """A finished call's stream events (unnumbered): added (no arguments yet), the arguments as
    one delta, their done event, the item done."""
    started = item.model_copy(update={"arguments": "", "status": "in_progress"})
    yield OutputItemEvent, {"type": "response.output_item.added", "output_index": index, "item": started}
    yield FunctionCallArgumentsDeltaEvent, {"item_id": item.id, "output_index": index, "delta": item.arguments}
    yield FunctionCallArgumentsDoneEvent, {"item_id": item.id, "output_index": index,
                                           "arguments": item.arguments, "name": item.name}
    yield OutputItemEvent, {"type": "response.output_item.done", "output_index": index, "item": item}


def message_opening(item_id: str, index: int = 0) -> Events:
    yield OutputItemEvent, {"type": "response.output_item.added", "output_index": index,
                            "item": OutputMessage(id=item_id, status="in_progress", content=[])}
    yield ContentPartEvent, {"type": "response.content_part.added", "item_id": item_id,
                             "output_index": index, "part": OutputText(text="")}


def message_events(message: OutputMessage, index: int, *, opened: bool) -> Events:
    """A message item's events after its text deltas; not yet `opened`: its opening and the whole
    text as one delta first (a held tool stream)."""
    text = message.content[0].text
    if not opened:
        yield from message_opening(message.id, index)
        yield TextDeltaEvent, {"item_id": message.id, "output_index": index, "delta": text}
    yield TextDoneEvent, {"item_id": message.id, "output_index": index, "text": text}
    yield ContentPartEvent, {"type": "response.content_part.done", "item_id": message.id,
                             "output_index": index, "part": message.content[0]}
    yield OutputItemEvent, {"type": "response.output_item.done", "output_index": index, "item": message}
