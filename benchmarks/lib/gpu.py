"""The GPU seen through nvidia-smi: waiting for it to be free between engines, its memory, and its
utilisation sampled during a benchmark's cells. Stdlib only, so that profiles.py (which runs
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


class GpuSampler:
    """nvidia-smi's utilisation and memory every `interval_ms`, kept with their times, so a driver can
    ask what the GPU did during one cell (`window`). Without nvidia-smi it samples nothing."""

    def __init__(self, interval_ms: int = 500):
        import threading

        self.samples: list[tuple[float, float, float]] = []  # (time, util %, memory used MiB)
        try:
            self.proc: subprocess.Popen[str] | None = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                util, mem = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.time(), util, mem))

    def window(self, t0: float, t1: float) -> dict[str, float | int | None]:
        """Mean and minimum utilisation and the most memory used between the wall times t0 and t1."""
        got = [s for s in list(self.samples) if t0 <= s[0] <= t1]
        if not got:
            return {"gpu_util_mean_pct": None, "gpu_util_min_pct": None, "gpu_mem_max_mib": None, "gpu_samples": 0}
        return {"gpu_util_mean_pct": round(sum(s[1] for s in got) / len(got), 1),
                "gpu_util_min_pct": min(s[1] for s in got), "gpu_mem_max_mib": max(s[2] for s in got),
                "gpu_samples": len(got)}

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
