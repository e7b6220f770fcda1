"""`/v1/responses` (OpenAI Responses API, text only): input items -> chat template -> one
generation -> a response object, or its SSE lifecycle events.

The generation runs exactly as chat's does (engine lease, timeouts, stats), so drain, reload,
tenants, metrics and access logs treat it the same. Nothing is stored: `store` is accepted and
ignored (as `vllm serve` does by default) and `previous_response_id` is refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from server.engine import Engine, GenerationOutput, SamplingOptions
from server.errors import InvalidRequestError, NotFoundError, responses_error_event
from server.protocol_responses import (
    ContentPartEvent,
    IncompleteDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from server.serving.chat import chat_prompt_ids
from server.serving.common import (
    EventStream,
    GenerationService,
    RequestStats,
    check_model,
    guarded,
    prompt_chars,
    resolve_max_tokens,
    sampling_options,
    serve_on_lease,
    stream_failure,
)


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


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` as a system message, then `input` (text is one user message)."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise InvalidRequestError("input must contain at least one message.", param="input")
    for item in req.input:
        content = item.content if isinstance(item.content, str) else "\n".join(p.text for p in item.content)
        messages.append({"role": item.role, "content": content})
    return messages


def sse_event(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class ResponsesService(GenerationService):
    def _check(self, engine: Engine, req: ResponsesRequest) -> None:
        check_model(req.model, engine.info.served_model_name)
        if req.tools:
            raise InvalidRequestError("tools are not supported yet on /v1/responses.", param="tools")
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
            ids = chat_prompt_ids(engine, input_messages(req), add_generation_prompt=True,
                                  continue_final_message=False, param="input")
            max_tokens = resolve_max_tokens(req.max_output_tokens, len(ids), engine.info.max_model_len,
                                            param="max_output_tokens", prompt_param="input")
            options = sampling_options(engine, _SamplingFields.of(req), max_tokens, logprobs=None)
            sampling = engine.make_sampling(options)
            stats.prompt_tokens = len(ids)
            return _Prepared(guarded(engine.generate(request_id, ids, sampling), self.limits), options)

        return await serve_on_lease(
            self.holder, prepare,
            (lambda prepared: self._stream(req, request_id, prepared, stats)) if req.stream else None,
            lambda prepared: self._complete(req, request_id, prepared, stats),
            text_chars=prompt_chars(req.input) + prompt_chars(req.instructions),
        )

    def _response(self, req: ResponsesRequest, request_id: str, options: SamplingOptions, *,
                  created_at: int, status: str, output: list[OutputMessage],
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
        if choice.finish_reason:
            stats.finish_reasons.append(choice.finish_reason)
        status = self._status(choice.finish_reason)
        message = OutputMessage(id=new_message_id(), status=status,  # type: ignore[arg-type]
                                content=[OutputText(text=choice.text)])
        stats.completed = True
        return self._response(req, request_id, prepared.options, created_at=created_at, status=status,
                              output=[message], stats=stats)

    async def _stream(self, req: ResponsesRequest, request_id: str, prepared: _Prepared,
                      stats: RequestStats) -> AsyncIterator[str]:
        created_at = int(time.time())
        sequence = 0
        item_id = new_message_id()

        def numbered(event_type: type[StreamEvent], **fields: Any) -> str:
            nonlocal sequence
            event = event_type(sequence_number=sequence, **fields)
            sequence += 1
            return sse_event(event)

        def response(status: str, output: list[OutputMessage], with_usage: bool) -> ResponseObject:
            return self._response(req, request_id, prepared.options, created_at=created_at, status=status,
                                  output=output, stats=stats if with_usage else None)

        try:
            yield numbered(ResponseEvent, type="response.created", response=response("in_progress", [], False))
            yield numbered(ResponseEvent, type="response.in_progress", response=response("in_progress", [], False))
            yield numbered(OutputItemEvent, type="response.output_item.added",
                           item=OutputMessage(id=item_id, status="in_progress", content=[]))
            yield numbered(ContentPartEvent, type="response.content_part.added", item_id=item_id,
                           part=OutputText(text=""))
            text: list[str] = []
            finish_reason: str | None = None
            async for out in prepared.stream:
                choice = out.choices[0]
                stats.completion_tokens += len(choice.token_ids)
                if choice.token_ids and stats.first_token_at is None:
                    stats.first_token_at = time.monotonic()
                if choice.finish_reason:
                    finish_reason = choice.finish_reason
                    stats.finish_reasons.append(choice.finish_reason)
                if choice.text:
                    text.append(choice.text)
                    yield numbered(TextDeltaEvent, item_id=item_id, delta=choice.text)
            full = "".join(text)
            status = self._status(finish_reason)
            part = OutputText(text=full)
            message = OutputMessage(id=item_id, status=status, content=[part])  # type: ignore[arg-type]
            yield numbered(TextDoneEvent, item_id=item_id, text=full)
            yield numbered(ContentPartEvent, type="response.content_part.done", item_id=item_id, part=part)
            yield numbered(OutputItemEvent, type="response.output_item.done", item=message)
            stats.completed = True
            yield numbered(ResponseEvent, type="response.completed", response=response(status, [message], True))
        except Exception as exc:  # never leave a started stream without an ending
            yield responses_error_event(stream_failure(exc, request_id), sequence)
        finally:
            await prepared.stream.aclose()  # type: ignore[attr-defined]


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:16]}"
