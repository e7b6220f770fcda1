"""vLLM's engine processes lead their own process group, so a terminal's Ctrl-C reaches only the
gateway, which then drains and stops the engine in order.

A terminal signals its whole foreground process group. When Ctrl-C reached vLLM's processes too,
they raced the gateway's ordered stop: the output handler logged `EngineDeadError` (vLLM 0.32),
and vLLM 0.26's worker exited before the engine core, which logged ERROR "Worker proc
VllmWorker-0 died unexpectedly" with a traceback (seen in a CI run here).

How the code gets into vLLM's processes: vLLM starts them with multiprocessing (`spawn` on CPU,
`fork` on CUDA), and a spawned child imports none of the gateway's modules (`python -m server`'s
`__main__` is not re-run there). But every vLLM process loads the `vllm.general_plugins` entry
points early in its start (the engine core's and the worker's init, vLLM 0.26 and 0.32), and
pyproject registers `lead_own_group_if_engine_process` as one. It acts only in a process whose
environment names a different gateway pid: `vllm serve` and other vLLM users of the same venv are
left alone. systemd is unaffected: it signals the main process (KillMode=mixed) and kills the
whole cgroup at the end.
"""

from __future__ import annotations

import contextlib
import os

GATEWAY_PID_ENV = "LLM_GATEWAY_PROCESS_GROUP_OF"
"""Set by the serving gateway to its pid; inherited by the engine processes it starts."""


def isolate_engine_processes() -> None:
    """Called once by the serving gateway before its engine starts."""
    os.environ[GATEWAY_PID_ENV] = str(os.getpid())


def started_by_the_gateway() -> bool:
    """Whether this process is one the serving gateway started (its engine core or a worker)."""
    gateway = os.environ.get(GATEWAY_PID_ENV)
    return bool(gateway) and gateway != str(os.getpid())


def lead_own_group_if_engine_process() -> None:
    """The vLLM plugin hook: in a process the gateway started, lead a new process group."""
    if started_by_the_gateway():
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
