"""benchmarks/lib/mps.py's probe against a stand-in for nvidia-cuda-mps-control (the real one needs
an NVIDIA driver): a client runs under the daemon, which is stopped after it; a failing client or
daemon is a failed probe. The daemon itself: tests/unit/test_replicas_mps.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lib.mps import probe
from tests.unit.test_replicas_mps import fake_control


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
