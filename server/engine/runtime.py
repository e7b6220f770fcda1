"""What an engine start needs around vLLM: its environment, its arguments, an abandonable start.

No vLLM import here: these run before vLLM is imported and are shared with the benchmark drivers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from server.settings import EngineProfile, Settings

logger = logging.getLogger("llm_gateway.engine")

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


ENGINE_PROCESS_ENV = "LLM_GATEWAY_ENGINE_PROCESS"
"""Set to `GATEWAY_ENGINE` in the gateway before its engine starts, so inherited by vLLM's engine
processes: the plugin hook of `server.engine.compat` acts only where it is set (not in `vllm serve`)."""

GATEWAY_ENGINE = "1"
"""`ENGINE_PROCESS_ENV`'s value in the gateway's own engine: every patch of `server.engine.compat`."""

SAME_ANSWERS_ONLY = "same-answers-only"
"""`ENGINE_PROCESS_ENV`'s value for a `vllm serve` that should start and run as fast as the
gateway's engine but answer exactly as vLLM alone would (the tests' parity reference): the
patches that change no answer apply (the skipped eager-mode warm-up, logprob ranks counted by the
same expression uncompiled), not the eager sampler, whose random draws differ from vLLM's."""


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
    os.environ[ENGINE_PROCESS_ENV] = GATEWAY_ENGINE
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
