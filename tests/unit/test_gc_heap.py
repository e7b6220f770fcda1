"""server/runner/gc_heap.py: the frozen startup heap and the timing of full collections."""

from __future__ import annotations

import asyncio
import gc
import weakref

from server.lifecycle.slot import wait_set
from server.runner.gc_heap import GcPauseTimer, freeze_heap, refreeze_heap, refreeze_when_idle


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_a_frozen_heap_keeps_its_cycles_until_refreeze_collects_them() -> None:
    """Why a reload refreezes: an engine retired after the freeze would otherwise stay in memory."""
    node = Node()
    gone = weakref.ref(node)
    try:
        assert freeze_heap() >= 0 and gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert gone() is not None  # frozen: the collector skips it
        refreeze_heap()
        assert gone() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_pause_timer_reports_full_collections_only() -> None:
    pauses: list[float] = []
    timer = GcPauseTimer(pauses.append)
    timer.install()
    timer.install()  # once only
    try:
        gc.collect(0)
        gc.collect(1)
        assert pauses == []
        gc.collect(2)
        assert len(pauses) == 1 and pauses[0] > 0
    finally:
        timer.remove()
    gc.collect(2)
    assert len(pauses) == 1


def test_the_refreeze_after_a_reload_waits_for_no_request_in_flight() -> None:
    """The refreeze's full collection (~0.6 s of event loop on the H200) lands in a gap in traffic."""

    async def scenario() -> tuple[object, float, object, object]:
        idle = asyncio.Event()

        def wait_idle(timeout: float):  # type: ignore[no-untyped-def]  # as EngineHolder.wait_idle
            return wait_set(idle, timeout)

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        loop.call_later(0.2, idle.set)  # the last request in flight ends
        ran = await refreeze_when_idle(wait_idle, max_wait_s=30, still_wanted=lambda: True)
        waited = loop.time() - t0
        idle.clear()  # never idle again: it runs anyway after the longest wait, and says so
        busy = await refreeze_when_idle(wait_idle, max_wait_s=0.05, still_wanted=lambda: True)
        # a shutdown began meanwhile: no collection (vLLM finalizers could wait on a dying engine)
        skipped = await refreeze_when_idle(wait_idle, max_wait_s=0.05, still_wanted=lambda: False)
        return ran, waited, busy, skipped

    try:
        ran, waited, busy, skipped = asyncio.run(scenario())
        assert waited >= 0.19 and ran[1] is True and ran[0] >= 0 and gc.get_freeze_count() > 0
        assert busy[1] is False and skipped is None
    finally:
        gc.unfreeze()
