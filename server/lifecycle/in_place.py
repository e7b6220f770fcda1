"""The in-place weight swap: pause the engine, load new weights, resume; never leave it paused.

The holder decides when (its reload queue, `reload.in_place_mode`) and checks first what may be
swapped (`server.lifecycle.weights`); this module runs the engine side and its rollback:
- the new weights load: resume, `success`;
- they fail part-way (the model may hold a mix of both versions): load the previous weights
  again, resume, `rolled_back`;
- the previous weights fail too: `RollbackFailed`; the caller stops the engine, since resuming
  would serve a model that is neither version.
A cancelled swap (shutdown) still resumes the engine before the cancellation goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from server.engine import Engine

logger = logging.getLogger("llm_gateway.in_place")


class RollbackFailed(RuntimeError):
    """Neither the new nor the previous weights could be loaded; the engine must not serve."""


@dataclass
class SwapOutcome:
    outcome: str  # success | rolled_back
    pause_s: float  # generation paused, from pause to resume
    load_s: float  # the weight load alone (the failed one for a rollback)
    error: str | None = None
    stop_s: float = 0.0  # of pause_s, the wait for the engine to stop (its step in progress, the cache cleared)


async def prefetch(engine: Engine, path: str, timeout_s: float) -> None:
    """Have the engine read the new weights while it still generates (it keeps them for the
    reload); on failure the reload reads the files itself, during the pause."""
    t0 = time.monotonic()
    why_not = await engine.prefetch_weights(path, timeout_s)
    if why_not:
        logger.warning("in-place reload: no prefetch (%s); the files are read during the pause", why_not)
    else:
        logger.info("in-place reload: weights read in %.3f s before pausing", time.monotonic() - t0)


async def swap_weights(engine: Engine, new_path: str, old_path: str) -> SwapOutcome:
    """Pause `engine`, load `new_path`, resume; on failure load `old_path` again and resume."""
    t_pause = time.monotonic()
    await engine.pause_generation()
    paused = True
    try:
        t_load = time.monotonic()
        stop_s = t_load - t_pause
        try:
            await engine.reload_weights(new_path)
            outcome, error = "success", None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = f"loading {new_path} failed: {exc}"
            logger.error("in-place reload: %s; loading the previous weights (%s) again", error, old_path)
            try:
                await engine.reload_weights(old_path)
            except Exception as again:
                paused = False  # the caller stops the engine instead
                raise RollbackFailed(f"{error}; reloading the previous weights failed too: {again}") from again
            outcome = "rolled_back"
        load_s = time.monotonic() - t_load
        await engine.resume_generation()
        paused = False
        return SwapOutcome(outcome, time.monotonic() - t_pause, load_s, error, stop_s)
    finally:
        if paused:  # cancelled, or resume itself raised: one more try, shielded from the cancel
            logger.warning("in-place reload interrupted: resuming the engine")
            try:
                await asyncio.shield(engine.resume_generation())
            except Exception:
                logger.exception("could not resume the engine after an interrupted in-place reload")
