"""The holder's vocabulary: engine states, reload results, and one engine with its leases."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from server.engine import Engine
from server.settings import Settings


class EngineState(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RELOADING = "reloading"
    DRAINING = "draining"
    STALLED = "stalled"  # work pending and no engine output for health.stall_timeout_s
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class ReloadResult:
    outcome: str  # success | failure (nothing changed) | rolled_back (old profile restored)
    strategy: str
    duration_s: float
    queued: int = 0
    aborted: int = 0
    max_queue_wait_s: float = 0.0
    error: str | None = None
    finished_at: float = field(default_factory=time.time)
    engine_reloaded: bool = True  # False: the profile was unchanged and only the keys file was re-read
    pause_s: float | None = None  # in-place: generation paused, from pause to resume
    kept: int = 0  # in-place `keep`: requests in flight across the swap
    weights: dict[str, str] | None = None  # the weights serving afterwards: path, fingerprint

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """True once `event` is set, False if `timeout` passes first."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


class Slot:
    """One engine and the leases taken on it."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._shutdown: asyncio.Future[None] | None = None

    async def shutdown(self) -> None:
        """Stop the engine once, however many callers (reload retiring it, server stopping) ask."""
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self.engine.shutdown())
        await asyncio.shield(self._shutdown)

    async def wait_idle(self, timeout: float) -> bool:
        return await wait_set(self.idle, timeout)
