"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic Messages API): the request runs as a
chat completion (server.serving.messages_items converts it), so drain, reload, tenants, metrics,
access logs, tools and reasoning treat it as they treat chat; this module turns the result into
an Anthropic message, or its stream into Anthropic's events:

    message_start, then per content block (thinking, text, tool_use, in order)
    content_block_start, content_block_delta (thinking_delta + signature_delta, text_delta,
    input_json_delta), content_block_stop; then message_delta (stop_reason, usage), message_stop.

A tool call's `tool_use` block opens when chat's stream names the call, and its arguments go
out in `input_json_delta`s as chat streams them (`server.serving.tool_stream`); a call that first
appears when the choice finishes goes whole in one, or as text where its arguments are not a
JSON object (cut off by max_tokens), as the non-streamed message has it. A stream that fails
after it started ends with Anthropic's `error` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from server.engine import Engine, GenerationOutput, ReasoningParser
from server.errors import anthropic_error_event
from server.lifecycle.holder import EngineHolder
from server.protocol.anthropic import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
    TextOutput,
    ToolUseOutput,
    MessageUsage,
)
from server.protocol.openai import ChatCompletionRequest, ChatCompletionResponse, ChatStreamChoice, ToolCallDelta
from server.request_state import RequestStats
from server.serving.chat import ChatService, chat_prompt_ids, message_dicts
from server.serving.chat_stream import ChatChoiceStream
from server.serving.checks import check_model
from server.serving.lease import prompt_chars, serve_on_lease
from server.serving.messages_items import chat_request, output_blocks, stop_reason, tool_use_block
from server.serving.sse import EventStream, stream_failure
from server.serving.tools import ToolPlan, plan_tools


def new_signature() -> str:
    return uuid.uuid4().hex


def event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of one streamed message: each opened at its first piece and stopped
    when the next kind begins or the message ends."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block open now
        self.called = False  # a tool_use block went out
        self.call_index: int | None = None  # the chat index of the call in the open tool_use block

    def _start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self.stop()
        self.index += 1
        self.open = block["type"]
        yield event({"type": "content_block_start", "index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> Iterator[str]:
        if self.open is None:
            return
        if self.open == "thinking":
            yield self._delta({"type": "signature_delta", "signature": new_signature()})
        yield event({"type": "content_block_stop", "index": self.index})
        self.open = None

    def text(self, text: str) -> Iterator[str]:
        if self.open != "text":
            yield from self._start({"type": "text", "text": ""})
        yield self._delta({"type": "text_delta", "text": text})

    def thinking(self, text: str) -> Iterator[str]:
        if self.open != "thinking":
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
        yield self._delta({"type": "thinking_delta", "thinking": text})

    def piece(self, piece: ChatStreamChoice, final: bool = False) -> Iterator[str]:
        """One chat piece's blocks; `final`: the piece came with the finish (its calls are whole,
        `joined_calls`)."""
        delta = piece.delta
        if delta.reasoning:
            yield from self.thinking(delta.reasoning)
        if delta.content:
            yield from self.text(delta.content)
        for call in delta.tool_calls or []:
            arguments = call.function.arguments or ""
            if call.id is None:  # more of the call in the open block
                if arguments and self.open == "tool_use" and self.call_index == call.index:
                    yield self._delta({"type": "input_json_delta", "partial_json": arguments})
                continue
            name = call.function.name or ""
            if final:
                block = tool_use_block(call.id, name, arguments)
                if isinstance(block, TextOutput):  # not a complete call (cut off): its text
                    yield from self.text(block.text)
                    continue
                arguments = arguments or "{}"
            yield from self._start({"type": "tool_use", "id": call.id, "name": name, "input": {}})
            self.called, self.call_index = True, call.index
            if arguments:
                yield self._delta({"type": "input_json_delta", "partial_json": arguments})


def joined_calls(pieces: list[ChatStreamChoice]) -> list[ChatStreamChoice]:
    """The pieces of a choice's finish with each call that first appears among them whole in its
    first piece (so a call cut off can still become text)."""
    first: dict[int, ToolCallDelta] = {}
    out = []
    for piece in pieces:
        calls = piece.delta.tool_calls
        if calls and calls[0].id is None and calls[0].index in first:
            head = first[calls[0].index].function
            head.arguments = (head.arguments or "") + (calls[0].function.arguments or "")
            continue
        if calls and calls[0].id is not None:
            first[calls[0].index] = calls[0]
        out.append(piece)
    return out


class MessagesService:
    """/v1/messages over the chat service (its lease, checks, template, tools, reasoning)."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    @property
    def holder(self) -> EngineHolder:
        return self.chat.holder

    async def create(self, req: MessagesRequest, request_id: str,
                     stats: RequestStats | None = None) -> Message | EventStream:
        stats = stats or RequestStats()
        result = await self.chat.run(chat_request(req), request_id, stats, self._stream)
        if isinstance(result, EventStream):
            return result
        return self._message(request_id, result)

    def _message(self, request_id: str, response: ChatCompletionResponse) -> Message:
        choice = response.choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
        blocks = output_blocks(message.reasoning, message.content, calls, new_signature())
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason,
                                       any(isinstance(b, ToolUseOutput) for b in blocks))
        usage = response.usage
        return Message(id=request_id, content=blocks, model=response.model, stop_reason=reason,
                       stop_sequence=sequence, usage=MessageUsage(input_tokens=usage.prompt_tokens if usage else 0,
                                                           output_tokens=usage.completion_tokens if usage else 0))

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str, stream: AsyncIterator[GenerationOutput],
        stats: RequestStats, plan: ToolPlan, reasoners: list[ReasoningParser | None],
    ) -> AsyncIterator[str]:
        choice = ChatChoiceStream(0, req, plan, reasoners[0] if reasoners else None, stats)
        blocks = _Blocks()
        finish_reason: str | None = None
        matched: int | str | None = None
        try:
            start = Message(id=request_id, content=[], model=self.holder.settings.served_model_name,
                            stop_reason=None, usage=MessageUsage(input_tokens=stats.prompt_tokens, output_tokens=0))
            yield event({"type": "message_start", "message": start.model_dump(mode="json")})
            async for out in stream:
                for c in out.choices:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    stats.completion_tokens += len(c.token_ids)
                    if c.token_ids and stats.first_token_at is None:
                        stats.first_token_at = time.monotonic()
                    final = c.finish_reason is not None
                    pieces = choice.feed(c)
                    for piece in joined_calls(pieces) if final else pieces:
                        if piece.finish_reason is not None:
                            finish_reason, matched = piece.finish_reason, piece.stop_reason
                        for text in blocks.piece(piece, final):
                            yield text
            for text in blocks.stop():
                yield text
            reason, sequence = stop_reason(finish_reason, matched, blocks.called)
            stats.completed = True
            yield event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": {"input_tokens": stats.prompt_tokens, "output_tokens": stats.completion_tokens}})
            yield event({"type": "message_stop"})
        except Exception as exc:  # never leave a started stream without an ending
            yield anthropic_error_event(stream_failure(exc, request_id))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def count_tokens(self, req: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens as /v1/messages would render it (system, messages, tools)."""
        chat_req = chat_request(req)

        def prepare(engine: Engine) -> CountTokensResponse:
            check_model(req.model, engine.info.served_model_name)
            plan = plan_tools(engine, chat_req)
            ids = chat_prompt_ids(engine, message_dicts(chat_req), add_generation_prompt=chat_req.add_generation_prompt,
                                  continue_final_message=chat_req.continue_final_message, tools=plan.tools)
            return CountTokensResponse(input_tokens=len(ids))

        async def done(response: CountTokensResponse) -> CountTokensResponse:
            return response

        return await serve_on_lease(self.holder, prepare, None, done,  # type: ignore[return-value]
                                    text_chars=prompt_chars(chat_req.messages) + prompt_chars(chat_req.tools))
