"""server/runner/gc_heap.py: the frozen startup heap and the timing of full collections."""

from __future__ import annotations

import gc
import weakref

from server.runner.gc_heap import GcPauseTimer, freeze_heap, refreeze_heap


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
