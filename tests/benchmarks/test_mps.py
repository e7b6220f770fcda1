"""benchmarks/lib/mps.py against a stand-in for nvidia-cuda-mps-control (the real one needs an
NVIDIA driver): the daemon gets its pipe and log folders under the run's folder, the clients' env
names them, `quit` goes to its control pipe, and a missing binary or pipe is a clear error."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from benchmarks.lib.mps import MpsDaemon, MpsError, probe

FAKE = """#!/bin/sh
# -d: start (the real daemon forks and makes its control pipe); no argument: a command on stdin
if [ "$1" = "-d" ]; then echo started > "$CUDA_MPS_LOG_DIRECTORY/control.log"; touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
cat >> "$CUDA_MPS_LOG_DIRECTORY/commands"
"""


def fake_control(tmp_path: Path, body: str = FAKE) -> str:
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_start_env_and_quit(tmp_path: Path) -> None:
    daemon = MpsDaemon(tmp_path / "mps", binary=fake_control(tmp_path))
    env = daemon.start()
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
                   "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log")}
    assert (tmp_path / "mps" / "log" / "control.log").read_text() == "started\n"
    daemon.stop()
    daemon.stop()  # once only
    assert (tmp_path / "mps" / "log" / "commands").read_text() == "quit\n"


def test_errors_say_what_is_missing(tmp_path: Path) -> None:
    missing = MpsDaemon(tmp_path / "a")
    missing.binary = None
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control is not installed"):
        missing.start()
    failing = MpsDaemon(tmp_path / "b", binary=fake_control(tmp_path, "#!/bin/sh\necho 'no GPU' >&2\nexit 1\n"))
    with pytest.raises(MpsError, match="exited 1: no GPU"):
        failing.start()
    silent_dir = tmp_path / "c"
    silent_dir.mkdir()
    silent = MpsDaemon(tmp_path / "c" / "mps", binary=fake_control(silent_dir, "#!/bin/sh\nexit 0\n"))
    with pytest.raises(MpsError, match="no MPS control pipe"):
        silent.start(timeout_s=0.3)


def test_probe_runs_a_client_under_the_daemon_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    control = fake_control(tmp_path)
    code = "import os; print('client ok', os.environ['CUDA_MPS_PIPE_DIRECTORY'])"
    assert probe(tmp_path / "mps", binary=control, client_code=code) == 0
    out = capsys.readouterr().out
    assert f"client exit 0: client ok {tmp_path / 'mps' / 'pipe'}" in out
    assert (tmp_path / "mps" / "log" / "commands").read_text() == "quit\n"  # stopped after the client
    assert probe(tmp_path / "m2", binary=control, client_code="raise SystemExit(3)") == 1
    failing = tmp_path / "failing"
    failing.mkdir()
    assert probe(tmp_path / "m3", binary=fake_control(failing, "#!/bin/sh\nexit 1\n")) == 1
    assert "the daemon did not start" in capsys.readouterr().out
