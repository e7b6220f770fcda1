"""`EngineHolder`: owns the running engine, its state, and the leases requests take on it.

Every request holds a lease for as long as it uses the engine, so shutdown (and reload) can stop
admitting work, wait for the leases to end within a drain timeout, and only then stop the engine.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from server.engine import Engine
from server.errors import EngineDeadError, ServiceUnavailableError
from server.settings import Settings

logger = logging.getLogger("llm_gateway.holder")

EngineFactory = Callable[[Settings], Awaitable[Engine]]


class EngineState(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RELOADING = "reloading"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineHolder:
    """Starts, leases out and stops one engine; the state machine behind /health and /ready."""

    def __init__(self, settings: Settings, factory: EngineFactory) -> None:
        self.settings = settings
        self._factory = factory
        self.engine: Engine | None = None
        self.state = EngineState.STARTING
        self.start_error: BaseException | None = None
        self.started_at: float | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._state_listeners: list[Callable[[EngineState], None]] = []

    # -- state ---------------------------------------------------------------------------

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        self._state_listeners.append(listener)

    def _set_state(self, state: EngineState) -> None:
        if state is self.state:
            return
        logger.info("engine state: %s -> %s", self.state.value, state.value)
        self.state = state
        for listener in self._state_listeners:
            listener(state)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def is_ready(self) -> bool:
        return self.state is EngineState.SERVING and self.engine is not None

    def is_alive(self) -> bool:
        """False once the engine died or failed to start (the /health answer)."""
        if self.state is EngineState.DEAD:
            return False
        if self.engine is not None and self.engine.is_dead():
            self._set_state(EngineState.DEAD)
            return False
        return True

    def status(self) -> dict[str, object]:
        engine = self.engine
        return {
            "state": self.state.value,
            "in_flight": self._in_flight,
            "started_at": self.started_at,
            "model": self.settings.served_model_name,
            "vllm_version": engine.info.vllm_version if engine else None,
            "profile": self.settings.summary(),
            "start_error": repr(self.start_error) if self.start_error else None,
        }

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._set_state(EngineState.STARTING)
        t0 = time.monotonic()
        try:
            self.engine = await self._factory(self.settings)
        except BaseException as exc:
            self.start_error = exc
            self._set_state(EngineState.DEAD)
            raise
        self.started_at = time.time()
        logger.info("engine ready in %.1f s", time.monotonic() - t0)
        self._set_state(EngineState.SERVING)

    def begin_drain(self) -> None:
        """Stop admitting new requests; leases already taken run on."""
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self._set_state(EngineState.DRAINING)

    async def stop(self, drain_timeout: float) -> bool:
        """Stop admitting, wait for leases to end (up to drain_timeout), stop the engine.

        Returns True when every lease ended before the timeout.
        """
        if self.state is EngineState.STOPPED:
            return True
        self.begin_drain()
        drained = await self.wait_idle(drain_timeout)
        if not drained:
            logger.warning("drain timeout (%.0f s): %d request(s) still running", drain_timeout, self._in_flight)
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.shutdown()
        self._set_state(EngineState.STOPPED)
        return drained

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- leases --------------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Engine]:
        """The engine for one request; refuses with 503 while no engine can serve."""
        engine = self._admit()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield engine
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def _admit(self) -> Engine:
        if self.state is EngineState.SERVING and self.engine is not None:
            if self.engine.is_dead():
                self._set_state(EngineState.DEAD)
            else:
                return self.engine
        if self.state is EngineState.DEAD:
            raise EngineDeadError("the engine is dead; the service is restarting")
        if self.state is EngineState.STARTING:
            raise ServiceUnavailableError(
                "the engine is still starting; retry shortly", headers={"Retry-After": "5"}
            )
        raise ServiceUnavailableError(
            f"the service is {self.state.value}; retry shortly", headers={"Retry-After": "2"}
        )
