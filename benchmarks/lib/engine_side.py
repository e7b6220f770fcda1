"""What the engine core and the CPUs did during one benchmark cell (issue 14, goal 1's c = 32 gap).

A client's TPOT mixes the engine core's step time with the frontend's delivery delay. vLLM's
request histograms are stamped with the engine core's own timestamps (`EngineCoreOutputs.timestamp`:
`vllm:inter_token_latency_seconds`, `vllm:request_prefill_time_seconds`, ... in vLLM 0.26 and 0.32
alike), so their deltas over a cell say how fast the engine core itself stepped, whichever frontend
fed it. Read from `/metrics` for the HTTP ways (the gateway exposes vLLM's `vllm:*` families; `vllm
serve` too) and from this process's Prometheus registry for the in-process way.

Beside them, CPU time per cell (psutil): the frontend process (the gateway, `vllm serve`'s API
server or the in-process driver), its engine-core children, the load clients (the driver's reaped
children), and the host's busy share. A frontend near 1.0 core is a saturated event loop; an engine
core that steps slower while the host is busier points at CPU contention, not at the frontend's code.
"""

from __future__ import annotations

import os
import re
import resource
import time
import urllib.request
from collections.abc import Callable
from typing import Any

SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([-+0-9.eE]+|NaN)$")
WANTED = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
          "vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count",
          "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
          "vllm:iteration_tokens_total_count", "vllm:generation_tokens_total")


def parse_vllm(text: str) -> dict[str, float]:
    """The WANTED samples of a Prometheus text exposition, summed over label sets (engines)."""
    got: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in WANTED and m.group(2) != "NaN":
            got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(2))
    return got


def metrics_text(base_url: str, timeout_s: float = 5.0) -> str | None:
    """A server's /metrics on loopback; None if it did not answer."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:  # noqa: S310 (loopback)
            return resp.read().decode(errors="replace")
    except OSError:
        return None


def scrape(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """vLLM's counters from a server's /metrics on loopback; None if it did not answer."""
    text = metrics_text(base_url, timeout_s)
    return None if text is None else parse_vllm(text)


def local() -> dict[str, float]:
    """vLLM's counters from this process's registry (the in-process AsyncLLM's stat logger)."""
    from prometheus_client import REGISTRY, generate_latest

    return parse_vllm(generate_latest(REGISTRY).decode(errors="replace"))


def _mean_ms(before: dict[str, float], after: dict[str, float], family: str) -> float | None:
    n = after.get(family + "_count", 0.0) - before.get(family + "_count", 0.0)
    s = after.get(family + "_sum", 0.0) - before.get(family + "_sum", 0.0)
    return round(1000.0 * s / n, 3) if n > 0 else None


def engine_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Engine-side means over the cell: per-token interval (the core's step time as each running
    request sees it), prefill and queue time per request, generated tokens per step (batch)."""
    if not before or not after:
        return {}
    steps = after.get("vllm:iteration_tokens_total_count", 0.0) - before.get("vllm:iteration_tokens_total_count", 0.0)
    gen = after.get("vllm:generation_tokens_total", 0.0) - before.get("vllm:generation_tokens_total", 0.0)
    return {"engine_itl_ms": _mean_ms(before, after, "vllm:inter_token_latency_seconds"),
            "engine_prefill_ms": _mean_ms(before, after, "vllm:request_prefill_time_seconds"),
            "engine_queue_ms": _mean_ms(before, after, "vllm:request_queue_time_seconds"),
            "engine_steps": int(steps), "engine_tokens_per_step": round(gen / steps, 2) if steps > 0 else None}


def _tree_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of `pid`, CPU seconds of its live descendants); zeros if it is gone."""
    import psutil  # vLLM's dependency: present wherever an engine runs

    def cpu(p: Any) -> float:
        t = p.cpu_times()
        return t.user + t.system

    try:
        proc = psutil.Process(pid)
        own = cpu(proc)
        kids = 0.0
        for child in proc.children(recursive=True):
            try:
                kids += cpu(child)
            except psutil.Error:
                pass
        return own, kids
    except psutil.Error:
        return 0.0, 0.0


class CpuMeter:
    """CPU cores used over one cell: the frontend process, its engine children, the load clients
    (reaped children of this process: start it before the client runs, stop it after it exits),
    and the host's busy share. Shares are CPU seconds per wall second (1.0 = one core)."""

    def __init__(self, frontend_pid: int, count_clients: bool = True):
        import psutil

        self.pid, self.count_clients = frontend_pid, count_clients
        self.t0 = time.monotonic()
        self.front0, self.engine0 = _tree_cpu(frontend_pid)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.clients0 = kids.ru_utime + kids.ru_stime
        psutil.cpu_percent(None)  # starts the host's busy-share interval

    def stop(self) -> dict[str, Any]:
        import psutil

        wall = max(1e-6, time.monotonic() - self.t0)
        front, engine = _tree_cpu(self.pid)
        out = {"cell_wall_s": round(wall, 2), "frontend_cpu_cores": round((front - self.front0) / wall, 3),
               "engine_cpu_cores": round((engine - self.engine0) / wall, 3),
               "host_cpu_busy_pct": round(psutil.cpu_percent(None), 1), "host_cpus": os.cpu_count()}
        if self.count_clients:
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            out["client_cpu_cores"] = round((kids.ru_utime + kids.ru_stime - self.clients0) / wall, 3)
        return out


class CellMeter:
    """One cell's engine side and CPU: vLLM's counters read through `read_vllm` (`local`, or a
    `scrape` of the server) before and after, and a CpuMeter between; `stop()` merges both."""

    def __init__(self, frontend_pid: int, read_vllm: Callable[[], dict[str, float] | None],
                 count_clients: bool = True):
        self._read = read_vllm
        self._before = read_vllm()
        self._cpu = CpuMeter(frontend_pid, count_clients)

    def stop(self) -> dict[str, Any]:
        return {**self._cpu.stop(), **engine_delta(self._before, self._read())}


def brief(rec: dict[str, Any]) -> str:
    """The engine-side and CPU fields of a result line, for a driver's progress line."""
    clients = f"clients {rec['client_cpu_cores']}, " if "client_cpu_cores" in rec else ""
    return (f"engine ITL {rec.get('engine_itl_ms')} ms, {rec.get('engine_tokens_per_step')} tok/step; CPU cores: "
            f"frontend {rec['frontend_cpu_cores']}, engine {rec['engine_cpu_cores']}, {clients}"
            f"host busy {rec['host_cpu_busy_pct']}%")
