"""`Gateway`: runs the service: uvicorn, the engine start, signals, reloads and the ordered shutdown.

Order on SIGTERM/SIGINT: stop admitting (new requests 503, /ready 503), let in-flight requests
finish within `server.drain_timeout_s`, stop the HTTP server, stop the engine, exit 0. A second
signal forces the exit. If the engine fails to start or dies, the process exits non-zero so a
supervisor (systemd `Restart=on-failure`) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import ValidationError

from server.app import build_app
from server.engine import VllmEngine, note_stop_signal
from server.errors import ConflictError, InvalidRequestError, ServiceUnavailableError
from server.lifecycle.holder import EngineFactory, EngineHolder, EngineState, ReloadResult
from server.lifecycle.stall import CHECK_INTERVAL_S, STALL_EXIT_CODE, StallWatch
from server.lifecycle.weights import ModelFiles
from server.metrics import GatewayMetrics
from server.runner.gc_heap import GcPauseTimer, freeze_heap, refreeze_when_idle
from server.runner.http_options import uvicorn_http_options
from server.runner.notify import Notifier
from server.runner.process_group import isolate_engine_processes
from server.runner.processes import (
    become_subreaper,
    end_abandoned_starts,
    terminate_children,
    wait_for_engine_processes,
)
from server.settings import Settings
from server.settings.checks import profile_warnings
from server.tenants.service import Tenancy

logger = logging.getLogger("llm_gateway")

ENGINE_WATCH_INTERVAL_S = 1.0
# vLLM's workers took ~3.5 s to exit after a process-group SIGINT on 2 CPU cores.
ENGINE_EXIT_WAIT_S = 15.0
# A stop with an engine start under way ends the start's processes as they appear, until none has
# appeared for ABANDONED_START_QUIET_S (its thread may spawn the engine core seconds after the
# stop began on a loaded machine), for at most ABANDONED_START_WAIT_S.
ABANDONED_START_QUIET_S = 5.0
ABANDONED_START_WAIT_S = 20.0
# Once the HTTP server has stopped, the rest of a stop (engine teardown, waiting for its processes,
# the interpreter's exit) gets this long; then the gateway ends what is left and exits. Within
# the units' TimeoutStopSec after the drain, so systemd never needs its SIGKILL.
STOP_BACKSTOP_S = 45.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway orders the shutdown itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


SettingsLoader = Callable[[str | None, dict[str, Any]], Settings]
"""(config path or None for the current one, nested overrides) -> validated Settings."""


class Gateway:
    def __init__(
        self,
        settings: Settings,
        engine_factory: EngineFactory | None = None,
        loader: SettingsLoader | None = None,
        config_path: str | None = None,
    ) -> None:
        self.settings = settings
        self.holder = EngineHolder(settings, engine_factory or VllmEngine.start)
        self.metrics = GatewayMetrics()
        self.tenancy = Tenancy(settings)
        self.app = build_app(settings, self.holder, self.metrics, self.tenancy, reloader=self.reload)
        self.stall_watch = StallWatch(self.holder, settings, self.metrics)
        self.gc_pauses = GcPauseTimer(self.metrics.gc_full_collection.observe)
        self._freeze_gc = settings.server.freeze_gc_heap  # read at start, like the listening address
        self._refreeze_pending = False  # one refreeze waits for an idle moment at a time
        self._loader = loader
        self.config_path = config_path
        config = uvicorn.Config(
            self.app,
            host=settings.server.host,
            port=settings.server.port,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=int(settings.server.keep_alive_timeout_s),
            timeout_graceful_shutdown=5,
            **uvicorn_http_options(settings.server.max_header_bytes),
        )
        self.server = _Server(config)
        self.notifier = Notifier()
        self.exit_code = 0
        self._stopping = False
        self._finishing = False  # the HTTP server is down; the engine is being stopped
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_engine(self) -> None:
        try:
            await self.holder.start()
        except Exception as exc:
            if self._stopping:  # the stop ended the start's processes: its failure is the stop's doing
                logger.info("the engine start ended with the stop: %s", exc)
                return
            logger.error("engine failed to start: %s", exc, exc_info=not isinstance(exc, FileNotFoundError))
            self.exit_code = 1
            self.server.should_exit = True
            return
        engine = self.holder.engine
        if engine is None:  # a stop signal arrived while it started; the holder stopped it
            return
        if self._freeze_gc:
            logger.info("startup heap frozen out of the garbage collector (%.0f ms)", 1000 * freeze_heap())
        labels = profile_labels(self.settings, engine.info.vllm_version, self.holder.weights)
        self.metrics.set_profile(labels)
        where = f"http://{self.settings.server.host}:{self.bound_port()}"
        logger.info("serving %s on %s", self.settings.served_model_name, where)
        self.notifier.ready(f"serving {self.settings.served_model_name} on {where}")

    async def _watchdog(self, interval: float) -> None:
        """Ping systemd's watchdog while the event loop is responsive and the engine lives and
        moves (or idles). An engine start pings too: it is bounded by TimeoutStartSec instead.

        Pings stop once requests have waited on the engine without output for the stall
        timeout, or for one ping interval when the stall rule is off, so `WatchdogSec=` catches a
        stall even if the gateway's own rule is off or stuck.
        """
        while not self._stopping:
            if self.stall_watch.moving(self.stall_watch.timeout_s or interval):
                self.notifier.watchdog()
            await asyncio.sleep(interval)

    async def _watch_stalls(self) -> None:
        while not self._stopping:
            await asyncio.sleep(CHECK_INTERVAL_S)
            if self._stopping:
                return
            if await self.stall_watch.check() and self.stall_watch.on_stall == "exit":
                self.exit_code = STALL_EXIT_CODE
                # /health answers 503 for a moment so probes see the stall, not just a closed port.
                await asyncio.sleep(self.stall_watch.exit_delay_s)
                # The engine core is about to be ended on purpose: its exit is not an error.
                note_stop_signal()
                self.server.should_exit = True
                return

    async def _watch_engine(self) -> None:
        while not self._stopping:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
            if self._stopping:  # the stop ends the engine on purpose
                return
            engine = self.holder.engine
            if self.holder.state is EngineState.STALLED and not (engine is not None and engine.is_dead()):
                continue  # the stall watch owns a stalled engine
            # /health may have noticed first and already marked the engine dead.
            if not self.holder.is_alive():
                logger.error("the engine died; exiting so the supervisor restarts the service")
                self.exit_code = 1
                # Leave /health answering 503 briefly so probes see the death, then exit.
                await asyncio.sleep(2 * ENGINE_WATCH_INTERVAL_S)
                self.server.should_exit = True
                return

    def _arm_stop_backstop(self) -> None:
        """Exit at the latest STOP_BACKSTOP_S from now, whatever teardown still waits on (a vLLM
        finalizer, an engine start nobody can interrupt, a child the interpreter joins at exit)."""
        def expire() -> None:
            logger.warning("the stop is still not done %.0f s after the server stopped: ending the engine "
                           "processes and exiting", STOP_BACKSTOP_S)
            terminate_children(grace_s=0)
            logging.shutdown()
            os._exit(self.exit_code)

        backstop = threading.Timer(STOP_BACKSTOP_S, expire)
        backstop.daemon = True  # never what keeps the process alive
        backstop.start()

    def request_stop(self, sig: signal.Signals) -> None:
        if self._stopping:
            if self._finishing:
                # Stopping the engine itself is stuck: the operator wants out now.
                logger.warning("%s while stopping the engine: exiting at once", sig.name)
                terminate_children(grace_s=0)
                os._exit(self.exit_code or 1)
            logger.warning("second %s: forcing exit", sig.name)
            self.server.force_exit = True
            self.server.should_exit = True
            return
        logger.info("%s received: draining (timeout %.0f s)", sig.name, self.settings.server.drain_timeout_s)
        note_stop_signal()
        self._stopping = True
        self.notifier.stopping(f"draining {self.holder.in_flight} request(s)")
        self._spawn(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        # Drained (and what outlived the timeout aborted) while connections are still open, so
        # every stream ends with a final event instead of a cut connection.
        await self.holder.drain(self.settings.server.drain_timeout_s)
        self.server.should_exit = True

    async def reload(self, config_path: str | None = None, overrides: dict[str, Any] | None = None) -> ReloadResult:
        """Re-read the tenants' keys file (at once, without the engine), validate the new
        configuration, then swap engines: always when `overrides` ask for something, otherwise only
        if the engine profile changed. Raises before touching the engine."""
        started = time.monotonic()
        await self.tenancy.reload_keys()
        if self._loader is None:
            raise ServiceUnavailableError("this server was started without a configuration loader")
        if self.holder.reloading:
            raise ConflictError("a reload is already in progress")
        path = config_path or self.config_path
        try:
            new_settings = self._loader(path, overrides or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise InvalidRequestError(f"invalid configuration: {loc}: {first['msg']}", param=loc or None) from exc
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidRequestError(f"invalid configuration: {exc}") from exc
        model = new_settings.model_path()
        if new_settings.engine.load_format != "dummy" and model.startswith(("/", ".")) and not Path(model).exists():
            raise InvalidRequestError(f"invalid configuration: engine.model: no model at {model}", param="engine.model")
        for warning in profile_warnings(new_settings):
            logger.warning("new profile: %s", warning)
        if not overrides and engine_part(new_settings) == engine_part(self.settings):
            # Nothing for the engine (a keys-file change, say): leave it serving. systemd still
            # sees a complete reload.
            self.notifier.reloading("reloading (keys; engine profile unchanged)")
            self.config_path, self.settings = path, new_settings
            self.notifier.ready(f"serving {self.holder.settings.served_model_name}")
            self.stall_watch.configure(new_settings)
            logger.info("reload: engine profile unchanged, the engine keeps serving")
            return ReloadResult(outcome="success", strategy=new_settings.reload.strategy,
                                duration_s=time.monotonic() - started, engine_reloaded=False)
        self.notifier.reloading(f"reloading ({new_settings.reload.strategy})")
        try:
            result = await self.holder.reload(new_settings)
        finally:
            if self.holder.is_ready():
                self.notifier.ready(f"serving {self.holder.settings.served_model_name}")
        # Whatever the outcome, an engine may have been retired or abandoned: refreeze the heap once
        # no request is in flight.
        if self._freeze_gc and not self._refreeze_pending:
            self._refreeze_pending = True
            self._spawn(self._refreeze_when_idle())
        if result.outcome == "success":
            self.config_path = path
            self.settings = new_settings
            self.stall_watch.configure(new_settings)
            self.metrics.set_profile(
                profile_labels(new_settings, self.holder.engine.info.vllm_version, self.holder.weights))
        return result

    async def _refreeze_when_idle(self) -> None:
        """The refreeze after a reload, off the request path where traffic leaves a gap
        (server/runner/gc_heap.py). Not once shutdown began: a full collection can run vLLM
        finalizers that wait on an abandoned engine start."""
        try:
            done = await refreeze_when_idle(
                self.holder.wait_idle, self.settings.server.gc_refreeze_max_wait_s,
                lambda: not self._stopping and not self.holder.closing)
        finally:
            self._refreeze_pending = False
        if done is not None:
            seconds, idle = done
            logger.info("heap frozen again after the reload (%.0f ms, %s)", 1000 * seconds,
                        "no request in flight" if idle else "under load: no idle moment came")

    def _on_sighup(self) -> None:
        async def run() -> None:
            try:
                result = await self.reload()
                logger.info("SIGHUP reload: %s", result.outcome)
            except Exception as exc:  # a refused reload leaves the running engine untouched
                logger.error("SIGHUP reload refused: %s", exc)

        self._spawn(run())

    async def _watch_config(self) -> None:
        interval = self.settings.reload.watch_interval_s
        path = Path(self.config_path) if self.config_path else None
        if path is None:
            return
        last = path.stat().st_mtime if path.exists() else None
        while not self._stopping:
            await asyncio.sleep(interval)
            current = path.stat().st_mtime if path.exists() else None
            if current != last and current is not None and not self.holder.reloading:
                last = current
                logger.info("config file %s changed: reloading", path)
                try:
                    await self.reload()
                except Exception as exc:
                    logger.error("config-change reload refused: %s", exc)

    def bound_port(self) -> int:
        for srv in getattr(self.server, "servers", []):
            for sock in srv.sockets:
                return int(sock.getsockname()[1])
        return self.settings.server.port

    async def run(self) -> int:
        become_subreaper()
        isolate_engine_processes()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        logger.info("effective profile: %s", json.dumps(self.settings.summary(), default=str))
        if not self.settings.auth.resolved_api_keys() and not is_loopback(self.settings.server.host):
            logger.warning(
                "no API key configured and bound to %s: anyone who can reach this port can use "
                "the API. Set auth.api_keys (--api-key) or bind to 127.0.0.1 behind a proxy.",
                self.settings.server.host,
            )
        await self.tenancy.start()
        self.gc_pauses.install()
        self.notifier.status("starting the engine")
        self._spawn(self._start_engine())
        self._spawn(self._watch_engine())
        self._spawn(self._watch_stalls())
        if self.settings.reload.watch_config:
            self._spawn(self._watch_config())
        if (interval := self.notifier.watchdog_interval_s()) is not None:
            self._spawn(self._watchdog(interval))
        try:
            await self.server.serve()
        finally:
            if not self._stopping:
                self.notifier.stopping("stopping")
            self._stopping = True
            self._finishing = True
            self._arm_stop_backstop()
            drained = await self.holder.stop(drain_timeout=0 if self.server.force_exit else 1.0)
            if self.holder.starting:
                # An engine start (first start or a reload) cannot be interrupted and may take
                # minutes on a GPU; ending its processes makes it fail at once instead.
                logger.warning("an engine was still starting: terminating its processes")
                await asyncio.to_thread(end_abandoned_starts, ABANDONED_START_QUIET_S, ABANDONED_START_WAIT_S)
            else:
                # Engine processes that got the stop signal themselves (Ctrl-C signals the whole
                # process group) may still be stopping: exit after them, never leave orphans.
                await asyncio.to_thread(wait_for_engine_processes, ENGINE_EXIT_WAIT_S)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.tenancy.stop()  # after the last request: its usage is written too
            self.gc_pauses.remove()
            logger.info("stopped (drained=%s, exit code %d)", drained, self.exit_code)
        return self.exit_code


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def engine_part(settings: Settings) -> dict[str, Any]:
    """What a reload applies to the engine: its profile, the reload settings and the limits."""
    return settings.model_dump(include={"engine", "reload", "limits"})


def profile_labels(settings: Settings, vllm_version: str, weights: ModelFiles | None = None) -> dict[str, str]:
    p = settings.engine
    return {
        "weights_path": str(weights.path) if weights else "",
        "weights_fingerprint": weights.fingerprint if weights else "",
        "model": settings.served_model_name,
        "vllm_version": vllm_version,
        "kv_sharing_fast_prefill": str(p.kv_sharing_fast_prefill).lower(),
        "cuda_graphs": str(not p.enforce_eager).lower(),
        "prefix_caching": str(p.enable_prefix_caching if p.enable_prefix_caching is not None else True).lower(),
        "gpu_memory_utilization": str(p.gpu_memory_utilization),
        "max_num_seqs": str(p.max_num_seqs),
        "max_num_batched_tokens": str(p.max_num_batched_tokens),
        "device": p.resolved_device(),
    }


def run(settings: Settings, loader: SettingsLoader | None = None, config_path: str | None = None) -> int:
    gateway = Gateway(settings, loader=loader, config_path=config_path)
    try:
        import uvloop

        return uvloop.run(gateway.run())
    except ImportError:
        return asyncio.run(gateway.run())
