"""`/v1/completions`: request -> prompts and sampling -> engine streams -> response or SSE events.

No FastAPI here: the route hands in a parsed `CompletionRequest` and gets back either a
`CompletionResponse` or a `EventStream` of ready-to-send SSE strings.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from server.engine import ChoiceOutput, Engine, GenerationOutput, SamplingOptions, TokenLogprob
from server.errors import GatewayError, InternalError, InvalidRequestError, ModelNotFoundError
from server.holder import EngineHolder
from server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    Usage,
)
from server.serving.streams import merge_streams

logger = logging.getLogger("llm_gateway.completions")

DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class EventStream:
    """SSE strings for a streaming response; `aclose` releases the engine lease."""

    events: AsyncIterator[str]
    aclose: Callable[[], Awaitable[None]]


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # None for token-id prompts until echo needs it


@dataclass
class _ChoiceState:
    text_len: int = 0
    tokens: int = 0
    echoed: bool = False


@dataclass
class RequestStats:
    """Filled in while a request runs; read by the route for metrics and the access log."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)


def new_request_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist. Available: {served}.", param="model"
        )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, *, param: str = "max_tokens"
) -> int:
    """vLLM's rule: reject impossible values, clamp the rest to the room left in the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens, which leaves no room for output. Shorten the prompt.",
            param="prompt",
        )
    if requested is None:
        return room
    if requested < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {requested}.", param=param)
    if requested > max_model_len:
        raise InvalidRequestError(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=param,
        )
    return min(requested, room)


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    for tid in ids:
        if tid < 0 or tid >= vocab_size:
            raise InvalidRequestError(
                f"Token id {tid} is out of vocabulary (vocabulary size {vocab_size}).",
                param="prompt",
            )


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


class CompletionService:
    def __init__(self, holder: EngineHolder, *, fingerprint: str) -> None:
        self.holder = holder
        self.fingerprint = fingerprint

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
        defaults = engine.info.default_sampling

        def pick(name: str, fallback: float) -> float:
            value = getattr(req, name)
            return value if value is not None else defaults.get(name, fallback)

        if req.logprobs is not None and req.logprobs < 0:
            raise InvalidRequestError(f"logprobs must be non-negative, got {req.logprobs}.", param="logprobs")
        if req.logprobs is not None and req.logprobs > engine.info.max_logprobs:
            raise InvalidRequestError(
                f"logprobs={req.logprobs} is more than the server allows ({engine.info.max_logprobs}).",
                param="logprobs",
            )
        logit_bias = None
        if req.logit_bias:
            logit_bias = {}
            for key, bias in req.logit_bias.items():
                try:
                    token_id = int(key)
                except ValueError:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
                    ) from None
                if not 0 <= token_id < engine.info.vocab_size:
                    raise InvalidRequestError(
                        f"logit_bias token id {token_id} is out of vocabulary.", param="logit_bias"
                    )
                if not -100 <= bias <= 100:
                    raise InvalidRequestError(
                        f"logit_bias values must be in [-100, 100], got {bias}.", param="logit_bias"
                    )
                logit_bias[token_id] = bias
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingOptions(
            max_tokens=max_tokens,
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", 0)),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or defaults.get("stop_token_ids") or []),
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=req.logprobs,
            prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias,
            stream=req.stream,
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
        stack = AsyncExitStack()
        engine = await stack.enter_async_context(self.holder.lease())
        try:
            self._check_request(engine, req)
            prompts = self._prompts(engine, req.prompt)
            samplings = []
            for p in prompts:
                max_tokens = resolve_max_tokens(req.max_tokens, len(p.token_ids), engine.info.max_model_len)
                samplings.append(engine.make_sampling(self._options(engine, req, max_tokens)))
            stats.prompt_tokens = sum(len(p.token_ids) for p in prompts)
            if req.echo:
                for p in prompts:
                    if p.text is None:
                        p.text = engine.decode(p.token_ids)
            streams = [
                engine.generate(f"{request_id}-{i}", p.token_ids, s)
                for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))
            ]
        except BaseException:
            await stack.aclose()
            raise
        if req.stream:
            return EventStream(self._stream(req, request_id, prompts, streams, stats), stack.aclose)
        try:
            return await self._complete(req, request_id, prompts, streams, stats)
        finally:
            await stack.aclose()

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
        return CompletionResponse(
            id=request_id,
            model=self.holder.settings.served_model_name,
            choices=choices,
            usage=Usage(
                prompt_tokens=stats.prompt_tokens,
                completion_tokens=stats.completion_tokens,
                total_tokens=stats.prompt_tokens + stats.completion_tokens,
            ),
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
        merged = merge_streams(streams)
        try:
            async for i, out in merged:
                for c in out.choices:
                    index = i * req.n + c.index
                    state = states.setdefault(index, _ChoiceState())
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
                    state.tokens += len(c.token_ids)
                    if stats.first_token_at is None:
                        stats.first_token_at = time.monotonic()
                    if c.finish_reason:
                        stats.finish_reasons.append(c.finish_reason)
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
            stats.completion_tokens = sum(s.tokens for s in states.values())
            if req.stream_options and req.stream_options.include_usage:
                usage = Usage(
                    prompt_tokens=stats.prompt_tokens,
                    completion_tokens=stats.completion_tokens,
                    total_tokens=stats.prompt_tokens + stats.completion_tokens,
                )
                final = CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse(final.model_dump_json())
        except GatewayError as exc:
            stats.completion_tokens = sum(s.tokens for s in states.values())
            logger.warning("stream %s failed: %s", request_id, exc.message)
            yield sse(json.dumps(exc.body(), ensure_ascii=False))
        except Exception as exc:  # never leave a started stream without an ending
            stats.completion_tokens = sum(s.tokens for s in states.values())
            logger.exception("stream %s failed", request_id)
            yield sse(json.dumps(InternalError(f"generation failed: {exc!r}").body()))
        finally:
            await merged.aclose()
        yield DONE_EVENT
