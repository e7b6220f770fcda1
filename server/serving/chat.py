"""`/v1/chat/completions`: messages -> chat template -> engine stream -> message or SSE deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from server.engine import Engine, GenerationOutput, ReasoningParser
from server.errors import InvalidRequestError
from server.protocol.openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
)
from server.request_state import RequestStats
from server.serving.chat_stream import ChatChoiceStream, chat_logprobs
from server.serving.checks import check_limits, check_logprobs, check_model, resolve_max_tokens
from server.serving.chunks import ChatContentChunks
from server.serving.lease import GenerationService, prompt_chars, serve_on_lease
from server.serving.sampling import sampling_options
from server.serving.sse import DONE_EVENT, EventStream, sse, sse_error
from server.serving.streams import guarded
from server.serving.tools import ToolPlan, plan_tools, read_tool_calls, tool_message_fields
from server.tenants.reservation import reserved_tokens


def message_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    messages = chat_message_dicts(req.messages)
    for message, extra in zip(messages, tool_message_fields(req.messages), strict=True):
        message.update(extra)
    return messages


def chat_message_dicts(messages: list[ChatMessage], param: str = "messages") -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content parts joined by newlines."""
    if not messages:
        raise InvalidRequestError(f"{param} must contain at least one message.", param=param)
    out = []
    for m in messages:
        if isinstance(m.content, list):
            content = "\n".join(part.text for part in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def chat_prompt_ids(
    engine: Engine, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
    continue_final_message: bool, add_special_tokens: bool = False, param: str = "messages",
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The chat template applied to `messages`, tokenized (the template adds its own special tokens)."""
    try:
        text = engine.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools,
        )
    except Exception as exc:  # template errors come from the client's message list
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param=param) from exc
    return engine.encode(text, add_special_tokens=add_special_tokens)


def structured_output(req: ChatCompletionRequest, plan: ToolPlan | None = None) -> dict[str, Any] | None:
    if plan is not None and plan.structured is not None:  # like vLLM: the tool constraint replaces response_format
        return plan.structured
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError(
            "response_format json_schema needs a `json_schema.schema` object.", param="response_format"
        )
    return {"json": fmt.json_schema.schema_}


StreamWriter = Callable[
    [ChatCompletionRequest, str, AsyncIterator[GenerationOutput], RequestStats, ToolPlan,
     list[ReasoningParser | None]],
    AsyncIterator[str],
]
"""Turns a streamed chat generation into the SSE strings a route sends: chat's own chunks, or
another API's events over the same choice pieces (server.serving.messages)."""


class ChatService(GenerationService):
    def _check(self, engine: Engine, req: ChatCompletionRequest) -> None:
        check_model(req.model, engine.info.served_model_name)
        check_limits(self.limits, n=req.n)
        if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        check_logprobs(req.top_logprobs, engine, "top_logprobs")

    def _prompt_ids(self, engine: Engine, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
        return chat_prompt_ids(
            engine, message_dicts(req),
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            tools=plan.tools,
        )

    async def create(
        self, req: ChatCompletionRequest, request_id: str, stats: RequestStats | None = None
    ) -> ChatCompletionResponse | EventStream:
        return await self.run(req, request_id, stats or RequestStats(), self._stream)

    async def run(
        self, req: ChatCompletionRequest, request_id: str, stats: RequestStats, writer: StreamWriter
    ) -> ChatCompletionResponse | EventStream:
        """Generate for `req`: the whole response, or with `stream` the SSE strings `writer` makes."""
        plan = ToolPlan()
        reasoners: list[ReasoningParser | None] = []  # one per choice: parsers keep stream state

        def prepare(engine: Engine) -> AsyncIterator[GenerationOutput]:
            nonlocal plan
            self._check(engine, req)
            plan = plan_tools(engine, req)
            ids = self._prompt_ids(engine, req, plan)
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            max_tokens = resolve_max_tokens(requested, len(ids), engine.info.max_model_len, param=param)
            top = req.top_logprobs or 0
            options = sampling_options(
                engine, req, max_tokens, logprobs=top if req.logprobs else None,
                structured=structured_output(req, plan),
            )
            if not plan.skip_special_tokens:  # as vLLM's tool parser asks: call tags may be special tokens
                options.skip_special_tokens = False
            reasoners[:] = [engine.reasoning_parser(ids) for _ in range(req.n)]
            if any(r is not None and r.keeps_special_tokens for r in reasoners):
                options.skip_special_tokens = False  # vLLM's adjust_request for e.g. gemma4
            sampling = engine.make_sampling(options)
            stats.prompt_tokens = len(ids)
            stats.reserved_tokens = reserved_tokens([(len(ids), max_tokens)], req.n)
            stats.sequences = req.n
            return guarded(engine.generate(request_id, ids, sampling), self.limits)

        return await serve_on_lease(
            self.holder, prepare,
            (lambda stream: writer(req, request_id, stream, stats, plan, reasoners)) if req.stream else None,
            lambda stream: self._complete(req, request_id, stream, stats, plan, reasoners),
            text_chars=prompt_chars(req.messages) + prompt_chars(req.tools), stats=stats,
        )

    async def _complete(
        self, req: ChatCompletionRequest, request_id: str,
        stream: AsyncIterator[GenerationOutput], stats: RequestStats, plan: ToolPlan,
        reasoners: list[ReasoningParser | None],
    ) -> ChatCompletionResponse:
        final: GenerationOutput | None = None
        try:
            async for out in stream:
                if stats.first_token_at is None:
                    stats.first_token_at = time.monotonic()
                final = out
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        assert final is not None
        choices = []
        for c in sorted(final.choices, key=lambda c: c.index):
            stats.completion_tokens += len(c.token_ids)
            reasoner = reasoners[c.index] if c.index < len(reasoners) else None
            # As vLLM: reasoning is split off first, tool calls are read from the content.
            reasoning, text = reasoner.extract(c.text) if reasoner is not None else (None, c.text)
            content, calls, finish_reason = read_tool_calls(plan, text or "", c.finish_reason)
            if text is None and not calls and plan.mode in ("none", "auto"):
                content = None  # all reasoning: no content, as vLLM answers it
            if finish_reason:
                stats.finish_reasons.append(finish_reason)
            choices.append(ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=content, tool_calls=calls, reasoning=reasoning),
                logprobs=chat_logprobs(c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            ))
        stats.completed = True
        return ChatCompletionResponse(
            id=request_id,
            model=self.holder.settings.served_model_name,
            choices=choices,
            usage=stats.usage(),
            system_fingerprint=self.fingerprint,
        )

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str,
        stream: AsyncIterator[GenerationOutput], stats: RequestStats, plan: ToolPlan,
        reasoners: list[ReasoningParser | None],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.holder.settings.served_model_name

        plain = ChatContentChunks(request_id, created, model)

        def chunk(choice: ChatStreamChoice) -> str:
            delta = choice.delta
            if (choice.logprobs is None and delta.content is not None and delta.role is None
                    and delta.reasoning is None and delta.tool_calls is None):  # most chunks: hand-built JSON
                return plain.event(choice.index, delta.content, choice.finish_reason, choice.stop_reason)
            # Like OpenAI and vLLM: a delta carries only what it sets, stop_reason only at the end.
            exclude: dict[str, Any] = {
                "delta": {k: True for k in ("role", "content", "reasoning", "tool_calls")
                          if getattr(choice.delta, k) is None}
            }
            if delta.tool_calls and delta.tool_calls[0].id is None:  # a call's later pieces: index, arguments
                exclude["delta"]["tool_calls"] = {"__all__": {"id": True, "type": True, "function": {"name"}}}
            if choice.finish_reason is None:
                exclude["stop_reason"] = True
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice]
            ).model_dump_json(exclude={"usage": True, "choices": {0: exclude}}))

        choices = [ChatChoiceStream(index, req, plan, reasoners[index] if index < len(reasoners) else None, stats)
                   for index in range(req.n)]
        try:
            for index in range(req.n):
                yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))
            async for out in stream:
                for c in out.choices:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    stats.completion_tokens += len(c.token_ids)
                    if stats.first_token_at is None:
                        stats.first_token_at = time.monotonic()
                    for piece in choices[c.index].feed(c):
                        yield chunk(piece)
            stats.completed = True
            if req.stream_options and req.stream_options.include_usage:
                usage = stats.usage()
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                ).model_dump_json())
        except Exception as exc:  # never leave a started stream without an ending
            yield sse_error(exc, request_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        yield DONE_EVENT
