"""`/v1/completions`: request -> prompts and sampling -> engine streams -> response or SSE events.

No FastAPI here: the route hands in a parsed `CompletionRequest` and gets back either a
`CompletionResponse` or a `EventStream` of ready-to-send SSE strings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from server.engine import ChoiceOutput, Engine, GenerationOutput, SamplingOptions, TokenLogprob
from server.errors import InvalidRequestError
from server.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from server.request_state import RequestStats
from server.serving.checks import (
    check_limits,
    check_logprobs,
    check_model,
    check_token_ids,
    resolve_max_tokens,
)
from server.serving.chunks import CompletionTextChunks
from server.serving.lease import GenerationService, prompt_chars, serve_on_lease
from server.serving.sampling import sampling_options
from server.serving.sse import DONE_EVENT, EventStream, sse, sse_error
from server.serving.streams import guarded, merge_streams
from server.tenants.reservation import reserved_tokens

logger = logging.getLogger("llm_gateway.completions")


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # None for token-id prompts until echo needs it


@dataclass
class _ChoiceState:
    text_len: int = 0
    echoed: bool = False


def build_logprobs(entries: list[TokenLogprob], initial_offset: int) -> CompletionLogprobs:
    """The legacy completions logprobs block (tokens, token_logprobs, top_logprobs, text_offset)."""
    out = CompletionLogprobs()
    offset = initial_offset
    for entry in entries:
        out.text_offset.append(offset)
        out.tokens.append(entry.token)
        out.token_logprobs.append(entry.logprob)
        out.top_logprobs.append(
            None if entry.candidates is None else {c.token: c.logprob for c in entry.candidates}
        )
        offset += len(entry.token)
    return out


class CompletionService(GenerationService):
    # -- preparation (all client errors surface here, before any byte is sent) -------------

    def _prompts(self, engine: Engine, prompt: object) -> list[PreparedPrompt]:
        if isinstance(prompt, str):
            items: list[object] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        elif isinstance(prompt, list):
            items = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string, a list of strings or token ids.", param="prompt")
        if not items:
            raise InvalidRequestError("prompt must not be empty: pass at least one prompt.", param="prompt")
        prepared: list[PreparedPrompt] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("prompt must not be empty.", param="prompt")
                ids = engine.encode(item, add_special_tokens=True)
                if not ids:
                    raise InvalidRequestError("prompt must not be empty.", param="prompt")
                prepared.append(PreparedPrompt(ids, item))
            else:
                ids = list(item)  # type: ignore[call-overload]
                if not ids:
                    raise InvalidRequestError("prompt must not be empty.", param="prompt")
                check_token_ids(ids, engine.info.vocab_size)
                prepared.append(PreparedPrompt(ids, None))
        return prepared

    def _options(self, engine: Engine, req: CompletionRequest, max_tokens: int) -> SamplingOptions:
        check_logprobs(req.logprobs, engine, "logprobs")
        return sampling_options(
            engine,
            req,
            max_tokens,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
        )

    def _check_request(self, engine: Engine, req: CompletionRequest) -> None:
        check_model(req.model, engine.info.served_model_name)
        if req.suffix is not None:
            raise InvalidRequestError("suffix is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of is not supported; use n.", param="best_of")
        if req.echo and req.logprobs is not None and engine.info.kv_sharing_fast_prefill:
            raise InvalidRequestError(
                "echo with logprobs needs prompt logprobs, which are wrong when the engine runs "
                "with kv_sharing_fast_prefill; drop echo or logprobs, or use a profile without "
                "fast prefill.",
                param="echo",
            )

    # -- entry point ---------------------------------------------------------------------

    async def create(
        self, req: CompletionRequest, request_id: str, stats: RequestStats | None = None
    ) -> CompletionResponse | EventStream:
        stats = stats or RequestStats()
        Prepared = tuple[list[PreparedPrompt], list[AsyncIterator[GenerationOutput]]]

        def prepare(engine: Engine) -> Prepared:
            limits = self.limits
            self._check_request(engine, req)
            prompts = self._prompts(engine, req.prompt)
            check_limits(limits, n=req.n, prompts=len(prompts))
            samplings, sizes = [], []
            for p in prompts:
                max_tokens = resolve_max_tokens(req.max_tokens, len(p.token_ids), engine.info.max_model_len)
                samplings.append(engine.make_sampling(self._options(engine, req, max_tokens)))
                sizes.append((len(p.token_ids), max_tokens))
            stats.prompt_tokens = sum(len(p.token_ids) for p in prompts)
            stats.reserved_tokens = reserved_tokens(sizes, req.n)
            stats.sequences = len(prompts) * req.n
            if req.echo:
                for p in prompts:
                    if p.text is None:
                        p.text = engine.decode(p.token_ids)
            streams = [
                guarded(engine.generate(f"{request_id}-{i}", p.token_ids, s), limits)
                for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
            ]
            return prompts, streams

        def stream(prepared: Prepared) -> AsyncIterator[str]:
            return self._stream(req, request_id, *prepared, stats)

        return await serve_on_lease(
            self.holder, prepare, stream if req.stream else None,
            lambda prepared: self._complete(req, request_id, *prepared, stats),
            text_chars=prompt_chars(req.prompt), stats=stats,
        )

    async def _complete(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[PreparedPrompt],
        streams: list[AsyncIterator[GenerationOutput]],
        stats: RequestStats,
    ) -> CompletionResponse:
        finals: dict[int, GenerationOutput] = {}
        async for i, out in merge_streams(streams):
            if stats.first_token_at is None:
                stats.first_token_at = time.monotonic()
            finals[i] = out
        choices: list[CompletionChoice] = []
        for i, prompt in enumerate(prompts):
            out = finals[i]
            for c in sorted(out.choices, key=lambda c: c.index):
                choices.append(self._final_choice(req, i * req.n + c.index, prompt, out, c))
                stats.completion_tokens += len(c.token_ids)
                if c.finish_reason:
                    stats.finish_reasons.append(c.finish_reason)
        stats.completed = True
        return CompletionResponse(
            id=request_id,
            model=self.holder.settings.served_model_name,
            choices=choices,
            usage=stats.usage(),
            system_fingerprint=self.fingerprint,
        )

    def _final_choice(
        self,
        req: CompletionRequest,
        index: int,
        prompt: PreparedPrompt,
        out: GenerationOutput,
        c: ChoiceOutput,
    ) -> CompletionChoice:
        text = c.text
        logprobs = None
        if req.echo:
            text = (prompt.text or "") + text
        if req.logprobs is not None:
            entries: list[TokenLogprob] = []
            if req.echo:
                entries.extend(out.prompt_logprobs or [])
            entries.extend(c.logprobs or [])
            logprobs = build_logprobs(entries, 0)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        prompts: list[PreparedPrompt],
        streams: list[AsyncIterator[GenerationOutput]],
        stats: RequestStats,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.holder.settings.served_model_name
        states: dict[int, _ChoiceState] = {}
        plain = req.logprobs is None and not req.echo  # every chunk a text delta: hand-built JSON
        chunks = CompletionTextChunks(request_id, created, model)
        # One prompt (the common case) is read directly: merge_streams would add an async-generator
        # layer that every token passes through.
        single = len(streams) == 1
        merged: AsyncIterator[Any] = streams[0] if single else merge_streams(streams)
        try:
            async for item in merged:
                i, out = (0, item) if single else item
                for c in out.choices:
                    index = i * req.n + c.index
                    state = states.get(index)
                    if state is None:
                        state = states[index] = _ChoiceState()
                    text = c.text
                    entries: list[TokenLogprob] = []
                    if req.echo and not state.echoed:
                        state.echoed = True
                        text = (prompts[i].text or "") + text
                        if req.logprobs is not None:
                            entries.extend(out.prompt_logprobs or [])
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        entries.extend(c.logprobs or [])
                        logprobs = build_logprobs(entries, state.text_len)
                    state.text_len += len(text)
                    stats.completion_tokens += len(c.token_ids)  # counted as the request runs
                    if stats.first_token_at is None:
                        stats.first_token_at = time.monotonic()
                    if c.finish_reason:
                        stats.finish_reasons.append(c.finish_reason)
                    if plain:
                        yield chunks.event(index, text, c.finish_reason, c.stop_reason)
                        continue
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=model,
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ],
                    )
                    yield sse(chunk.model_dump_json(exclude={"usage"}))
            stats.completed = True
            if req.stream_options and req.stream_options.include_usage:
                usage = stats.usage()
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(final.model_dump_json())
        except Exception as exc:  # never leave a started stream without an ending
            yield sse_error(exc, request_id)
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
        yield DONE_EVENT
