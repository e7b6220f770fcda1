"""`EngineHolder`: owns the running engine, its state, the leases requests take, and reloads.

Every request holds a lease on one engine for as long as it uses it, so shutdown and reload can
stop admitting work to that engine, wait for its leases to end within a drain timeout, abort what
is left with a clear error, and only then stop it.

Reload strategies:
- `drain-swap`: one engine at a time. New requests wait in a bounded queue (size and max wait
  from `reload`), the old engine drains and stops, the new one starts; queued requests then go
  to the new engine. Overflow or a too-long wait gets 503 + Retry-After.
- `blue-green`: the new engine starts beside the old one, which keeps serving; once it is ready
  new requests switch to it, and the old one drains and stops. No request waits on a start-up.
- `in-place`: only the weights change (`server.lifecycle.weights` says what that means, checked before
  anything pauses). New requests wait in the reload queue while the running engine pauses, loads
  the new safetensors and resumes (`server.lifecycle.in_place`); in-flight requests are kept
  (`in_place_mode: keep`) or finish first on the old weights (`finish-old`).
If the new engine fails to start, the previous configuration is restored (drain-swap starts the
old profile again; blue-green never stopped it; in-place loads the previous weights again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from server.engine import Engine, release_freed_memory
from server.errors import (
    ConflictError,
    EngineDeadError,
    InvalidRequestError,
    OverloadedError,
    ServiceUnavailableError,
)
from server.lifecycle.in_place import RollbackFailed, prefetch, swap_weights
from server.lifecycle.slot import EngineState, ReloadResult, Slot, wait_set
from server.lifecycle.warmup import WarmupReport, warm_up, warmup_wanted
from server.lifecycle.weights import ModelFiles, in_place_refusal, local_model_files
from server.settings import ReloadSettings, Settings

logger = logging.getLogger("llm_gateway.holder")

EngineFactory = Callable[[Settings], Awaitable[Engine]]


class _ShuttingDown(Exception):
    """Shutdown began while a reload was starting an engine."""


class EngineHolder:
    """Starts, leases out, reloads and stops the engine; the state behind /health and /ready."""

    def __init__(self, settings: Settings, factory: EngineFactory) -> None:
        self.settings = settings
        self._factory = factory
        self._slot: Slot | None = None
        self.state = EngineState.STARTING
        self.start_error: BaseException | None = None
        self.started_at: float | None = None
        self.warmup: WarmupReport | None = None  # the last new engine's warm-up, if it had one
        self.last_reload: ReloadResult | None = None
        self._reload_lock = asyncio.Lock()
        self._serving = asyncio.Event()  # set while admission goes straight through
        self._waiting = 0  # requests queued behind a drain-swap reload now
        self._queued_total = 0  # ... during the current reload
        self._reload_limits: ReloadSettings | None = None
        self._max_wait = 0.0
        self._queue_arrivals: list[float] = []
        self._all_idle = asyncio.Event()
        self._all_idle.set()
        self._total_in_flight = 0
        self._starts_in_progress = 0
        self._starts_abandoned = 0
        self._closing = asyncio.Event()  # set once shutdown began: no engine may start serving after it
        self.stall_reason: str | None = None  # why the engine counts as stalled now
        self.weights: ModelFiles | None = None  # the serving model's files (None: dummy or a hub id)
        self._state_listeners: list[Callable[[EngineState], None]] = []
        self._reload_listeners: list[Callable[[ReloadResult], None]] = []

    # -- state ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine | None:
        return self._slot.engine if self._slot else None

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        self._state_listeners.append(listener)

    def add_reload_listener(self, listener: Callable[[ReloadResult], None]) -> None:
        self._reload_listeners.append(listener)

    def _set_state(self, state: EngineState) -> None:
        if state is self.state:
            return
        logger.info("engine state: %s -> %s", self.state.value, state.value)
        self.state = state
        if state is EngineState.SERVING:
            self._serving.set()
        else:
            self._serving.clear()
        for listener in self._state_listeners:
            listener(state)

    @property
    def in_flight(self) -> int:
        return self._total_in_flight

    @property
    def reloading(self) -> bool:
        return self._reload_lock.locked()

    def is_ready(self) -> bool:
        """An engine can take requests now (also during a blue-green switch)."""
        return self.state is EngineState.SERVING and self._slot is not None

    def is_alive(self) -> bool:
        """False once the engine died, failed to start or stalled (the /health answer)."""
        if self.state in (EngineState.DEAD, EngineState.STALLED):
            return False
        if self.state is EngineState.SERVING and self.engine is not None and self.engine.is_dead():
            self._set_state(EngineState.DEAD)
            return False
        return True

    def status(self) -> dict[str, object]:
        engine = self.engine
        return {
            "state": self.state.value,
            "reloading": self.reloading,
            "in_flight": self._total_in_flight,
            "engine_in_flight": self._slot.in_flight if self._slot else 0,
            "queued": self._waiting,
            "started_at": self.started_at,
            "model": self.settings.served_model_name,
            "vllm_version": engine.info.vllm_version if engine else None,
            "profile": self.settings.summary(),
            "start_error": repr(self.start_error) if self.start_error else None,
            "stall": self.stall_reason,
            "weights": self.weights.identity() if self.weights else None,
            "last_reload": self.last_reload.as_dict() if self.last_reload else None,
            "warmup_ms": self.warmup.total_ms if self.warmup else None,
        }

    def mark_stalled(self, reason: str) -> None:
        """The stall rule fired: refuse new requests (503) until `mark_moving` or the exit."""
        self.stall_reason = reason
        if self.state is EngineState.SERVING:
            self._set_state(EngineState.STALLED)

    def mark_moving(self) -> None:
        """The stalled engine produced output again (`health.on_stall: report`)."""
        self.stall_reason = None
        if self.state is EngineState.STALLED:
            self._set_state(EngineState.SERVING)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._set_state(EngineState.STARTING)
        t0 = time.monotonic()
        try:
            engine = await self._make(self.settings)
        except BaseException as exc:
            self.start_error = exc
            # A start the stop cut short (its processes ended) leaves a stopped service, not a dead engine.
            self._set_state(EngineState.STOPPED if self.closing else EngineState.DEAD)
            raise
        if self.closing:  # a stop signal came while the engine was starting
            await engine.shutdown()
            self._set_state(EngineState.STOPPED)
            return
        self._slot = Slot(engine, self.settings)
        self.started_at = time.time()
        self.weights = await asyncio.to_thread(local_model_files, self.settings)
        logger.info("engine ready in %.1f s", time.monotonic() - t0)
        self._set_state(EngineState.SERVING)

    @property
    def starting(self) -> bool:
        """An engine start is under way, or was abandoned by a cancelled caller and may still run
        in its thread (first start or a reload's new engine)."""
        return self._starts_in_progress > 0 or self._starts_abandoned > 0

    async def _make(self, settings: Settings) -> Engine:
        """A new engine from the factory, warmed up (warmup.py) where the profile asks for it."""
        self._starts_in_progress += 1
        try:
            engine = await self._factory(settings)
        except asyncio.CancelledError:
            self._starts_abandoned += 1
            raise
        finally:
            self._starts_in_progress -= 1
        if warmup_wanted(settings):
            try:
                self.warmup = await warm_up(engine)
            except BaseException:
                # a cancelled start or an engine that cannot generate: the engine is not kept
                await engine.shutdown()
                raise
        return engine

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def begin_drain(self) -> None:
        """Stop admitting new requests for good (shutdown); leases already taken run on.

        Requests queued behind a reload get 503 at once, and an engine a reload is still starting
        is stopped as soon as it is up instead of taking traffic.
        """
        self._closing.set()
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self._set_state(EngineState.DRAINING)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, wait for leases to end (up to `timeout`), then abort the rest, so every
        stream still gets a final error event, and give them 5 s to end.

        Returns True when every lease ended before the timeout.
        """
        self.begin_drain()
        if await self.wait_idle(timeout):
            return True
        if self._slot is not None:
            aborted = await self._slot.engine.abort_all("the server is shutting down; the request was aborted")
            logger.warning("drain timeout (%.0f s): aborted %d request(s)", timeout, aborted)
        await self.wait_idle(5.0)
        return False

    async def stop(self, drain_timeout: float) -> bool:
        """`drain`, then stop the engine. Returns True when every lease ended before the timeout."""
        if self.state is EngineState.STOPPED:
            return True
        drained = await self.drain(drain_timeout)
        slot, self._slot = self._slot, None
        if slot is not None:
            await slot.shutdown()
        self._set_state(EngineState.STOPPED)
        return drained

    async def wait_idle(self, timeout: float) -> bool:
        return await wait_set(self._all_idle, timeout)

    # -- leases --------------------------------------------------------------------------

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[Engine]:
        """The engine for one request; queues behind a drain-swap reload, else 503s."""
        slot = await self._admit()
        slot.in_flight += 1
        slot.idle.clear()
        self._total_in_flight += 1
        self._all_idle.clear()
        try:
            yield slot.engine
        finally:
            slot.in_flight -= 1
            if slot.in_flight == 0:
                slot.idle.set()
            self._total_in_flight -= 1
            if self._total_in_flight == 0:
                self._all_idle.set()

    async def _admit(self) -> Slot:
        if self.state is EngineState.SERVING and self._slot is not None:
            if not self._slot.engine.is_dead():
                limit = self.settings.limits.max_in_flight
                if limit and self._total_in_flight >= limit:
                    raise OverloadedError(
                        f"too many requests in flight ({limit}); retry shortly",
                        headers={"Retry-After": "1"},
                    )
                return self._slot
            self._set_state(EngineState.DEAD)
        if self.state is EngineState.RELOADING:
            return await self._wait_for_reload()
        if self.state is EngineState.DEAD:
            raise EngineDeadError("the engine is dead; the service is restarting")
        if self.state is EngineState.STALLED:
            raise ServiceUnavailableError(f"{self.stall_reason}; retry shortly", headers={"Retry-After": "5"})
        if self.state is EngineState.STARTING:
            raise ServiceUnavailableError(
                "the engine is still starting; retry shortly", headers={"Retry-After": "5"}
            )
        raise ServiceUnavailableError(
            f"the service is {self.state.value}; retry shortly", headers={"Retry-After": "2"}
        )

    async def _wait_for_reload(self) -> Slot:
        limits = self._reload_limits or self.settings.reload
        if limits.queue_size == 0:  # a replica behind nginx (server/replicas/supervisor.py): another one serves
            raise ServiceUnavailableError("the engine is reloading; retry shortly", headers={"Retry-After": "5"})
        if self._waiting >= limits.queue_size:
            raise ServiceUnavailableError(
                f"the engine is reloading and {self._waiting} requests already wait; retry shortly",
                headers={"Retry-After": str(int(limits.queue_max_wait_s) or 1)},
            )
        self._waiting += 1
        self._queued_total += 1
        t0 = time.monotonic()
        self._queue_arrivals.append(t0)
        serving = asyncio.ensure_future(self._serving.wait())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait({serving, closing}, timeout=limits.queue_max_wait_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise ServiceUnavailableError(
                    f"the engine is reloading; waited {limits.queue_max_wait_s:.0f} s, retry shortly",
                    headers={"Retry-After": "5"},
                )
        finally:
            serving.cancel()
            closing.cancel()
            self._waiting -= 1
            self._queue_arrivals.remove(t0)
            self._max_wait = max(self._max_wait, time.monotonic() - t0)
        if self.closing:
            raise ServiceUnavailableError("the server is shutting down; retry shortly", headers={"Retry-After": "2"})
        if self._slot is None or self.state is not EngineState.SERVING:
            raise ServiceUnavailableError("no engine is available after the reload", headers={"Retry-After": "5"})
        return self._slot

    # -- reload --------------------------------------------------------------------------

    async def reload(self, new_settings: Settings) -> ReloadResult:
        """Apply `new_settings` (already validated) with its `reload.strategy`; 409 if one runs."""
        if self._reload_lock.locked():
            raise ConflictError("a reload is already in progress")
        async with self._reload_lock:
            if self.closing or self._slot is None or self.state is not EngineState.SERVING:
                raise ServiceUnavailableError(f"cannot reload while the engine is {self.state.value}")
            strategy = new_settings.reload.strategy
            # The reload being applied brings its own strategy, queue and drain limits.
            self._reload_limits = new_settings.reload
            self._queued_total = 0
            self._max_wait = 0.0
            t0 = time.monotonic()
            logger.info("reload (%s) to %s", strategy, new_settings.summary())
            if strategy == "in-place":
                result = await self._in_place(new_settings, t0)
            elif strategy == "blue-green":
                result = await self._blue_green(new_settings, t0)
            else:
                result = await self._drain_swap(new_settings, t0)
            if self._queue_arrivals:  # waiters released just now have not woken up yet
                self._max_wait = max(self._max_wait, time.monotonic() - min(self._queue_arrivals))
            result.queued = self._queued_total
            result.max_queue_wait_s = round(self._max_wait, 3)
            result.weights = self.weights.identity() if self.weights else None
            self.last_reload = result
            logger.info("reload finished: %s", result.as_dict())
            # The old engine's objects are unreachable only now that its slot is gone. Not once
            # shutdown began: the process is about to exit, and a collection in the executor's
            # thread can run vLLM finalizers that race the abandoned engine start (a 0.26 CI run
            # answered the reload 500 and took over 60 s to exit after SIGTERM).
            if not self.closing:
                await asyncio.to_thread(release_freed_memory)
            for listener in self._reload_listeners:
                listener(result)
            return result

    async def _start_for_reload(self, settings: Settings) -> Engine:
        """The factory, unless shutdown begins first: then the start is abandoned (the engine is
        stopped when it comes up) and the reload answers at once instead of after the start."""
        start = asyncio.ensure_future(self._make(settings))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({start, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            if not start.done():
                start.cancel()
                logger.warning("shutdown began while a reload started an engine: the start is abandoned")
                await asyncio.wait({start})
                raise _ShuttingDown("the server is shutting down; the reload was abandoned")
        engine = start.result()
        if self.closing:
            logger.warning("shutdown began while a reload started an engine: stopping the new engine")
            await engine.shutdown()
            raise _ShuttingDown("the server is shutting down; the reload was abandoned")
        return engine

    def _abandoned(self, strategy: str, t0: float, aborted: int = 0) -> ReloadResult:
        if self.state not in (EngineState.DEAD, EngineState.STOPPED):
            self._set_state(EngineState.DRAINING)
        return ReloadResult("failure", strategy, time.monotonic() - t0, aborted=aborted,
                            error="the server is shutting down; the reload was abandoned")

    async def _retire(self, slot: Slot, drain_timeout: float) -> int:
        """Let an old engine's leases finish, abort what outlives the timeout, stop it."""
        aborted = 0
        if not await slot.wait_idle(drain_timeout):
            aborted = await slot.engine.abort_all(
                "the engine was replaced by a reload and this request outlived the drain timeout"
            )
            logger.warning("reload drain timeout: aborted %d request(s)", aborted)
            await slot.wait_idle(5.0)
        await slot.shutdown()
        return aborted

    async def _drain_swap(self, new_settings: Settings, t0: float) -> ReloadResult:
        old = self._slot
        assert old is not None
        self._set_state(EngineState.RELOADING)  # new requests queue from here on
        aborted = await self._retire(old, new_settings.reload.drain_timeout_s)
        self._slot = None
        if self.closing:
            return self._abandoned("drain-swap", t0, aborted)
        try:
            engine = await self._start_for_reload(new_settings)
        except _ShuttingDown:
            return self._abandoned("drain-swap", t0, aborted)
        except Exception as exc:
            logger.error("new engine failed to start (%s); restoring the previous profile", exc)
            try:
                engine = await self._start_for_reload(old.settings)
            except _ShuttingDown:
                return self._abandoned("drain-swap", t0, aborted)
            except Exception as again:
                self.start_error = again
                self._set_state(EngineState.DEAD)
                return ReloadResult("failure", "drain-swap", time.monotonic() - t0, aborted=aborted,
                                    error=f"{exc}; rollback failed too: {again}")
            self._slot = Slot(engine, old.settings)
            self._set_state(EngineState.SERVING)
            return ReloadResult("rolled_back", "drain-swap", time.monotonic() - t0, aborted=aborted, error=str(exc))
        self._slot = Slot(engine, new_settings)
        self.settings = new_settings
        self.weights = await asyncio.to_thread(local_model_files, new_settings)
        self._set_state(EngineState.SERVING)
        return ReloadResult("success", "drain-swap", time.monotonic() - t0, aborted=aborted)

    async def _blue_green(self, new_settings: Settings, t0: float) -> ReloadResult:
        old = self._slot
        assert old is not None
        try:
            engine = await self._start_for_reload(new_settings)
        except _ShuttingDown:
            return self._abandoned("blue-green", t0)
        except Exception as exc:
            logger.error("new engine failed to start (%s); the old one keeps serving", exc)
            return ReloadResult("rolled_back", "blue-green", time.monotonic() - t0, error=str(exc))
        self._slot = Slot(engine, new_settings)  # new requests go to the new engine from here
        self.settings = new_settings
        self.weights = await asyncio.to_thread(local_model_files, new_settings)
        aborted = await self._retire(old, new_settings.reload.drain_timeout_s)
        return ReloadResult("success", "blue-green", time.monotonic() - t0, aborted=aborted)

    async def _in_place(self, new_settings: Settings, t0: float) -> ReloadResult:
        slot = self._slot
        assert slot is not None
        refusal, candidate = await asyncio.to_thread(in_place_refusal, slot.settings, self.weights, new_settings)
        if refusal:
            raise InvalidRequestError(refusal, param="engine.model")
        assert candidate is not None
        if new_settings.reload.in_place_prefetch:  # before any request waits
            await prefetch(slot.engine, str(candidate.path), new_settings.reload.in_place_prefetch_timeout_s)
            if self.closing:
                return self._abandoned("in-place", t0)
        self._set_state(EngineState.RELOADING)  # new requests queue from here on
        aborted = 0
        if new_settings.reload.in_place_mode == "finish-old":
            if not await slot.wait_idle(new_settings.reload.drain_timeout_s):
                aborted = await slot.engine.abort_all(
                    "the weights were replaced by a reload and this request outlived the drain timeout")
                logger.warning("in-place reload drain timeout: aborted %d request(s)", aborted)
                await slot.wait_idle(5.0)
            if self.closing:
                return self._abandoned("in-place", t0, aborted)
        kept = slot.in_flight
        old_path = slot.settings.model_path()
        try:
            swap = await swap_weights(slot.engine, str(candidate.path), old_path)
        except RollbackFailed as exc:
            logger.error("in-place reload: %s; stopping the engine", exc)
            await slot.shutdown()
            self.start_error = exc
            self._set_state(EngineState.DEAD)
            return ReloadResult("failure", "in-place", time.monotonic() - t0, aborted=aborted, error=str(exc))
        if swap.outcome == "success":
            slot.settings = self.settings = new_settings
            self.weights = candidate
        logger.info("in-place reload %s: generation paused %.3f s (engine stopped in %.3f s, weights loaded in "
                    "%.3f s), %d request(s) kept, weights %s", swap.outcome, swap.pause_s, swap.stop_s,
                    swap.load_s, kept, self.weights.identity() if self.weights else None)
        self._set_state(EngineState.DRAINING if self.closing else EngineState.SERVING)
        return ReloadResult(swap.outcome, "in-place", time.monotonic() - t0, aborted=aborted, error=swap.error,
                            pause_s=round(swap.pause_s, 3), kept=kept)

