"""The stall rule with a scripted engine: idle and moving engines stay healthy, a stalled one is
failed once, requests get 503, the watchdog test follows progress, `report` mode recovers."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import ServiceUnavailableError
from server.lifecycle.holder import EngineHolder, EngineState
from server.lifecycle.stall import StallWatch
from server.metrics import GatewayMetrics
from server.settings import EngineProfile, HealthSettings, Settings
from testbed.fakes import FakeEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settings(**health: object) -> Settings:
    return Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1), health=HealthSettings(**health))


async def started(engine: FakeEngine, **health: object) -> tuple[EngineHolder, StallWatch, GatewayMetrics]:
    async def factory(_: Settings) -> FakeEngine:
        return engine

    s = settings(**health)
    holder = EngineHolder(s, factory)
    await holder.start()
    metrics = GatewayMetrics()
    return holder, StallWatch(holder, s, metrics), metrics


async def stream(holder: EngineHolder, tokens: int) -> int:
    from server.engine import SamplingOptions

    async with holder.lease() as engine:
        sampling = engine.make_sampling(SamplingOptions(max_tokens=tokens, stream=True))
        return len([out async for out in engine.generate("r", [1], sampling)])


def test_default_timeout_depends_on_the_device() -> None:
    assert HealthSettings().resolved_stall_timeout_s("gpu") == 60
    assert HealthSettings().resolved_stall_timeout_s("cpu") == 300
    assert HealthSettings(stall_timeout_s=0).resolved_stall_timeout_s("gpu") == 0
    with pytest.raises(ValueError):
        HealthSettings(on_stall="restart")


@pytest.mark.anyio
async def test_idle_and_moving_engines_are_not_stalled() -> None:
    engine = FakeEngine(delay_s=0.02)
    holder, watch, metrics = await started(engine, stall_timeout_s=0.2)
    await asyncio.sleep(0.5)  # idle for longer than the timeout
    assert not await watch.check() and holder.is_alive()
    task = asyncio.create_task(stream(holder, 40))  # 0.8 s of output, a token every 20 ms
    while not task.done():
        assert not await watch.check(), engine.progress()
        await asyncio.sleep(0.05)
    assert await task == 40
    assert holder.state is EngineState.SERVING and metrics.engine_stalls._value.get() == 0


@pytest.mark.anyio
async def test_a_stalled_engine_fails_its_requests_once_and_refuses_new_ones() -> None:
    engine = FakeEngine(delay_s=0.01)
    holder, watch, metrics = await started(engine, stall_timeout_s=0.2)
    tasks = [asyncio.create_task(stream(holder, 1000)) for _ in range(3)]
    await asyncio.sleep(0.05)
    engine.stalled = True
    await asyncio.sleep(0.1)
    assert not await watch.check() and holder.is_alive()  # quiet, but not for the timeout yet
    assert watch.moving(1.0) and not watch.moving(0.05)
    await asyncio.sleep(0.2)
    assert await watch.check()
    assert holder.state is EngineState.STALLED and not holder.is_alive() and not holder.is_ready()
    assert holder.stall_reason and "3 request(s) pending" in holder.stall_reason
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, ServiceUnavailableError) and "stalled" in str(r) for r in results), results
    assert metrics.engine_stalls._value.get() == 1
    assert not await watch.check()  # reported once
    assert not watch.moving(1.0)  # no watchdog ping while stalled
    with pytest.raises(ServiceUnavailableError, match="stalled"):
        await stream(holder, 1)


@pytest.mark.anyio
async def test_report_mode_serves_again_once_the_engine_moves() -> None:
    engine = FakeEngine(delay_s=0.01)
    holder, watch, _ = await started(engine, stall_timeout_s=0.1, on_stall="report")
    task = asyncio.create_task(stream(holder, 1000))
    await asyncio.sleep(0.05)
    engine.stalled = True
    await asyncio.sleep(0.2)
    assert await watch.check() and holder.state is EngineState.STALLED
    with pytest.raises(ServiceUnavailableError):
        await task
    assert not await watch.check() and holder.state is EngineState.STALLED  # still no output
    engine.stalled, engine.abort_message = False, None
    engine.last_output_at += 1.0  # the core sent output again
    assert not await watch.check()
    assert holder.state is EngineState.SERVING and holder.stall_reason is None
    assert await stream(holder, 3) == 3


@pytest.mark.anyio
async def test_rule_off_still_lets_the_watchdog_see_a_stall() -> None:
    engine = FakeEngine(delay_s=0.01)
    holder, watch, _ = await started(engine, stall_timeout_s=0)
    task = asyncio.create_task(stream(holder, 1000))
    await asyncio.sleep(0.05)
    engine.stalled = True
    await asyncio.sleep(0.3)
    assert not await watch.check() and holder.is_alive()  # the rule is off
    assert not watch.moving(0.2)  # but the watchdog pings stop
    engine.stalled = False
    await asyncio.sleep(0.05)
    assert watch.moving(0.2)
    task.cancel()
