"""Where the host's CPU went during one benchmark cell: each server's API process and engine core
(as % of one core) and the machine's busy cores. An engine core near 100% is bound by its own host
work per step; a machine near all its cores busy is bound by the host as a whole (clients included).

    sampler = CpuSampler({"gateway1": pid, ...})   # a snapshot every 0.5 s
    cell = sampler.window(t0, t1)                  # wall times (time.time())
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil

ENGINE_CORE_MARK = "EngineCore"  # vLLM names its engine core process VLLM::EngineCore (0.26 and 0.32)


@dataclass
class Snapshot:
    wall: float
    machine_busy_s: float
    # per server name: CPU seconds of its API process ("api"), its engine core(s) ("core") and any other descendant
    servers: dict[str, dict[str, float]] = field(default_factory=dict)


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _role(proc: psutil.Process) -> str:
    try:
        name = proc.name() + " " + " ".join(proc.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other"
    return "core" if ENGINE_CORE_MARK in name else "other"


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a server's process (`api`), its engine cores (`core`) and the rest of its tree."""
    out = {"api": 0.0, "core": 0.0, "other": 0.0}
    try:
        root = psutil.Process(pid)
        out["api"] = _cpu_s(root)
        children = root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return out
    for child in children:
        try:
            out[_role(child)] += _cpu_s(child)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def snapshot(pids: dict[str, int]) -> Snapshot:
    return Snapshot(time.time(), machine_busy_s(), {name: tree_cpu(pid) for name, pid in pids.items()})


def cpu_window(before: Snapshot, after: Snapshot) -> dict[str, object]:
    """Between two snapshots: per server its API process's and engine core's % of one core, the
    machine's busy cores (of `cpu_count`), and what no server used (clients, nginx, the rest)."""
    wall = max(after.wall - before.wall, 1e-6)
    per: dict[str, dict[str, float]] = {}
    servers_busy = 0.0
    for name, a in after.servers.items():
        b = before.servers.get(name)
        if b is None:
            continue
        d = {k: max(a[k] - b[k], 0.0) for k in a}
        servers_busy += sum(d.values())
        per[name] = {"api_pct": round(100 * d["api"] / wall, 1), "core_pct": round(100 * d["core"] / wall, 1)}
    busy = max(after.machine_busy_s - before.machine_busy_s, 0.0)
    return {"cpu_by_server": per, "machine_busy_cores": round(busy / wall, 2),
            "other_busy_cores": round(max(busy - servers_busy, 0.0) / wall, 2), "cpu_count": psutil.cpu_count()}


class CpuSampler:
    """A snapshot of the servers' process trees and the machine every `interval_s`, so that a driver
    can ask what the CPU did during the timed part of a cell (`window`), not the client's start."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.snapshots: list[Snapshot] = [snapshot(self.pids)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.snapshots.append(snapshot(self.pids))

    def window(self, t0: float, t1: float, servers: list[str] | None = None) -> dict[str, object]:
        """cpu_window between the last snapshot at or before t0 and the first at or after t1 (wall
        times), for `servers` (default all); {} before two snapshots bracket it."""
        snaps = list(self.snapshots)
        before = [s for s in snaps if s.wall <= t0]
        after = [s for s in snaps if s.wall >= t1]
        if not before or not after:
            return {}
        b, a = before[-1], after[0]
        if servers is not None:
            b = Snapshot(b.wall, b.machine_busy_s, {k: v for k, v in b.servers.items() if k in servers})
            a = Snapshot(a.wall, a.machine_busy_s, {k: v for k, v in a.servers.items() if k in servers})
        return cpu_window(b, a)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
