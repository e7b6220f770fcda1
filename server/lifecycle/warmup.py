"""Warm-up: a fresh engine runs the shapes traffic brings before it takes any.

On the GPU, vLLM compiles some kernels on their first use rather than at start: the H200 logged
"Triton kernel JIT compilation during inference: kernel_unified_attention ... causes a latency
spike" after every engine start and reload, and the client whose request came first paid for it.
So the holder (holder.py) runs these requests through each new engine before /ready says yes (start)
or before the swap (drain-swap and blue-green reloads; an in-place reload keeps its engine):
- one long prompt (prefill across the sliding window, then a few decode steps);
- a batch of short prompts of different lengths at once (mixed prefill and decode batches, then
  decode batches of several sizes).

They go straight to the engine, so the gateway's request metrics and tenants never see them; vLLM's
own `vllm:*` counters count their tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from server.engine import Engine, SamplingOptions
from server.settings import Settings

logger = logging.getLogger("llm_gateway.warmup")

LONG_PROMPT_TOKENS = 1536  # past Gemma 4's 512-token sliding window, well inside any max_model_len we ship
BATCH = 8
TEXT = ("The gateway warms its engine up before the first client request, so that kernels compiled on "
        "first use are ready. Every shape traffic brings should run once: long prompts, short ones, "
        "and batches of both. ")


@dataclass(frozen=True, slots=True)
class WarmupReport:
    requests: int
    first_ms: float  # the long prompt alone: mostly what the first client would have waited
    total_ms: float


def warmup_wanted(settings: Settings) -> bool:
    """`server.warmup`, where None means on a GPU only."""
    if settings.server.warmup is not None:
        return settings.server.warmup
    return settings.engine.resolved_device() == "gpu"


def prompt_ids(base: list[int], tokens: int) -> list[int]:
    """`tokens` ids: `base` (TEXT in the engine's own tokenizer) repeated."""
    return (base * (tokens // len(base) + 1))[:tokens]


async def _one(engine: Engine, ids: list[int], max_tokens: int) -> None:
    sampling = engine.make_sampling(SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    async for _ in engine.generate(f"warmup-{uuid.uuid4().hex}", ids, sampling):
        pass


async def warm_up(engine: Engine) -> WarmupReport:
    """Run the warm-up requests (module docstring); an engine error propagates (the start fails)."""
    t0 = time.monotonic()
    room = max(16, engine.info.max_model_len - 16)
    base = engine.encode(TEXT, add_special_tokens=False) or [0]
    await _one(engine, prompt_ids(base, min(LONG_PROMPT_TOKENS, room)), 4)
    first_ms = (time.monotonic() - t0) * 1000
    await asyncio.gather(*(_one(engine, prompt_ids(base, min(32 * (i + 1), room)), 8 + 2 * i)
                           for i in range(BATCH)))
    report = WarmupReport(requests=1 + BATCH, first_ms=round(first_ms, 1),
                          total_ms=round((time.monotonic() - t0) * 1000, 1))
    logger.info("engine warmed up: %d requests in %.0f ms (the long prompt alone %.0f ms)",
                report.requests, report.total_ms, report.first_ms)
    return report
