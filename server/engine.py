"""The engine seam: an `Engine` Protocol, the plain data it speaks, and `VllmEngine`.

This is the only module that imports vLLM, and it does so lazily inside `VllmEngine.start`, so
importing the gateway has no side effects and unit tests can pass a fake engine. Code is written
against `AsyncLLM` / `AsyncEngineArgs`, which vLLM 0.26 (GPU) and 0.32 (CPU) both provide.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from server.errors import (
    EngineDeadError,
    GatewayError,
    InternalError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from server.profile_checks import check_parallelism
from server.settings import EngineProfile, Settings

logger = logging.getLogger("llm_gateway.engine")


# --------------------------------------------------------------------------------------------
# Plain data exchanged with the serving layer (no vLLM types cross this line)
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """One position: the chosen token and the candidates vLLM returned (chosen + top-k).

    `logprob` and `candidates` are None for the first prompt token, which has no logprob.
    """

    token_id: int
    token: str
    logprob: float | None
    candidates: list[TopLogprob] | None


@dataclass(slots=True)
class ChoiceOutput:
    """One sequence's progress: a delta when streaming, the whole result otherwise."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob] | None
    choices: list[ChoiceOutput]
    finished: bool


@dataclass(slots=True)
class SamplingOptions:
    """What a request asks of the sampler; mirrors vLLM's `SamplingParams` fields."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured: dict[str, Any] | None = None  # vLLM StructuredOutputsParams fields (json, json_object, ...)
    stream: bool = False


@dataclass(slots=True)
class EngineInfo:
    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    vllm_version: str
    max_logprobs: int
    kv_sharing_fast_prefill: bool
    default_sampling: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What the gateway needs from an inference engine."""

    info: EngineInfo

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool
    ) -> str:
        """The model's chat template applied to `messages`, as text."""
        ...

    def make_sampling(self, options: SamplingOptions) -> Any:
        """Validate options and build the engine's own sampling object (raises InvalidRequestError)."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Any
    ) -> AsyncIterator[GenerationOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def abort_all(self, message: str) -> int:
        """Abort every running request; their streams raise ServiceUnavailableError(message)."""
        ...

    def is_dead(self) -> bool: ...

    async def num_unfinished_requests(self) -> int: ...

    async def shutdown(self) -> None: ...


# --------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------


T = TypeVar("T")


def release_freed_memory() -> None:
    """Collect what a stopped engine left and hand glibc's free heap pages back to the OS.

    Measured on the CPU build: without it the gateway process grew ~35 MiB per engine start/stop
    (611 -> 797 MiB over 6), nearly all of it freed-but-kept heap; with it, 593 -> 624 MiB.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


async def run_abandonable(work: Callable[[], T], discard: Callable[[T], None], name: str) -> T:
    """Run blocking `work` in a daemon thread; if the caller is cancelled, `discard` its result.

    An engine start cannot be interrupted and takes from seconds (CPU) to minutes (GPU graph
    capture). `asyncio.to_thread` would keep the process from exiting until it finished (the
    default executor is joined at exit) and would leak the engine it built. A daemon thread lets
    a stopping server exit, and an engine that comes up after nobody wants it is shut down.
    """
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if result.cancelled():
            if ok:
                threading.Thread(target=discard, args=(value,), name=f"{name}-discard", daemon=True).start()
            return
        if ok:
            result.set_result(value)
        else:
            result.set_exception(value)

    def target() -> None:
        try:
            value, ok = work(), True
        except BaseException as exc:
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the event loop is closed: nobody will ever use the result
            if ok:
                discard(value)

    threading.Thread(target=target, name=name, daemon=True).start()
    return await result


# sun_path is 108 bytes; vLLM adds "/" + a 36-character uuid, and we add "/e-XXXXXXXX".
MAX_RPC_BASE_LEN = 107 - 37 - 11


def engine_runtime_dirs(state_dir: Path) -> dict[str, Path]:
    """Where vLLM's cache, RPC sockets and temp files go, so nothing lands in ~/.cache or /tmp."""
    state_dir = Path(state_dir).resolve()
    return {
        "VLLM_CACHE_ROOT": state_dir / "cache" / "vllm",
        "VLLM_RPC_BASE_PATH": state_dir / "run",
        "TMPDIR": state_dir / "tmp",
    }


def prepare_engine_environment(settings: Settings) -> Path:
    """Set vLLM's environment before it starts an engine; return this engine's RPC directory.

    vLLM's frontend reads these variables on every access (only its engine processes cache
    them), so each engine gets its own socket directory, removed again at shutdown: vLLM
    itself leaves its ZMQ socket files behind.
    """
    dirs = engine_runtime_dirs(settings.server.state_dir)
    if len(str(dirs["VLLM_RPC_BASE_PATH"])) > MAX_RPC_BASE_LEN:
        # A Unix socket path holds at most 107 bytes; vLLM appends "/<uuid4>" to this directory.
        short = Path("/tmp") / f"llm-gateway-{os.getuid()}"
        logger.warning("state dir too deep for Unix socket paths; engine sockets go under %s", short)
        dirs["VLLM_RPC_BASE_PATH"] = short
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    rpc_dir = Path(tempfile.mkdtemp(prefix="e-", dir=dirs["VLLM_RPC_BASE_PATH"]))
    os.environ["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    os.environ["TMPDIR"] = str(dirs["TMPDIR"])
    os.environ.setdefault("VLLM_CACHE_ROOT", str(dirs["VLLM_CACHE_ROOT"]))
    tempfile.tempdir = None  # re-read TMPDIR
    for name, value in settings.engine.env.items():
        os.environ.setdefault(name, value)
    return rpc_dir


def engine_args_kwargs(settings: Settings) -> dict[str, Any]:
    """The profile as `AsyncEngineArgs` keyword arguments (batch limits always explicit)."""
    p: EngineProfile = settings.engine
    kwargs: dict[str, Any] = {
        "model": settings.model_path(),
        "served_model_name": [settings.served_model_name],
        "dtype": p.dtype,
        "gpu_memory_utilization": p.gpu_memory_utilization,
        "enforce_eager": p.enforce_eager,
        "kv_sharing_fast_prefill": p.kv_sharing_fast_prefill,
        "max_num_seqs": p.max_num_seqs,
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "load_format": p.load_format,
        "seed": p.seed,
        "max_logprobs": p.max_logprobs,
        "tensor_parallel_size": p.tensor_parallel_size,
        "data_parallel_size": p.data_parallel_size,
        # The gateway logs one line per request itself.
        "enable_log_requests": False,
        # Stats on: AsyncLLM then registers vLLM's PrometheusStatLogger (the vllm:* families,
        # labelled model_name=<served name>) on prometheus_client's global REGISTRY, which
        # /metrics appends to the gateway's own families.
        "disable_log_stats": False,
    }
    optional = {
        "tokenizer": p.tokenizer,
        "max_model_len": p.max_model_len,
        "kv_cache_memory_bytes": p.kv_cache_memory_bytes,
        "compilation_config": p.compilation_config,
        "enable_prefix_caching": p.enable_prefix_caching,
        "attention_backend": p.attention_backend,
        "async_scheduling": p.async_scheduling,
        "speculative_config": p.speculative_config,
        "distributed_executor_backend": p.distributed_executor_backend,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(p.extra_engine_args)
    return kwargs


def _to_token_logprob(token_id: int, position: Any, limit: int) -> TokenLogprob:
    # vLLM returns the chosen token first, then the top-k; OpenAI wants at most k+1 entries.
    candidates = []
    for i, (cand_id, lp) in enumerate(position.items()):
        if i > limit:
            break
        candidates.append(TopLogprob(cand_id, lp.decoded_token or "", max(lp.logprob, -9999.0)))
    chosen = position[token_id]
    return TokenLogprob(token_id, chosen.decoded_token or "", max(chosen.logprob, -9999.0), candidates)


class VllmEngine:
    """`AsyncLLM` behind the `Engine` Protocol."""

    def __init__(self, llm: Any, info: EngineInfo, tokenizer: Any, rpc_dir: Path):
        self._llm = llm
        self.info = info
        self._tokenizer = tokenizer
        self._rpc_dir = rpc_dir
        self._closed = False
        self._active: set[str] = set()
        self._aborted: dict[str, str] = {}  # request id -> why the gateway aborted it

    @classmethod
    async def start(cls, settings: Settings) -> VllmEngine:
        """Build and start `AsyncLLM` from the profile (blocking work runs in a thread)."""
        model_path = settings.model_path()
        if settings.engine.load_format != "dummy" and model_path.startswith(("/", ".")):
            if not Path(model_path).exists():
                hint = (
                    " Run `llm-gateway prepare-model` first."
                    if settings.engine.model == "embedded"
                    else ""
                )
                raise FileNotFoundError(f"engine.model: no model at {model_path}.{hint}")
        check_parallelism(settings)
        rpc_dir = prepare_engine_environment(settings)
        kwargs = engine_args_kwargs(settings)

        def build() -> tuple[Any, str]:
            # Importing vLLM takes seconds: do it here, off the event loop.
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise ValueError(
                    f"vLLM {vllm.__version__} has no engine argument(s) {unknown}; remove "
                    "them from the profile (engine.extra_engine_args or the named fields)."
                )
            logger.info("starting vLLM %s engine: %s", vllm.__version__, kwargs)
            args = AsyncEngineArgs(**kwargs)
            return AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER), vllm.__version__

        def discard(started: tuple[Any, str]) -> None:
            started[0].shutdown()
            shutil.rmtree(rpc_dir, ignore_errors=True)

        try:
            llm, vllm_version = await run_abandonable(build, discard, name="vllm-engine-start")
        except BaseException:
            shutil.rmtree(rpc_dir, ignore_errors=True)
            raise
        try:
            tokenizer = llm.get_tokenizer()
            if inspect.isawaitable(tokenizer):
                tokenizer = await tokenizer
            model_config = llm.model_config
            info = EngineInfo(
                served_model_name=settings.served_model_name,
                model_path=model_path,
                max_model_len=int(model_config.max_model_len),
                vocab_size=int(model_config.get_vocab_size()),
                vllm_version=vllm_version,
                max_logprobs=int(getattr(model_config, "max_logprobs", settings.engine.max_logprobs)),
                kv_sharing_fast_prefill=settings.engine.kv_sharing_fast_prefill,
                default_sampling=dict(model_config.get_diff_sampling_param() or {}),
            )
        except BaseException:
            llm.shutdown()
            shutil.rmtree(rpc_dir, ignore_errors=True)
            raise
        return cls(llm, info, tokenizer, rpc_dir)

    # -- tokenizer -----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool
    ) -> str:
        return self._tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )

    # -- generation ----------------------------------------------------------------------

    def make_sampling(self, options: SamplingOptions) -> Any:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        kwargs: dict[str, Any] = {
            "n": options.n,
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k,
            "min_p": options.min_p,
            "presence_penalty": options.presence_penalty,
            "frequency_penalty": options.frequency_penalty,
            "repetition_penalty": options.repetition_penalty,
            "seed": options.seed,
            "stop": list(options.stop),
            "stop_token_ids": list(options.stop_token_ids),
            "min_tokens": options.min_tokens,
            "ignore_eos": options.ignore_eos,
            "logprobs": options.logprobs,
            "prompt_logprobs": options.prompt_logprobs,
            "skip_special_tokens": options.skip_special_tokens,
            "include_stop_str_in_output": options.include_stop_str_in_output,
            "logit_bias": options.logit_bias,
            "output_kind": RequestOutputKind.DELTA if options.stream else RequestOutputKind.FINAL_ONLY,
        }
        if options.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**options.structured)
        try:
            return SamplingParams(**kwargs)
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "parameter", None)) from exc

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Any
    ) -> AsyncIterator[GenerationOutput]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        if self._closed:
            raise ServiceUnavailableError("the engine is shutting down")
        limit_out = sampling.logprobs if sampling.logprobs is not None else 0
        limit_prompt = sampling.prompt_logprobs if sampling.prompt_logprobs is not None else 0
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_token_ids), sampling, request_id
        )
        finished = False
        self._active.add(request_id)
        try:
            async for out in stream:
                if request_id in self._aborted:
                    break
                finished = out.finished
                yield self._convert(out, limit_out, limit_prompt)
            if request_id in self._aborted:
                finished = True
                raise ServiceUnavailableError(self._aborted[request_id], headers={"Retry-After": "1"})
        except VllmEngineDead as exc:
            raise EngineDeadError(f"the engine died: {exc}") from exc
        except (VLLMClientError, ValueError) as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "parameter", None)) from exc
        except GatewayError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if self._llm.errored:
                raise EngineDeadError(f"the engine died: {exc!r}") from exc
            raise InternalError(f"generation failed: {exc!r}") from exc
        finally:
            self._active.discard(request_id)
            self._aborted.pop(request_id, None)
            if not finished:
                await stream.aclose()
                await self.abort(request_id)

    def _convert(self, out: Any, limit_out: int, limit_prompt: int) -> GenerationOutput:
        choices = []
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    _to_token_logprob(tid, pos, limit_out)
                    for tid, pos in zip(c.token_ids, c.logprobs, strict=False)
                ]
            choices.append(
                ChoiceOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [
                TokenLogprob(tid, self._tokenizer.decode([tid]), None, None)
                if pos is None
                else _to_token_logprob(tid, pos, limit_prompt)
                for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False)
            ]
        return GenerationOutput(
            request_id=out.request_id,
            prompt_token_ids=list(out.prompt_token_ids or []),
            prompt_logprobs=prompt_logprobs,
            choices=choices,
            finished=out.finished,
        )

    async def abort(self, request_id: str) -> None:
        if self._closed:
            return
        try:
            await self._llm.abort(request_id)
        except Exception:  # an abort of a finished or dead request is not an error
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def abort_all(self, message: str) -> int:
        ids = list(self._active)
        for request_id in ids:
            self._aborted[request_id] = message
            await self.abort(request_id)
        return len(ids)

    def is_dead(self) -> bool:
        return not self._closed and bool(self._llm.errored)

    async def num_unfinished_requests(self) -> int:
        return int(self._llm.get_num_unfinished_requests())

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.to_thread(self._llm.shutdown)
        finally:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
