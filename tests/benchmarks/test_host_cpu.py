"""benchmarks/lib/host_cpu.py: where the host's CPU went during a cell (the replicas benchmark's
profile of its limit), on synthetic snapshots and on this process burning a core."""

from __future__ import annotations

import os
import time

from benchmarks.lib import host_cpu


def test_window_shares_of_one_core_and_busy_cores() -> None:
    before = host_cpu.Snapshot(100.0, 50.0, {"g1": {"api": 1.0, "core": 10.0, "other": 0.0},
                                              "g2": {"api": 2.0, "core": 20.0, "other": 0.0}})
    after = host_cpu.Snapshot(110.0, 90.0, {"g1": {"api": 4.0, "core": 20.0, "other": 1.0},
                                             "g2": {"api": 2.5, "core": 29.0, "other": 0.0}})
    got = host_cpu.cpu_window(before, after)
    assert got["cpu_by_server"] == {"g1": {"api_pct": 30.0, "core_pct": 100.0},
                                    "g2": {"api_pct": 5.0, "core_pct": 90.0}}
    assert got["machine_busy_cores"] == 4.0
    assert got["other_busy_cores"] == 1.65  # 40 s busy, 23.5 of them the servers'


def test_sampler_sees_this_process_burn_cpu() -> None:
    sampler = host_cpu.CpuSampler({"me": os.getpid()}, interval_s=0.1)
    try:
        t0 = time.time()
        while time.time() - t0 < 1.0:  # a busy loop: this process's API share
            sum(range(1000))
        t1 = time.time()
        time.sleep(0.3)
        got = sampler.window(t0, t1)
        assert got["cpu_by_server"]["me"]["api_pct"] > 5.0, got  # a loaded CI machine still gives it a share
        assert got["cpu_by_server"]["me"]["core_pct"] == 0.0
        assert got["machine_busy_cores"] > 0.05 and got["cpu_count"] >= 1
        assert sampler.window(t0 - 3600, t1) == {}  # no snapshot that early
        assert set(sampler.window(t0, t1, servers=[])["cpu_by_server"]) == set()
    finally:
        sampler.stop()
