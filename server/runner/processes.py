"""The engine's child processes: adopted when orphaned, waited for, ended.

vLLM's engine core and its workers are children of the gateway. A stop must never leave one
behind: the gateway becomes their subreaper, waits for them after the engine stops, and ends
what is left.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import time

import psutil

logger = logging.getLogger("llm_gateway")


def engine_processes() -> list[psutil.Process]:
    """Descendant processes except multiprocessing's resource tracker, which exits only after
    this process does (it then unlinks shared memory that engine processes leaked)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    processes = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if "multiprocessing.resource_tracker" not in " ".join(child.cmdline()):
                processes.append(child)
    return processes


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux `PR_SET_CHILD_SUBREAPER`).

    When a signal reaches vLLM's engine core itself (Ctrl-C signals the whole process group),
    the core can exit before its workers, which would then be re-parented to init and outlive
    the gateway. As a subreaper the gateway keeps them as descendants, waits for them and reaps
    them before it exits.
    """
    import ctypes

    pr_set_child_subreaper = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init as before
        logger.debug("cannot become a child subreaper", exc_info=True)


def wait_for_engine_processes(wait_s: float) -> None:
    """Give engine processes `wait_s` to exit on their own, then terminate what is left."""
    _, alive = psutil.wait_procs(engine_processes(), timeout=wait_s)
    if alive:
        logger.warning("%d engine process(es) still running %.0f s after the engine stopped: terminating",
                       len(alive), wait_s)
        end_processes(alive, grace_s=5.0)


def end_abandoned_starts(quiet_s: float, limit_s: float) -> bool:
    """End the engine processes of a start that nobody waits for any more, including those it
    spawns while this runs, until none has appeared for `quiet_s` (at most `limit_s`).

    An engine start cannot be interrupted: its thread may spawn the engine core (and the core its
    workers) after a first sweep, and the interpreter's exit would then wait for that core to come
    up. Ending each process as it appears makes the start fail at once instead. True when the
    sweep saw no process for `quiet_s` before the limit.
    """
    deadline = time.monotonic() + limit_s
    last_seen = time.monotonic()
    while True:
        processes = engine_processes()
        if processes:
            end_processes(processes, grace_s=2.0)
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen >= quiet_s:
            return True
        if time.monotonic() >= deadline:
            logger.warning("engine processes still appear %.0f s after the stop: exiting without them", limit_s)
            return False
        time.sleep(0.2)


def terminate_children(grace_s: float) -> None:
    """SIGTERM every engine process, SIGKILL those still alive after `grace_s`."""
    end_processes(engine_processes(), grace_s)


def end_processes(processes: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM `processes`, SIGKILL those still alive after `grace_s` (at once when 0)."""
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate() if grace_s > 0 else process.kill()
    _, alive = psutil.wait_procs(processes, timeout=grace_s) if grace_s > 0 else ([], processes)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def stop_child(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> None:
    """SIGTERM a child started with Popen, SIGKILL it after `grace_s`; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)
