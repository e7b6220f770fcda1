"""The shapes /v1/messages converts between: an Anthropic request to the chat request it runs as,
and a chat result back to Anthropic content blocks and stop reasons.

As `vllm serve` converts them: the system prompt is a leading system message; a user turn's
`tool_result` blocks become `tool` messages (before the turn's text); an assistant turn's
`tool_use` blocks become its `tool_calls`; `any` is `required` and `{"type": "tool"}` a named
function. Earlier thinking blocks are dropped (the chat templates here drop an earlier turn's
reasoning). Where this differs from `vllm serve` (a final assistant turn is continued, as
Anthropic's API does; text blocks are joined by newlines), tests/integration/test_vllm_parity_messages.py
says so.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from server.errors import InvalidRequestError
from server.protocol.anthropic import (
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    OutputBlock,
    StopReason,
    TextBlock,
    TextOutput,
    ThinkingBlock,
    ThinkingOutput,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOutput,
)
from server.protocol.openai import ChatCompletionRequest


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(block.text for block in system) or None


def _tool_result_text(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    return "\n".join(part.text for part in block.content)


def _chat_messages(message: MessageParam, index: int) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results first (as `tool`
    messages), then its text; an assistant turn's text and calls as one message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    where = f"messages[{index}]"
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            continue
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequestError(f"{where}.content[{j}]: tool_use blocks belong in assistant turns.",
                                          param="messages")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        else:
            assert isinstance(block, ToolResultBlock)
            if message.role != "user":
                raise InvalidRequestError(f"{where}.content[{j}]: tool_result blocks belong in user turns.",
                                          param="messages")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block)})
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": texts or None}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    if texts or not results:
        return [*results, {"role": "user", "content": texts}]
    return results


def continues_final_turn(req: MessagesRequest | CountTokensRequest) -> bool:
    """A last assistant turn of text only is a prefill: the model continues it (Anthropic's rule)."""
    if not req.messages or req.messages[-1].role != "assistant":
        return False
    content = req.messages[-1].content
    return isinstance(content, str) or (bool(content) and all(isinstance(b, TextBlock) for b in content))


def _tool_choice(req: MessagesRequest | CountTokensRequest) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    choice = req.tool_choice
    if choice is None or not req.tools:  # a choice without tools asks for nothing: none
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError('tool_choice of type "tool" needs the tool\'s `name`.', param="tool_choice")
        if choice.name not in {tool.name for tool in req.tools}:
            raise InvalidRequestError(f"tool_choice names the tool {choice.name!r}, which is not in tools.",
                                      param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request `req` runs as (the same checks, template, tools and sampling)."""
    messages: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(message, i))
    tool_choice, parallel = _tool_choice(req)
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                    "parameters": t.input_schema}} for t in req.tools or []] or None,
    }
    if continues_final_turn(req):
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the Anthropic models checked the shapes; this is a backstop
        raise InvalidRequestError(f"cannot convert the request: {exc.errors()[0]['msg']}") from exc


def tool_use_block(call_id: str, name: str, arguments: str) -> ToolUseOutput | TextOutput:
    """A call as a `tool_use` block; arguments that are not a JSON object (cut off by max_tokens)
    are no call a client could run: they come back as text."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return TextOutput(text=arguments)
    return ToolUseOutput(id=call_id, name=name, input=parsed)


def stop_reason(finish_reason: str | None, matched: int | str | None,
                called: bool) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished generation, as `vllm serve` maps them: the
    length limit wins, then a complete tool call, then a matched stop string (vLLM reports it as
    a str; a stop token id is an ordinary end)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def output_blocks(reasoning: str | None, content: str | None, calls: list[tuple[str, str, str]],
                  signature: str) -> list[OutputBlock]:
    """A finished message's blocks: thinking, text, tool calls; one empty text block when there
    is nothing (Anthropic's shape of an empty answer, which clients index)."""
    blocks: list[OutputBlock] = []
    if reasoning:
        blocks.append(ThinkingOutput(thinking=reasoning, signature=signature))
    if content:
        blocks.append(TextOutput(text=content))
    blocks += [tool_use_block(*call) for call in calls]
    return blocks or [TextOutput(text="")]
