"""EngineHolder reloads with scripted engines: both strategies, queueing, rollback, 409."""

from __future__ import annotations

import asyncio

import pytest

from server.errors import ConflictError, ServiceUnavailableError
from server.lifecycle.holder import EngineHolder, EngineState
from server.settings import EngineProfile, ReloadSettings, Settings
from testbed.fakes import FakeEngine


def settings(name: str, strategy: str = "drain-swap", **reload: float) -> Settings:
    return Settings(
        engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name=name),
        reload=ReloadSettings(strategy=strategy, **reload),
    )


def holder_with(start_delay: float = 0.05, fail_for: set[str] | None = None) -> tuple[EngineHolder, list[FakeEngine]]:
    made: list[FakeEngine] = []

    async def factory(s: Settings) -> FakeEngine:
        await asyncio.sleep(start_delay)
        if fail_for and s.served_model_name in fail_for:
            raise RuntimeError(f"cannot start {s.served_model_name}")
        engine = FakeEngine(delay_s=0.01)
        made.append(engine)
        return engine

    return EngineHolder(settings("old"), factory), made


async def use(holder: EngineHolder, tokens: int = 10) -> int:
    from server.engine import SamplingOptions

    async with holder.lease() as engine:
        sampling = engine.make_sampling(SamplingOptions(max_tokens=tokens, stream=True))
        count = 0
        async for _ in engine.generate("r", [1], sampling):
            count += 1
        return count


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.timing
@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drain-swap", "blue-green"])
async def test_reload_under_load_loses_nothing(strategy: str) -> None:
    holder, made = holder_with()
    await holder.start()
    running = [asyncio.create_task(use(holder, 20)) for _ in range(5)]
    await asyncio.sleep(0.02)
    reload = asyncio.create_task(holder.reload(settings("new", strategy)))
    await asyncio.sleep(0.01)
    late = [asyncio.create_task(use(holder, 5)) for _ in range(5)]
    result = await reload
    assert result.outcome == "success"
    assert [await t for t in running] == [20] * 5
    assert [await t for t in late] == [5] * 5
    assert holder.settings.served_model_name == "new"
    assert holder.engine is made[-1] and len(made) == 2
    if strategy == "drain-swap":
        assert result.queued == 5
        assert result.max_queue_wait_s > 0.03  # they waited for the drain and the 50 ms start
    assert holder.state is EngineState.SERVING and holder.in_flight == 0


@pytest.mark.anyio
async def test_second_reload_gets_409() -> None:
    holder, _ = holder_with(start_delay=0.2)
    await holder.start()
    first = asyncio.create_task(holder.reload(settings("a")))
    await asyncio.sleep(0.01)
    with pytest.raises(ConflictError):
        await holder.reload(settings("b"))
    assert (await first).outcome == "success"


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drain-swap", "blue-green"])
async def test_failed_start_rolls_back(strategy: str) -> None:
    holder, made = holder_with(fail_for={"broken"})
    await holder.start()
    result = await holder.reload(settings("broken", strategy))
    assert result.outcome == "rolled_back" and "cannot start broken" in result.error
    assert holder.settings.served_model_name == "old"
    assert holder.state is EngineState.SERVING
    assert await use(holder, 3) == 3
    assert holder.last_reload is result


@pytest.mark.anyio
async def test_queue_overflow_and_max_wait_get_503() -> None:
    holder, _ = holder_with(start_delay=0.3)
    await holder.start()
    reload = asyncio.create_task(holder.reload(settings("new", queue_size=2, queue_max_wait_s=0.1)))
    await asyncio.sleep(0.02)
    waiting = [asyncio.create_task(use(holder, 1)) for _ in range(3)]
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert sum(isinstance(r, ServiceUnavailableError) for r in results) == 3  # 1 overflow + 2 timed out
    assert all(r.headers.get("Retry-After") for r in results if isinstance(r, ServiceUnavailableError))
    assert (await reload).outcome == "success"


@pytest.mark.anyio
async def test_a_reload_with_no_queue_refuses_at_once_and_keeps_what_runs() -> None:
    """queue_size 0 (each replica behind nginx, which resends a 503 to another replica): a request
    that arrives during the reload gets 503 at once, none waits, what ran before finishes."""
    holder, _ = holder_with(start_delay=0.3)
    await holder.start()
    running = asyncio.create_task(use(holder, 20))
    await asyncio.sleep(0.02)
    reload = asyncio.create_task(holder.reload(settings("new", queue_size=0)))
    await asyncio.sleep(0.02)
    with pytest.raises(ServiceUnavailableError, match="reloading") as refused:
        await asyncio.wait_for(use(holder, 1), 0.1)
    assert refused.value.headers == {"Retry-After": "5"}
    assert await running == 20
    result = await reload
    assert result.outcome == "success" and result.queued == 0
    assert await use(holder, 2) == 2


@pytest.mark.anyio
async def test_drain_timeout_aborts_with_a_clear_error() -> None:
    holder, made = holder_with()
    await holder.start()
    slow = asyncio.create_task(use(holder, 500))  # 5 s at 10 ms a token
    await asyncio.sleep(0.05)
    result = await holder.reload(settings("new", drain_timeout_s=0.1))
    assert result.aborted == 1
    with pytest.raises(ServiceUnavailableError, match="drain timeout"):
        await slow


@pytest.mark.anyio
@pytest.mark.parametrize("strategy", ["drain-swap", "blue-green"])
async def test_shutdown_during_a_reload_stops_the_engine_it_was_starting(strategy: str) -> None:
    """SIGTERM while a reload starts the new engine: waiters get 503 at once, the reload answers
    at once, the old engine drains and stops, and the new engine never serves."""
    holder, made = holder_with(start_delay=0.3)
    await holder.start()
    old = made[0]
    reload = asyncio.create_task(holder.reload(settings("new", strategy, queue_max_wait_s=30)))
    await asyncio.sleep(0.05)  # the new engine is starting
    assert holder.starting
    queued = asyncio.create_task(use(holder, 1)) if strategy == "drain-swap" else None
    await asyncio.sleep(0.01)
    holder.begin_drain()
    if queued is not None:
        with pytest.raises(ServiceUnavailableError, match="shutting down"):
            await asyncio.wait_for(queued, 1.0)
    assert await holder.stop(drain_timeout=1.0)
    result = await asyncio.wait_for(reload, 2.0)
    assert result.outcome == "failure" and "shutting down" in (result.error or "")
    assert old.closed
    assert made == [old]  # the new engine's start was abandoned (cancelled) ...
    assert holder.starting  # ... and reported, so the gateway ends the processes it left
    assert holder.state is EngineState.STOPPED and holder.engine is None
    with pytest.raises(ServiceUnavailableError):
        await use(holder, 1)


@pytest.mark.anyio
async def test_an_abandoned_engine_start_is_discarded_when_it_finishes() -> None:
    import threading

    from server.engine import run_abandonable

    release = threading.Event()
    discarded: list[str] = []
    done = threading.Event()

    def work() -> str:
        release.wait(5)
        return "engine"

    def discard(value: str) -> None:
        discarded.append(value)
        done.set()

    task = asyncio.create_task(run_abandonable(work, discard, name="test-start"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    for _ in range(100):
        if done.is_set():
            break
        await asyncio.sleep(0.02)
    assert discarded == ["engine"]
    assert await run_abandonable(lambda: 7, discard, name="test-ok") == 7
    with pytest.raises(ZeroDivisionError):
        await run_abandonable(lambda: 1 // 0, discard, name="test-error")


@pytest.mark.anyio
async def test_shutdown_drain_timeout_aborts_then_stops() -> None:
    """`stop` (SIGTERM's path) waits up to the drain timeout, aborts what is left with the
    shutdown message, then stops the engine."""
    holder, made = holder_with()
    await holder.start()
    slow = asyncio.create_task(use(holder, 500))  # 5 s at 10 ms a token
    await asyncio.sleep(0.05)
    assert not await holder.stop(drain_timeout=0.1)
    assert made[0].abort_message == "the server is shutting down; the request was aborted"
    assert made[0].closed and holder.state is EngineState.STOPPED
    with pytest.raises(ServiceUnavailableError, match="shutting down"):
        await slow
