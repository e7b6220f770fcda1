"""server/runner/process_group.py: only the gateway's engine processes take a new process group."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

import pytest

from server.engine import compat
from server.runner import engine_exit, process_group
from server.runner.process_group import GATEWAY_PID_ENV, lead_own_group_if_engine_process


def _child_pgid_after_hook(env_value: str | None) -> tuple[int, int]:
    """Fork; the child sets the variable, runs the hook and reports (its pid, its pgid)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(read)
            if env_value is None:
                os.environ.pop(GATEWAY_PID_ENV, None)
            else:
                os.environ[GATEWAY_PID_ENV] = env_value.replace("<self>", str(os.getpid()))
            lead_own_group_if_engine_process()
            os.write(write, f"{os.getpid()} {os.getpgid(0)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    out = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    child, pgid = map(int, out.split())
    return child, pgid


def test_an_engine_process_of_the_gateway_leads_a_new_group() -> None:
    child, pgid = _child_pgid_after_hook(str(os.getpid()))
    assert pgid == child != os.getpgid(0)


@pytest.mark.parametrize("env_value", [None, "<self>"], ids=["no-gateway", "the-gateway-itself"])
def test_other_processes_keep_their_group(env_value: str | None) -> None:
    _, pgid = _child_pgid_after_hook(env_value)
    assert pgid == os.getpgid(0)


def test_the_hook_is_registered_as_a_vllm_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    hooks = {ep.name: ep.load() for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("server.")}
    assert hooks == {"llm_gateway_process_group": process_group.lead_own_group_if_engine_process,
                     "llm_gateway_engine_compat": compat.patch_engine_process,
                     "llm_gateway_engine_exit": engine_exit.end_spawned_engine_process_without_teardown}
    monkeypatch.delenv(GATEWAY_PID_ENV, raising=False)
    process_group.isolate_engine_processes()
    assert os.environ[GATEWAY_PID_ENV] == str(os.getpid())
