"""EngineHolder's in-place reload with a scripted engine: keep, finish-old, rollback, refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.errors import InvalidRequestError
from server.lifecycle.holder import EngineHolder, EngineState
from server.settings import EngineProfile, ReloadSettings, Settings
from testbed.fakes import FakeEngine
from tests.unit.test_reload_fake import use
from tests.unit.test_weights import model_dir


def settings(model: Path, mode: str = "keep", prefetch: bool = True, **engine: object) -> Settings:
    return Settings(
        engine=EngineProfile(model=str(model), device="cpu", kv_cache_memory_bytes=1,
                             served_model_name="m", **engine),
        reload=ReloadSettings(strategy="in-place", in_place_mode=mode, drain_timeout_s=5,
                              in_place_prefetch=prefetch),
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, Path]:
    return model_dir(tmp_path, "v1", fill=1), model_dir(tmp_path, "v2", fill=2)


async def started(model: Path) -> tuple[EngineHolder, FakeEngine]:
    engine = FakeEngine(delay_s=0.01)

    async def factory(s: Settings) -> FakeEngine:
        return engine

    holder = EngineHolder(settings(model), factory)
    await holder.start()
    return holder, engine


@pytest.mark.timing
@pytest.mark.anyio
async def test_keep_pauses_in_flight_requests_and_swaps_under_them(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    before = holder.status()["weights"]
    running = [asyncio.create_task(use(holder, 30)) for _ in range(4)]
    await asyncio.sleep(0.05)
    engine.reload_delay_s = 0.1
    reload = asyncio.create_task(holder.reload(settings(v2)))
    while not engine.paused:
        await asyncio.sleep(0.005)
    late = [asyncio.create_task(use(holder, 5)) for _ in range(3)]
    result = await reload
    assert result.outcome == "success" and result.strategy == "in-place"
    assert result.kept == 4 and result.queued == 3 and result.aborted == 0
    assert result.pause_s is not None and 0.1 <= result.pause_s < 1.0
    assert [await t for t in running] == [30] * 4  # every kept request completes
    assert [await t for t in late] == [5] * 3
    assert engine.weights_loaded == [str(v2.resolve())] and not engine.paused
    assert engine.weights_prefetched == [str(v2.resolve())]  # read before the pause (the fake asserts it)
    after = holder.status()["weights"]
    assert after["path"] == str(v2.resolve()) and after["fingerprint"] != before["fingerprint"]
    assert result.weights == after
    assert holder.state is EngineState.SERVING and holder.settings.engine.model == str(v2)


@pytest.mark.anyio
async def test_finish_old_lets_in_flight_requests_end_before_the_swap(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    running = [asyncio.create_task(use(holder, 20)) for _ in range(3)]
    await asyncio.sleep(0.03)
    result = await holder.reload(settings(v2, mode="finish-old"))
    assert all(t.done() for t in running), "the swap waited for the requests in flight"
    assert [t.result() for t in running] == [20] * 3
    assert result.outcome == "success" and result.kept == 0
    assert engine.weights_loaded == [str(v2.resolve())]


@pytest.mark.anyio
async def test_a_failing_load_rolls_back_to_the_previous_weights(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    engine.fail_weights.add(str(v2.resolve()))
    running = asyncio.create_task(use(holder, 20))
    await asyncio.sleep(0.03)
    result = await holder.reload(settings(v2))
    assert result.outcome == "rolled_back" and "scripted weight reload failure" in (result.error or "")
    assert engine.weights_loaded == [str(v1.resolve())] and not engine.paused
    assert await running == 20
    assert holder.state is EngineState.SERVING and holder.settings.engine.model == str(v1)
    assert holder.status()["weights"]["path"] == str(v1.resolve())


@pytest.mark.anyio
async def test_a_failing_rollback_stops_the_engine(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    engine.fail_weights |= {str(v2.resolve()), str(v1.resolve())}
    result = await holder.reload(settings(v2))
    assert result.outcome == "failure" and "previous weights failed too" in (result.error or "")
    assert engine.closed and holder.state is EngineState.DEAD


@pytest.mark.anyio
async def test_refusals_leave_the_engine_serving_unpaused(versions: tuple[Path, Path], tmp_path: Path) -> None:
    v1, _ = versions
    holder, engine = await started(v1)
    other = model_dir(tmp_path, "other", config={"architectures": ["X"], "model_type": "x"})
    with pytest.raises(InvalidRequestError, match="config.json architectures"):
        await holder.reload(settings(other))
    with pytest.raises(InvalidRequestError, match="no model directory"):
        await holder.reload(settings(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="engine.max_num_seqs"):
        await holder.reload(settings(v1, max_num_seqs=8))
    assert holder.state is EngineState.SERVING and not engine.paused and engine.weights_loaded == []
    assert await use(holder, 3) == 3


@pytest.mark.anyio
async def test_a_cancelled_swap_still_resumes_the_engine(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    loading = asyncio.Event()

    async def slow_load(path: str) -> None:
        loading.set()
        await asyncio.sleep(10)

    engine.reload_weights = slow_load  # type: ignore[method-assign]
    reload = asyncio.create_task(holder.reload(settings(v2)))
    await loading.wait()
    assert engine.paused
    reload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reload
    assert not engine.paused


@pytest.mark.anyio
async def test_prefetch_can_be_turned_off(versions: tuple[Path, Path]) -> None:
    v1, v2 = versions
    holder, engine = await started(v1)
    result = await holder.reload(settings(v2, prefetch=False))
    assert result.outcome == "success"
    assert engine.weights_prefetched == [] and engine.weights_loaded == [str(v2.resolve())]
