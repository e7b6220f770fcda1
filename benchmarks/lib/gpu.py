"""Waiting for the GPU to be free between engines: stdlib only, so that profiles.py (which runs
where only vLLM is installed) can use it as well as the HTTP drivers."""

from __future__ import annotations

import subprocess
import time


def wait_gpu_free(limit_s: float = 30.0) -> None:
    """Wait until the GPU holds no compute process (the last engine's memory is back)."""
    t = time.monotonic()
    while time.monotonic() - t < limit_s:
        try:
            r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return
        if not r.stdout.strip():
            return
        time.sleep(1)


def gpu_total_gib() -> float | None:
    """The first GPU's memory in GiB, or None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return round(float(r.stdout.split()[0]) / 1024, 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
