"""server/runner/engine_exit.py: a spawned engine process of the gateway ends at `spawn_main`'s
`sys.exit` with its own exit status, its atexit handlers run, and every other `sys.exit` (and
every process the gateway did not start) behaves as Python's."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from server.runner.engine_exit import end_spawned_engine_process_without_teardown
from server.runner.process_group import GATEWAY_PID_ENV


def _note(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


class _TornDown:
    """Notes the interpreter's teardown: it clears module globals, which drops this object."""

    def __init__(self, path: str) -> None:
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_APPEND), os.write

    def __del__(self) -> None:
        self.write(self.fd, b"teardown ran\n")


_TEARDOWN: list[_TornDown] = []


def _child(path: str, status: object) -> None:
    """The spawned child: runs the hook as vLLM's plugin loader would, then ends with `status`."""
    end_spawned_engine_process_without_teardown()
    Path(path).touch()
    _TEARDOWN.append(_TornDown(path))
    _note(path, f"hooked={getattr(sys.exit, '_llm_gateway', False)}")
    atexit.register(_note, path, "atexit ran")
    try:
        sys.exit(7)  # not spawn_main's: must raise as usual
    except SystemExit as exc:
        _note(path, f"inner exit raised {exc.code}")
    if status is not None:
        raise SystemExit(status)


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: object,
         gateway_pid: str | None) -> tuple[int | None, list[str]]:
    path = tmp_path / "notes"
    if gateway_pid is None:
        monkeypatch.delenv(GATEWAY_PID_ENV, raising=False)
    else:
        monkeypatch.setenv(GATEWAY_PID_ENV, gateway_pid)
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(str(path), status))
    child.start()
    child.join(120)
    return child.exitcode, path.read_text().splitlines()


@pytest.mark.parametrize("status,code", [(None, 0), (3, 3), ("a message", 1)])
def test_a_spawned_engine_process_ends_with_its_status_and_atexit_handlers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: object, code: int) -> None:
    exitcode, notes = _run(tmp_path, monkeypatch, status, gateway_pid=str(os.getpid()))
    assert exitcode == code
    assert notes == ["hooked=True", "inner exit raised 7", "atexit ran"]  # and no teardown


def test_processes_the_gateway_did_not_start_are_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exitcode, notes = _run(tmp_path, monkeypatch, 3, gateway_pid=None)
    assert exitcode == 3
    assert notes == ["hooked=False", "inner exit raised 7", "atexit ran", "teardown ran"]
