"""`/v1/responses` (OpenAI Responses API, text, function tools, reasoning): input items -> chat
template -> one generation -> a response object, or its SSE lifecycle events.

The generation runs exactly as chat's does (engine lease, timeouts, stats), so drain, reload,
tenants, metrics and access logs treat it the same. Tools go through chat's tool machinery
(server.serving.responses_items converts the shapes), and the profile's reasoning parser splits
the reasoning off into a `reasoning` item, streamed as it comes. Nothing is stored: `store` is accepted and
ignored (as `vllm serve` does by default) and `previous_response_id` is refused.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from server.engine import Engine, GenerationOutput, ReasoningParser, SamplingOptions
from server.errors import NotFoundError, responses_error_event
from server.protocol.responses import (
    ContentPartEvent,
    FunctionCallOutput,
    IncompleteDetails,
    OutputItem,
    OutputItemEvent,
    ReasoningOutput,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
)
from server.request_state import RequestStats
from server.serving.chat import chat_prompt_ids
from server.serving.checks import check_model, resolve_max_tokens
from server.serving.lease import GenerationService, prompt_chars, serve_on_lease
from server.serving.responses_items import (
    Events,
    echoed_tool_choice,
    function_call_events,
    input_messages,
    message_events,
    message_opening,
    new_message_id,
    new_reasoning_id,
    output_items,
    plan_response_tools,
    reasoning_items,
)
from server.serving.responses_tools import ToolItemsStream
from server.serving.sampling import sampling_options
from server.serving.sse import EventStream, stream_failure
from server.serving.streams import guarded
from server.serving.tools import ToolPlan
from server.tenants.reservation import reserved_tokens


@dataclass
class _SamplingFields:
    """The request's sampling fields in the shape `sampling_options` reads (one choice, no stop list)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    stream: bool
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None

    @classmethod
    def of(cls, req: ResponsesRequest) -> _SamplingFields:
        return cls(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                   presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                   repetition_penalty=req.repetition_penalty, seed=req.seed, stream=req.stream)


@dataclass
class _Prepared:
    stream: AsyncIterator[GenerationOutput]
    options: SamplingOptions
    plan: ToolPlan
    reasoner: ReasoningParser | None


def sse_event(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class ResponsesService(GenerationService):
    def _check(self, engine: Engine, req: ResponsesRequest) -> None:
        check_model(req.model, engine.info.served_model_name)
        if req.previous_response_id is not None:
            # The status OpenAI and `vllm serve` give an unknown id: here every id is unknown.
            raise NotFoundError(
                f"Response with id '{req.previous_response_id}' not found: this server does not store "
                "responses, so it cannot continue one; send the whole conversation in `input`.",
                param="previous_response_id",
            )

    async def create(
        self, req: ResponsesRequest, request_id: str, stats: RequestStats | None = None
    ) -> ResponseObject | EventStream:
        stats = stats or RequestStats()

        def prepare(engine: Engine) -> _Prepared:
            self._check(engine, req)
            plan = plan_response_tools(engine, req)
            ids = chat_prompt_ids(engine, input_messages(req), add_generation_prompt=True,
                                  continue_final_message=False, param="input", tools=plan.tools)
            max_tokens = resolve_max_tokens(req.max_output_tokens, len(ids), engine.info.max_model_len,
                                            param="max_output_tokens", prompt_param="input")
            structured = plan.structured
            options = sampling_options(engine, _SamplingFields.of(req), max_tokens, logprobs=None,
                                       structured=structured)
            if not plan.skip_special_tokens:  # as chat: call tags may be special tokens
                options.skip_special_tokens = False
            reasoner = engine.reasoning_parser(ids)
            if reasoner is not None and reasoner.keeps_special_tokens:
                options.skip_special_tokens = False  # as chat: the parser's markers must reach it
            sampling = engine.make_sampling(options)
            stats.prompt_tokens = len(ids)
            stats.reserved_tokens = reserved_tokens([(len(ids), max_tokens)])
            return _Prepared(guarded(engine.generate(request_id, ids, sampling), self.limits), options, plan,
                             reasoner)

        return await serve_on_lease(
            self.holder, prepare,
            (lambda prepared: self._stream(req, request_id, prepared, stats)) if req.stream else None,
            lambda prepared: self._complete(req, request_id, prepared, stats),
            text_chars=prompt_chars(req.input) + prompt_chars(req.instructions)
            + prompt_chars([t.model_dump() for t in req.tools or []]), stats=stats,
        )

    def _response(self, req: ResponsesRequest, request_id: str, options: SamplingOptions, *,
                  created_at: int, status: str, output: list[OutputItem],
                  stats: RequestStats | None) -> ResponseObject:
        usage = None
        if stats is not None:
            usage = ResponseUsage(input_tokens=stats.prompt_tokens, output_tokens=stats.completion_tokens,
                                  total_tokens=stats.prompt_tokens + stats.completion_tokens)
        return ResponseObject(
            id=request_id, created_at=created_at, status=status,  # type: ignore[arg-type]
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            model=self.holder.settings.served_model_name, output=output, usage=usage,
            instructions=req.instructions, metadata=req.metadata, max_output_tokens=options.max_tokens,
            temperature=options.temperature, top_p=options.top_p, presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty, user=req.user,
            tools=[t.model_dump() for t in req.tools or []], tool_choice=echoed_tool_choice(req),
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    @staticmethod
    def _status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    async def _complete(self, req: ResponsesRequest, request_id: str, prepared: _Prepared,
                        stats: RequestStats) -> ResponseObject:
        created_at = int(time.time())
        final: GenerationOutput | None = None
        try:
            async for out in prepared.stream:
                if stats.first_token_at is None:
                    stats.first_token_at = time.monotonic()
                final = out
        finally:
            await prepared.stream.aclose()  # type: ignore[attr-defined]
        assert final is not None
        choice = final.choices[0]
        stats.completion_tokens = len(choice.token_ids)
        status = self._status(choice.finish_reason)
        reasoning, text = (prepared.reasoner.extract(choice.text) if prepared.reasoner is not None
                           else (None, choice.text))
        output, finish_reason = output_items(prepared.plan, text, choice.finish_reason, status,
                                             (new_reasoning_id(), reasoning) if reasoning else None)
        if finish_reason:
            stats.finish_reasons.append(finish_reason)
        stats.completed = True
        return self._response(req, request_id, prepared.options, created_at=created_at, status=status,
                              output=output, stats=stats)

    @staticmethod
    def _item_events(output: list[OutputItem], item_id: str, message_open: bool) -> Events:
        """The finished items' events (the reasoning item's went out as it streamed)."""
        for index, item in enumerate(output):
            if isinstance(item, FunctionCallOutput):
                yield from function_call_events(item, index)
            elif not isinstance(item, ReasoningOutput):
                item.id = item_id
                yield from message_events(item, index, opened=message_open)

    async def _stream(self, req: ResponsesRequest, request_id: str, prepared: _Prepared,
                      stats: RequestStats) -> AsyncIterator[str]:
        created_at = int(time.time())
        sequence = 0
        item_id = new_message_id()
        held = prepared.plan.parses_output  # tools: the text is read for calls as it comes
        tools = ToolItemsStream(prepared.plan, item_id) if held else None
        reasoner = prepared.reasoner
        reasoning = _ReasoningItemStream(new_reasoning_id())

        def numbered(event_type: type[StreamEvent], **fields: Any) -> str:
            nonlocal sequence
            event = event_type(sequence_number=sequence, **fields)
            sequence += 1
            return sse_event(event)

        def response(status: str, output: list[OutputItem], with_usage: bool) -> ResponseObject:
            return self._response(req, request_id, prepared.options, created_at=created_at, status=status,
                                  output=output, stats=stats if with_usage else None)

        try:
            yield numbered(ResponseEvent, type="response.created", response=response("in_progress", [], False))
            yield numbered(ResponseEvent, type="response.in_progress", response=response("in_progress", [], False))
            # Without a reasoning parser the message opens at once (its index is known); with one,
            # at its first text, after the reasoning item.
            message_open = not held and reasoner is None
            if message_open:
                for event_type, fields in message_opening(item_id):
                    yield numbered(event_type, **fields)
            text: list[str] = []
            finish_reason: str | None = None
            async for out in prepared.stream:
                choice = out.choices[0]
                stats.completion_tokens += len(choice.token_ids)
                if choice.token_ids and stats.first_token_at is None:
                    stats.first_token_at = time.monotonic()
                if choice.finish_reason:
                    finish_reason = choice.finish_reason
                thought, piece = None, choice.text
                if reasoner is not None:
                    thought, piece = reasoner.stream(choice.text, choice.token_ids,
                                                     finished=choice.finish_reason is not None,
                                                     ended_on_stop_token=choice.ended_on_stop_token)
                if thought and reasoning.closed:  # after content began: content (vLLM's parsers never do this)
                    thought, piece = None, thought + (piece or "")
                for event_type, fields in reasoning.delta(thought):
                    yield numbered(event_type, **fields)
                if piece:
                    for event_type, fields in reasoning.done():
                        yield numbered(event_type, **fields)
                    text.append(piece)
                    if tools is not None:
                        for event_type, fields in tools.feed(piece, reasoning.next_index):
                            yield numbered(event_type, **fields)
                    else:
                        if not message_open:
                            message_open = True
                            for event_type, fields in message_opening(item_id, reasoning.next_index):
                                yield numbered(event_type, **fields)
                        yield numbered(TextDeltaEvent, item_id=item_id, output_index=reasoning.next_index,
                                       delta=piece)
            status = self._status(finish_reason)
            for event_type, fields in reasoning.done(status):
                yield numbered(event_type, **fields)
            if tools is not None:  # the items opened as they streamed; the rest of their events
                rest, items, finish_reason = tools.finish(finish_reason, status, reasoning.next_index)
                output = [*reasoning_items(reasoning.finished, status), *items]
                events: Events = rest
            else:
                output, finish_reason = output_items(
                    prepared.plan, "".join(text) if text or reasoner is None else None, finish_reason, status,
                    reasoning.finished)
                events = self._item_events(output, item_id, message_open)
            if finish_reason:
                stats.finish_reasons.append(finish_reason)
            for event_type, fields in events:
                yield numbered(event_type, **fields)
            stats.completed = True
            yield numbered(ResponseEvent, type="response.completed", response=response(status, output, True))
        except Exception as exc:  # never leave a started stream without an ending
            yield responses_error_event(stream_failure(exc, request_id), sequence)
        finally:
            await prepared.stream.aclose()  # type: ignore[attr-defined]


class _ReasoningItemStream:
    """The `reasoning` output item of a stream (index 0): opened at its first delta, done before
    the first content or at the end; `finished` is its (id, text) for the output, None if none came."""

    def __init__(self, item_id: str) -> None:
        self.item_id = item_id
        self.parts: list[str] = []
        self.closed = False

    @property
    def next_index(self) -> int:
        """The output index of the item after it."""
        return 1 if self.parts else 0

    @property
    def finished(self) -> tuple[str, str] | None:
        return (self.item_id, "".join(self.parts)) if self.parts else None

    def delta(self, text: str | None) -> Events:
        if not text:
            return
        if not self.parts:
            yield OutputItemEvent, {"type": "response.output_item.added", "output_index": 0,
                                    "item": ReasoningOutput(id=self.item_id, status="in_progress")}
            yield ContentPartEvent, {"type": "response.content_part.added", "item_id": self.item_id,
                                     "output_index": 0, "part": ReasoningText(text="")}
        self.parts.append(text)
        yield ReasoningTextDeltaEvent, {"item_id": self.item_id, "output_index": 0, "delta": text}

    def done(self, status: str = "completed") -> Events:
        if self.closed:
            return
        self.closed = True
        if not self.parts:
            return
        part = ReasoningText(text="".join(self.parts))
        yield ReasoningTextDoneEvent, {"item_id": self.item_id, "output_index": 0, "text": part.text}
        yield ContentPartEvent, {"type": "response.content_part.done", "item_id": self.item_id,
                                 "output_index": 0, "part": part}
        yield OutputItemEvent, {"type": "response.output_item.done", "output_index": 0,
                                "item": ReasoningOutput(id=self.item_id, content=[part], status=status)}
