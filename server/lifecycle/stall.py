"""The stall watch: an engine that holds work and stops producing output is taken out of rotation.

vLLM notices a dead engine core (its process exits), not a stuck one: a stopped (SIGSTOP) or
deadlocked core, a stuck collective or a hung GPU keep every process alive, and /health used to
answer 200 while requests waited for their timeouts. The watch reads the engine seam's progress
(requests pending in the engine, the time of the engine core's last output) once a second.
- Idle is never a stall: without pending requests there is nothing to wait for.
- A slow but moving engine is not one either: the core sends outputs every scheduler step,
  prefill chunks included, so only a single step longer than the timeout could trip it.

On a stall: one ERROR line naming how long and how many requests, `gateway_engine_stalls_total`,
state `stalled` (/health, /ready and new requests answer 503), and the pending requests are aborted
(503, or a final SSE error event). `health.on_stall` then decides: `exit` (the gateway stops the
engine and exits with `STALL_EXIT_CODE`; see server.runner.gateway) or `report` (the process stays for
debugging, and serves again once the engine produces output).
"""

from __future__ import annotations

import logging

from server.engine import EngineProgress
from server.lifecycle.holder import EngineHolder, EngineState
from server.metrics import GatewayMetrics
from server.settings import Settings

logger = logging.getLogger("llm_gateway.stall")

CHECK_INTERVAL_S = 1.0
STALL_EXIT_CODE = 3
"""The gateway's exit status after a stall (1: the engine failed to start or died)."""


class StallWatch:
    """Applies the stall rule of `settings.health` to the holder's current engine."""

    def __init__(self, holder: EngineHolder, settings: Settings, metrics: GatewayMetrics) -> None:
        self.holder = holder
        self.metrics = metrics
        self._output_at_stall = 0.0
        self.configure(settings)

    def configure(self, settings: Settings) -> None:
        """Apply `settings.health` (at start and after each reload)."""
        self.timeout_s = settings.health.resolved_stall_timeout_s(settings.engine.resolved_device())
        self.on_stall = settings.health.on_stall
        self.exit_delay_s = settings.health.exit_delay_s

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def progress(self) -> EngineProgress | None:
        engine = self.holder.engine
        return engine.progress() if engine is not None else None

    def moving(self, quiet_limit_s: float) -> bool:
        """Alive, and idle or with engine output within `quiet_limit_s` (the watchdog's test)."""
        if not self.holder.is_alive():
            return False
        progress = self.progress()
        return progress is None or progress.quiet_s < quiet_limit_s

    async def check(self) -> bool:
        """One look at the engine; True when it stalled just now."""
        progress = self.progress()
        self.metrics.engine_quiet.set(round(progress.quiet_s, 1) if progress else 0.0)
        if self.holder.state is EngineState.STALLED:
            if progress is not None and progress.last_output_at > self._output_at_stall:
                logger.warning("the engine produces output again after its stall: serving again")
                self.holder.mark_moving()
            return False
        if not self.enabled or progress is None or self.holder.state is not EngineState.SERVING:
            return False
        if progress.quiet_s < self.timeout_s:
            return False
        reason = (f"the engine stalled: no output for {progress.quiet_s:.0f} s with "
                  f"{progress.pending} request(s) pending")
        action = ("failing them and exiting so the supervisor restarts the service" if self.on_stall == "exit"
                  else "failing them; the process stays (health.on_stall: report)")
        logger.error("%s (health.stall_timeout_s: %g); %s", reason, self.timeout_s, action)
        self._output_at_stall = progress.last_output_at
        self.metrics.engine_stalls.inc()
        self.holder.mark_stalled(reason)
        engine = self.holder.engine
        if engine is not None:
            await engine.abort_all(f"{reason}; the request was aborted, retry shortly")
        return True
