"""server/runner/processes.py: a stop ends the processes an abandoned engine start spawns late."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# Run in a process of its own: the sweep ends every child of the process it runs in.
SCRIPT = textwrap.dedent("""
    import asyncio, subprocess, sys, threading, time

    from server.engine import run_abandonable, starts_running
    from server.runner.processes import end_abandoned_starts

    spawned = []

    def start():  # as vLLM's start: the engine core comes later, then the handshake waits on it
        time.sleep(1.0)
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        spawned.append(core)
        if core.wait() != 0:
            raise RuntimeError("engine core initialization failed")
        return "engine"

    async def main():
        task = asyncio.ensure_future(run_abandonable(start, lambda engine: None, name="fake-start"))
        await asyncio.sleep(0.1)
        task.cancel()  # shutdown began: the start is abandoned, its thread runs on
        assert starts_running() == 1
        t0 = time.monotonic()
        done = await asyncio.to_thread(end_abandoned_starts, starts_running, 20.0)
        took = time.monotonic() - t0
        assert done, "the start thread should have ended"
        assert spawned and spawned[0].returncode is not None, "the late engine core should be ended"
        assert starts_running() == 0
        assert took < 10, took
        print(f"ok {took:.1f}")

    asyncio.run(main())
""")


def test_a_stop_ends_the_engine_core_an_abandoned_start_spawns_late() -> None:
    """The first sweep finds nothing; the start thread spawns its engine core a second later.
    The sweep keeps ending new processes until the thread is gone, then reports success."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok"), out.stdout


def test_the_sweep_gives_up_after_its_limit_when_a_start_never_ends() -> None:
    script = textwrap.dedent("""
        import threading, time
        from server.engine import runtime
        from server.runner.processes import end_abandoned_starts

        runtime._start_thread(lambda: time.sleep(30), "stuck-start")
        t0 = time.monotonic()
        assert end_abandoned_starts(runtime.starts_running, 1.0) is False
        print(f"ok {time.monotonic() - t0:.1f}")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    took = float(out.stdout.split()[1])
    assert 1.0 <= took < 15, took
