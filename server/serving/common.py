"""What completions and chat share: ids, SSE framing, request checks, sampling options, stats."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from server.engine import Engine, GenerationOutput, SamplingOptions
from server.errors import (
    GatewayError,
    InternalError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTimeoutError,
)
from server.lifecycle.holder import EngineHolder
from server.protocol.openai import Usage
from server.serving.streams import with_deadlines
from server.settings import LimitSettings

logger = logging.getLogger("llm_gateway.serving")

DONE_EVENT = "data: [DONE]\n\n"

# Above this many characters of prompt text, the chat template and the tokenizer run in a worker
# thread: a 4,096-token prompt takes milliseconds to tokenize, and on the event loop that time
# stalls every other stream. Below it the thread hop costs more than the work. One thread, as in
# `vllm serve`: tokenizers release the GIL while they encode, and one queue keeps long prompts
# from crowding out the loop's own work.
OFFLOAD_PROMPT_CHARS = 4096
_PREPARE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokenize")


def prompt_chars(value: Any) -> int:
    """Characters of text in a prompt-like value: strings, lists, dicts, request models; token
    ids count 0 (they need no tokenizer)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):
            return 0
        return sum(prompt_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(prompt_chars(v) for v in value.values())
    if isinstance(value, BaseModel):
        return sum(prompt_chars(v) for v in value.__dict__.values())
    return 0


@dataclass
class EventStream:
    """SSE strings for a streaming response; `aclose` releases the engine lease."""

    events: AsyncIterator[str]
    aclose: Callable[[], Awaitable[None]]


class GenerationService:
    """What the completions and chat services share: the engine holder and the profile's limits."""

    def __init__(self, holder: EngineHolder, *, fingerprint: str) -> None:
        self.holder = holder
        self.fingerprint = fingerprint

    @property
    def limits(self) -> LimitSettings:
        """The limits of the profile serving now (a reload may change them)."""
        return self.holder.settings.limits


Prepared = TypeVar("Prepared")
Result = TypeVar("Result")


async def serve_on_lease(
    holder: EngineHolder,
    prepare: Callable[[Engine], Prepared],
    stream: Callable[[Prepared], AsyncIterator[str]] | None,
    complete: Callable[[Prepared], Awaitable[Result]],
    *,
    text_chars: int = 0,
) -> Result | EventStream:
    """Take an engine lease, `prepare` the request on it (client errors surface here, before any
    byte is sent), then either hand the lease to the returned EventStream (released when the
    stream ends, however it ends) or `complete` the request and release it. `text_chars` (the
    prompt's text size) above OFFLOAD_PROMPT_CHARS moves `prepare` off the event loop."""
    lease = AsyncExitStack()
    engine = await lease.enter_async_context(holder.lease())
    try:
        if text_chars > OFFLOAD_PROMPT_CHARS:
            prepared = await asyncio.get_running_loop().run_in_executor(_PREPARE_THREAD, prepare, engine)
        else:
            prepared = prepare(engine)
    except BaseException:
        await lease.aclose()
        raise
    if stream is not None:
        return EventStream(stream(prepared), lease.aclose)
    try:
        return await complete(prepared)
    finally:
        await lease.aclose()


@dataclass
class RequestStats:
    """Filled in while a request runs; read by the route for metrics and the access log."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    completed: bool = False

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


def new_request_id(prefix: str, separator: str = "-") -> str:
    return f"{prefix}{separator}{uuid.uuid4().hex[:16]}"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def stream_failure(exc: BaseException, request_id: str) -> GatewayError:
    """What a stream that failed after it started tells the client (logged here, once)."""
    if not isinstance(exc, GatewayError):
        logger.error("stream %s failed", request_id, exc_info=exc)
        return InternalError(f"generation failed: {exc!r}")
    logger.warning("stream %s failed: %s", request_id, exc.message)
    return exc


def sse_error(exc: BaseException, request_id: str) -> str:
    """The final SSE event of a stream that failed after it started."""
    return sse(json.dumps(stream_failure(exc, request_id).body(), ensure_ascii=False))


def guarded(stream: AsyncIterator[GenerationOutput], limits: LimitSettings) -> AsyncIterator[GenerationOutput]:
    """The engine stream under the configured first-token and total timeouts (504 when late)."""
    if limits.first_token_timeout_s is None and limits.request_timeout_s is None:
        return stream

    def timeout_error(which: str) -> RequestTimeoutError:
        if which == "first_token":
            return RequestTimeoutError(
                f"no token within {limits.first_token_timeout_s} s (limits.first_token_timeout_s); aborted")
        return RequestTimeoutError(f"generation took longer than {limits.request_timeout_s} s "
                                   "(limits.request_timeout_s); aborted")

    return with_deadlines(
        stream,
        first_item_timeout=limits.first_token_timeout_s,
        total_timeout=limits.request_timeout_s,
        on_timeout=timeout_error,
    )


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist. Available: {served}.", param="model"
        )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, *, param: str = "max_tokens",
    prompt_param: str | None = None,
) -> int:
    """vLLM's rule: reject impossible values, clamp the rest to the room left in the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens, which leaves no room for output. Shorten the prompt.",
            param=prompt_param or ("prompt" if param == "max_tokens" else "messages"),
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


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for tid in ids:
        if tid < 0 or tid >= vocab_size:
            raise InvalidRequestError(
                f"Token id {tid} is out of vocabulary (vocabulary size {vocab_size}).", param=param
            )


def check_limits(limits: LimitSettings, *, n: int, prompts: int = 1) -> None:
    if n > limits.max_n:
        raise InvalidRequestError(f"n={n} is more than this server allows ({limits.max_n}).", param="n")
    if prompts > limits.max_prompts_per_request:
        raise InvalidRequestError(
            f"{prompts} prompts in one request; this server allows {limits.max_prompts_per_request}.",
            param="prompt",
        )


class SamplingFields(Protocol):
    """The sampling fields completions and chat requests have in common."""

    n: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    min_tokens: int
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logit_bias: dict[str, float] | None
    stream: bool


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is out of vocabulary (size {vocab_size}).",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias"
            )
        bias[token_id] = value
    return bias


def check_logprobs(value: int | None, engine: Engine, param: str) -> None:
    if value is None:
        return
    if value < 0:
        raise InvalidRequestError(f"{param} must be non-negative, got {value}.", param=param)
    if value > engine.info.max_logprobs:
        raise InvalidRequestError(
            f"{param}={value} is more than the server allows ({engine.info.max_logprobs}).",
            param=param,
        )


def sampling_options(
    engine: Engine,
    req: SamplingFields,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: dict[str, Any] | None = None,
) -> SamplingOptions:
    """Request fields -> SamplingOptions: user value, else the model's default, else OpenAI's."""
    defaults = engine.info.default_sampling

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

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
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=parse_logit_bias(req.logit_bias, engine.info.vocab_size),
        structured=structured,
        stream=req.stream,
    )
