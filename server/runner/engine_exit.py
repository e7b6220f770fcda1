"""vLLM's spawned engine processes end without the interpreter's teardown.

On the CPU, vLLM starts its engine core and its worker with multiprocessing's `spawn`. When one of
them ends, its work is done by the time `multiprocessing.spawn.spawn_main` calls `sys.exit(code)`:
the process body has returned, multiprocessing has run its finalizers, joined its threads and
flushed stdio. What is left is the interpreter tearing down torch's, transformers' and vLLM's
modules, about 1.6 s a process on 2 cores, and every engine stop pays it twice in a row (the worker,
then the engine core, which waits for the worker). So every reload and every `systemctl stop`
waited for it. The hook here ends such a process at that point the way a forked one already ends
(multiprocessing's fork start calls `os._exit`): the atexit handlers run (logging flushes its
handlers), stdio is flushed, then `os._exit` with the same exit status.

It acts only in the processes the serving gateway started (as `process_group` does), and only on
the `sys.exit` that `spawn_main` makes: any other `sys.exit` raises SystemExit as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.spawn
import os
import sys
from typing import Any

from server.runner.process_group import started_by_the_gateway


def end_spawned_engine_process_without_teardown() -> None:
    """The `vllm.general_plugins` hook (pyproject), run early in each vLLM process."""
    if not started_by_the_gateway() or getattr(sys.exit, "_llm_gateway", False):
        return
    spawn_main = multiprocessing.spawn.spawn_main.__code__
    system_exit = sys.exit

    def exit(status: Any = None) -> None:  # noqa: A001 - replaces sys.exit
        # spawn_main passes the int multiprocessing's bootstrap returned; anything else exits as usual
        if sys._getframe(1).f_code is not spawn_main or not isinstance(status, int):
            system_exit(status)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status & 0xFF)

    exit._llm_gateway = True  # type: ignore[attr-defined]
    sys.exit = exit  # type: ignore[assignment]
