"""benchmarks/tenants_overhead.py: its aggregation (benchmarks/lib/tenants_report.py), and a short real
run of the scripted part (real uvicorn servers and redis-server; seconds, no model)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from benchmarks.lib import tenants_report as to

ROOT = Path(__file__).resolve().parents[2]


def block(rnd: int, way: str, kind: str, latency: float, cpu: float) -> dict:
    return {"round": rnd, "position": 0, "way": way, "kind": kind, "server_cpu_us_per_request": cpu,
            "latencies_ms": [latency - 0.1, latency, latency + 0.5]}


def test_scripted_summary_is_per_round_ratios_and_added_time() -> None:
    records = []
    for rnd, (base, memory, redis) in enumerate([(2.0, 2.05, 3.0), (4.0, 4.08, 5.2), (2.0, 2.2, 3.1)]):
        for kind in to.KINDS:
            records += [block(rnd, "no-keys", kind, base, 500), block(rnd, "tenants", kind, memory, 550),
                        block(rnd, "tenants-redis", kind, redis, 800)]
    summary = to.summarize_scripted(records)["plain"]
    memory, redis = summary["tenants"], summary["tenants-redis"]
    assert summary["no-keys"]["requests"] == 9 and summary["no-keys"]["median_ms"] == 2.5
    assert memory["added_ms"] == {"median": 0.08, "min": 0.05, "max": 0.2}
    assert memory["meets_goal"] and memory["goal_added_ms"] == 0.1
    assert "meets_goal" not in redis and redis["added_ms"]["median"] == 1.1
    assert memory["added_cpu_us"]["median"] == 50 and redis["cpu_ratio_to_baseline"]["median"] == 1.6
    assert "| plain | tenants |" in to.scripted_table(to.summarize_scripted(records))


def test_vllm_summary_checks_the_issue_goals() -> None:
    def run(rnd: int, way: str, tok_s: float, e2e: float) -> dict:
        return {"round": rnd, "way": way, "output_token_throughput": tok_s, "e2e_ms": {"median": e2e},
                "ttft_ms": {"median": e2e / 10}, "failed": 0}

    runs = [run(0, "no-keys", 100.0, 2000.0), run(0, "tenants", 99.5, 2000.5),
            run(1, "tenants", 101.0, 1990.2), run(1, "no-keys", 100.0, 1990.0)]
    verdict = to.summarize_vllm(runs)["tenants_vs_no_keys"]
    assert verdict["throughput_ratio"] == {"median": 1.0025, "min": 0.995, "max": 1.01}
    assert verdict["meets_throughput_goal"] and verdict["meets_p50_goal"]
    runs[1]["output_token_throughput"] = 97.0
    runs[2]["output_token_throughput"] = 98.0
    assert not to.summarize_vllm(runs)["tenants_vs_no_keys"]["meets_throughput_goal"]
    assert "tenants / no-keys per round" in to.vllm_table(to.summarize_vllm(runs))


def test_a_short_scripted_run_measures_every_way(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tenants_overhead", "--engine", "scripted", "--rounds", "2",
         "--requests", "3", "--warmup", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())["scripted"]
    assert set(result["summary"]["plain"]) == {"no-keys", "tenants", "tenants-redis"}
    assert len(result["rounds"]) == 2 * 3 * len(to.KINDS)
    for rec in result["rounds"]:
        assert len(rec["latencies_ms"]) == 3 and rec["server_cpu_us_per_request"] > 0
    assert "| stream | tenants-redis |" in proc.stdout
    # the tenant ways really ran the tenant path: each stored both tenants' usage (warm-up included)
    for way in ("tenants", "tenants-redis"):
        with sqlite3.connect(tmp_path / "work" / f"usage-{way}.sqlite3") as db:
            got = dict(db.execute("SELECT tenant, requests FROM usage").fetchall())
        # request i of a block uses tenant i % 2: 2 + 1 per block of 3, and the warm-up's first key
        assert got == {"bench-0": 2 * 2 * len(to.KINDS) + len(to.KINDS), "bench-1": 2 * len(to.KINDS)}, got
