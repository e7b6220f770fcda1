"""Checks on the device machine, in seconds, that a CUDA MPS daemon starts there and that a CUDA
process can work as its client (a container may forbid MPS), before a run that depends on it:
`python3 -m benchmarks.lib.mps [folder]`. The daemon is the gateway's own class
(server/replicas/mps.py, `server.cuda_mps`), which benchmarks/replicas.py also uses for `--mps`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server.replicas.mps import MpsDaemon, MpsError


# a matrix product on the GPU, as an MPS client; nvidia-smi then lists the MPS server
PROBE_CLIENT = ("import torch; x = torch.randn(4096, 4096, device='cuda'); "
                "print('client ok', torch.cuda.get_device_name(), float((x @ x).abs().sum()) > 0)")


def probe(directory: Path, binary: str | None = None, client_code: str = PROBE_CLIENT) -> int:
    """0 when the daemon starts and a CUDA client runs under it; prints what it saw."""
    daemon = MpsDaemon(directory, binary)
    try:
        env = daemon.start()
    except MpsError as exc:
        print(f"mps probe: the daemon did not start: {exc}")
        return 1
    try:
        try:
            client = subprocess.run([sys.executable, "-c", client_code], capture_output=True, text=True, timeout=120,
                                    env={**os.environ, **env})
        except subprocess.TimeoutExpired:
            print("mps probe: the client hung for 120 s under the daemon")
            return 1
        print(f"mps probe: client exit {client.returncode}: {(client.stdout + client.stderr).strip()[-800:]}")
        try:
            listed = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
            print(f"mps probe: nvidia-smi lists the MPS server: {'nvidia-cuda-mps-server' in listed}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"mps probe: no nvidia-smi listing: {exc}")
        return 0 if client.returncode == 0 else 1
    finally:
        daemon.stop()
        time.sleep(1.0)
        for log in sorted(daemon.log_dir.glob("*.log")):
            print(f"mps probe: {log.name}: {log.read_text(errors='replace').strip()[-600:]}")


if __name__ == "__main__":
    sys.exit(probe(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="mps-probe-"))))
