"""The gateway process's garbage collector: a frozen startup heap, and timed full collections.

vLLM, torch, transformers and the tokenizer leave hundreds of thousands of objects tracked by
Python's collector in the gateway process. A full (oldest generation) collection walks all of them,
a noticeable fraction of a second, and it runs on the event loop:
every stream and every new request waits for it. `vllm serve` marks its startup heap static with
`gc.freeze()` once it is up (`vllm.utils.gc_utils.freeze_gc_heap`, vLLM 0.26 and 0.32 alike), so its
collections skip that heap; the gateway does the same when its engine is ready. A reload retires an
engine whose objects may sit in reference cycles that a frozen heap would keep for good, so after
each reload the heap is unfrozen, collected once and frozen again. That collection walks the whole
heap with the GIL held (0.58 and 0.68 s after two reloads on the H200), so it waits for a moment
with no request in flight, up to `server.gc_refreeze_max_wait_s` (`refreeze_when_idle`): until
then the retired engine's cycles stay in memory, and no request pays for the walk.

`GcPauseTimer` times full collections into `gateway_gc_full_collection_seconds`, which is how a
pause on the event loop shows up in Grafana.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

FULL_COLLECTION = 2  # the oldest generation


def freeze_heap() -> float:
    """Collect everything, then freeze what is left; the seconds it took (one pause, at start)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


def refreeze_heap() -> float:
    """After a reload: what the retired engine left in cycles becomes collectable, then freeze again."""
    gc.unfreeze()
    return freeze_heap()


async def refreeze_when_idle(wait_idle: Callable[[float], Awaitable[bool]], max_wait_s: float,
                             still_wanted: Callable[[], bool]) -> tuple[float, bool] | None:
    """Refreeze once `wait_idle(max_wait_s)` returns: True when nothing was in flight within that
    time, False when it runs under load anyway. The collection's (seconds, idle); None when
    `still_wanted()` says no by then (a shutdown began)."""
    idle = await wait_idle(max_wait_s)
    if not still_wanted():
        return None
    return refreeze_heap(), idle


class GcPauseTimer:
    """Reports the duration of every full collection to `observe` (seconds), from gc.callbacks.

    Younger collections return at once: they run thousands of times a second under load and cost
    microseconds each.
    """

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        self._started: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != FULL_COLLECTION:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._observe(time.perf_counter() - self._started)
            self._started = None

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
