"""server/runner/processes.py: a stop ends the processes an abandoned engine start spawns late."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# Each case runs in a process of its own: the sweep ends every child of the process it runs in.
LATE_CORE = textwrap.dedent("""
    import subprocess, sys, threading, time

    from server.runner.processes import end_abandoned_starts, terminate_children

    def sleeper():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    spawned = []

    def start():  # as vLLM's start: the engine core comes later, then the handshake waits on it
        time.sleep(1.5)
        core = sleeper()
        spawned.append(core)
        core.wait()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    t0 = time.monotonic()
    assert end_abandoned_starts(quiet_s=3.0, limit_s=20.0)
    took = time.monotonic() - t0
    assert spawned and spawned[0].poll() is not None, "the late engine core should be ended"
    thread.join(5)
    assert not thread.is_alive(), "the start should fail once its engine core is gone"
    print(f"ok {took:.1f}")
""")

NEVER_QUIET = textwrap.dedent("""
    import os, subprocess, sys, threading, time

    from server.runner.processes import end_abandoned_starts, terminate_children

    def sleeper():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def respawn():  # a start that keeps spawning: the sweep must still give up at its limit
        while True:
            sleeper().wait()

    threading.Thread(target=respawn, daemon=True).start()
    t0 = time.monotonic()
    assert end_abandoned_starts(quiet_s=3.0, limit_s=2.0) is False
    print(f"ok {time.monotonic() - t0:.1f}", flush=True)
    terminate_children(grace_s=0)
    os._exit(0)  # the respawning thread would go on
""")


def run(script: str) -> float:
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout
    return float(out.stdout.split()[1])


def test_a_stop_ends_the_engine_core_an_abandoned_start_spawns_late() -> None:
    """The first sweep finds nothing; the start spawns its engine core 1.5 s later. The sweep
    ends it and returns once no process has appeared for the quiet time."""
    took = run(LATE_CORE)
    assert 4.5 <= took < 20, took  # 1.5 s until the core, then 3 s quiet


def test_the_sweep_gives_up_at_its_limit_when_processes_keep_appearing() -> None:
    took = run(NEVER_QUIET)
    assert 2.0 <= took < 15, took
