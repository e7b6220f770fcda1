"""Warm-up before an engine takes traffic (server/lifecycle/warmup.py), with scripted engines: which
shapes run, when (start and reloads, GPU by default), and a warm-up that fails fails the start."""

from __future__ import annotations

import asyncio

import pytest

from server.lifecycle.holder import EngineHolder, EngineState
from server.lifecycle.warmup import BATCH, warmup_wanted
from server.settings import EngineProfile, ReloadSettings, ServerSettings, Settings
from testbed.fakes import FakeEngine


def settings(name: str = "m", warmup: bool | None = True, strategy: str = "drain-swap") -> Settings:
    return Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name=name),
                    server=ServerSettings(warmup=warmup), reload=ReloadSettings(strategy=strategy))


def holder_of(engine: FakeEngine, warmup: bool | None = True) -> EngineHolder:
    """A holder whose factory returns `engine`."""
    async def factory(s: Settings) -> FakeEngine:
        return engine

    return EngineHolder(settings(warmup=warmup), factory)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_on_by_default_on_a_gpu_only() -> None:
    assert warmup_wanted(settings(warmup=None)) is False  # a CPU profile
    gpu = Settings(engine=EngineProfile(device="gpu"))
    assert warmup_wanted(gpu) is True
    assert warmup_wanted(gpu.model_copy(update={"server": ServerSettings(warmup=False)})) is False
    assert warmup_wanted(settings(warmup=True)) is True


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drain-swap", "blue-green"])
async def test_each_new_engine_runs_the_shapes_before_it_serves(strategy: str) -> None:
    made: list[FakeEngine] = []

    async def factory(s: Settings) -> FakeEngine:
        engine = FakeEngine()
        made.append(engine)
        return engine

    holder = EngineHolder(settings(strategy=strategy), factory)
    await holder.start()
    first = made[0]
    # the long prompt first (capped by the fake's 64-token context), then the batch of short ones
    assert len(first.sampled) == 1 + BATCH
    assert all(s.ignore_eos and s.temperature == 0.0 for s in first.sampled)
    assert [s.max_tokens for s in first.sampled] == [4] + [8 + 2 * i for i in range(BATCH)]
    assert holder.warmup is not None and holder.warmup.requests == 1 + BATCH
    assert holder.status()["warmup_ms"] == holder.warmup.total_ms
    assert holder.state is EngineState.SERVING and holder.in_flight == 0  # no lease was taken
    result = await holder.reload(settings("new", strategy=strategy))
    assert result.outcome == "success" and len(made) == 2
    assert len(made[1].sampled) == 1 + BATCH  # the reload's engine warmed up before the swap


@pytest.mark.anyio
async def test_off_runs_nothing() -> None:
    engine = FakeEngine()
    holder = holder_of(engine, warmup=False)
    await holder.start()
    assert engine.sampled == [] and holder.warmup is None and holder.status()["warmup_ms"] is None


@pytest.mark.anyio
async def test_a_failed_warmup_fails_the_start_and_stops_the_engine() -> None:
    engine = FakeEngine(fail_after=0)
    holder = holder_of(engine)
    with pytest.raises(Exception, match="scripted engine failure"):
        await holder.start()
    assert holder.state is EngineState.DEAD and engine.closed


@pytest.mark.anyio
async def test_a_cancelled_warmup_stops_the_engine() -> None:
    engine = FakeEngine(delay_s=0.05)
    holder = holder_of(engine)
    task = asyncio.create_task(holder.start())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.closed
