"""CUDA MPS for the replicas (server/replicas/mps.py and the supervisor's use of it:
`server.cuda_mps`) against a stand-in for nvidia-cuda-mps-control (the real one needs an NVIDIA
driver; tests/gpu runs the real one): the daemon gets its pipe and log folders under the
supervisor's state folder, every replica's env names them, `quit` goes to its control pipe after
the replicas stop, a missing binary or pipe is a clear error, the daemon a subreaper adopts is not
ended as a dead replica's leftover, and on CPU the setting is ignored."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import psutil
import pytest

from server.replicas.mps import MpsDaemon, MpsError
from server.replicas.supervisor import Supervisor, strays
from server.settings import EngineProfile, ServerSettings, Settings

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


def gpu_settings(tmp_path: Path, *, cuda_mps: bool = True, device: str = "gpu") -> Settings:
    return Settings(engine=EngineProfile(device=device, served_model_name="m",
                                         **({"kv_cache_memory_bytes": 1} if device == "cpu" else {})),
                    server=ServerSettings(state_dir=str(tmp_path / "state"), port=18100, cuda_mps=cuda_mps))


def test_the_replicas_are_clients_of_the_supervisors_daemon(tmp_path: Path) -> None:
    sup = Supervisor(gpu_settings(tmp_path), [], 2)
    try:
        assert sup.mps is not None
        mps_dir = Path(sup.settings.server.state_dir).resolve() / "replicas-18100" / "mps"
        for replica in sup.replicas:
            assert replica.env["CUDA_MPS_PIPE_DIRECTORY"] == str(mps_dir / "pipe")
            assert replica.env["CUDA_MPS_LOG_DIRECTORY"] == str(mps_dir / "log")
        sup.mps.binary = fake_control(tmp_path)
        assert sup._start_mps()
        assert (mps_dir / "pipe" / "control").exists()
        sup._stop_all()  # no replica ran: the daemon is still asked to quit
        assert (mps_dir / "log" / "commands").read_text() == "quit\n"
    finally:
        sup.metrics.stop()


def test_without_the_binary_the_replicas_do_not_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sup = Supervisor(gpu_settings(tmp_path), [], 2)
    try:
        assert sup.mps is not None
        sup.mps.binary = None
        with caplog.at_level(logging.ERROR, logger="llm_gateway.replicas"):
            assert not sup._start_mps()
        assert "the CUDA MPS daemon did not start: nvidia-cuda-mps-control is not installed" in caplog.text
    finally:
        sup.metrics.stop()


@pytest.mark.parametrize("device,replicas,cuda_mps", [("cpu", 2, True), ("gpu", 1, True), ("gpu", 2, False)])
def test_no_daemon_on_cpu_with_one_replica_or_when_off(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                        device: str, replicas: int, cuda_mps: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="llm_gateway.replicas"):
        sup = Supervisor(gpu_settings(tmp_path, cuda_mps=cuda_mps, device=device), [], replicas)
    try:
        assert sup.mps is None
        assert not any(k.startswith("CUDA_MPS_") and k not in os.environ for k in sup.replicas[0].env)
        assert ("ignored on CPU" in caplog.text) == (device == "cpu")
    finally:
        sup.metrics.stop()


def test_the_adopted_daemon_is_not_a_dead_replicas_leftover(tmp_path: Path) -> None:
    """Under the supervisor (a subreaper) the daemon, forked into the background, becomes its child;
    _end_orphans must leave it running while it ends what dead replicas left."""
    named = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", named)
    daemon = subprocess.Popen([str(named), "30"])
    leftover = subprocess.Popen(["sleep", "30"])
    try:
        children = [c for c in psutil.Process().children() if c.pid in (daemon.pid, leftover.pid)]
        assert [c.pid for c in strays(children, set(), mps=True)] == [leftover.pid]
        assert {c.pid for c in strays(children, set(), mps=False)} == {daemon.pid, leftover.pid}
        assert strays(children, {leftover.pid}, mps=True) == []
    finally:
        for p in (daemon, leftover):
            p.kill()
            p.wait()
