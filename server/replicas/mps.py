"""CUDA MPS for the replicas of `serve --replicas N` on one GPU (`server.cuda_mps`).

Without MPS the GPU time-slices between processes: the replicas' kernels take turns, and two
engines keep the GPU busy with less work each (docs/performance/replicas.md). Under one MPS control
daemon their kernels run at once. The supervisor starts the daemon with its pipe and log folders
under its own state folder, gives every replica env() (so the replicas, and only they, are its
clients) and asks it to quit after the replicas have stopped. The GPU's compute mode is left as it
is. Stdlib only: the benchmarks use the same class for `vllm serve` and the gateways alike.

MPS gives up some isolation between the replicas: a fatal GPU fault in one client ends the other
clients' work on that GPU too, and the daemon's server takes no new client until they have all
exited (NVIDIA's MPS documentation, "error containment"); the supervisor then starts each replica
again, as after any exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
# the daemon and the server it starts; under the supervisor (a subreaper) the daemon, which forks
# itself into the background, becomes the supervisor's child, and must not be taken for an orphan
PROCESS_PREFIX = "nvidia-cuda-mps"


class MpsError(RuntimeError):
    pass


def control_binary() -> str | None:
    """nvidia-cuda-mps-control on PATH, or where NVIDIA's container images put the driver's tools."""
    fallback = Path("/usr/local/nvidia/bin") / CONTROL
    return shutil.which(CONTROL) or (str(fallback) if fallback.exists() else None)


class MpsDaemon:
    def __init__(self, directory: Path, binary: str | None = None) -> None:
        self.pipe_dir = directory / "pipe"
        self.log_dir = directory / "log"
        self.binary = binary or control_binary()
        self.started = False

    def env(self) -> dict[str, str]:
        """What a process needs in its environment to be a client of this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir)}

    def _control(self, *args: str, stdin: str | None = None, timeout: float = 30.0) -> subprocess.CompletedProcess:
        assert self.binary is not None
        return subprocess.run([self.binary, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})

    def start(self, timeout_s: float = 10.0) -> dict[str, str]:
        """Starts the daemon (it forks into the background) and returns env(); raises MpsError
        without the binary or when its control pipe does not appear."""
        if self.binary is None:
            raise MpsError(f"{CONTROL} is not installed (it comes with the NVIDIA driver)")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        done = self._control("-d")
        if done.returncode != 0:
            raise MpsError(f"{CONTROL} -d exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
        end = time.monotonic() + timeout_s
        while not (self.pipe_dir / "control").exists():
            if time.monotonic() > end:
                raise MpsError(f"no MPS control pipe in {self.pipe_dir} after {timeout_s:.0f} s")
            time.sleep(0.1)
        self.started = True
        return self.env()

    def stop(self) -> None:
        """Asks the daemon to quit (its server ends once no client is left)."""
        if self.started:
            try:
                self._control(stdin="quit\n")
            except (OSError, subprocess.TimeoutExpired):
                pass  # a daemon that died first leaves nothing to ask
            self.started = False
