"""benchmarks/tenants_overhead.py: its aggregation, and a short real run (scripted engine, real
uvicorn servers and redis-server; seconds, no model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tenants_overhead as to  # noqa: E402


def block(rnd: int, way: str, kind: str, latency: float, cpu: float) -> dict:
    return {"round": rnd, "position": 0, "way": way, "kind": kind, "server_cpu_us_per_request": cpu,
            "latencies_ms": [latency - 0.1, latency, latency + 0.5]}


def test_summary_is_per_round_ratios_and_added_time() -> None:
    records = []
    for rnd, (base, memory, redis) in enumerate([(2.0, 2.2, 3.0), (4.0, 4.2, 5.2), (2.0, 2.1, 3.1)]):
        for kind in to.KINDS:
            records += [block(rnd, "no-tenants", kind, base, 500), block(rnd, "tenants-memory", kind, memory, 550),
                        block(rnd, "tenants-redis", kind, redis, 800)]
    summary = to.summarize(records)["plain"]
    memory, redis = summary["tenants-memory"], summary["tenants-redis"]
    assert summary["no-tenants"]["requests"] == 9 and summary["no-tenants"]["median_ms"] == 2.5
    assert memory["added_ms"] == {"median": 0.2, "min": 0.1, "max": 0.2}
    assert memory["ratio_to_baseline"]["median"] == 1.05 and memory["meets_goal"]
    assert redis["added_ms"]["median"] == 1.1 and redis["meets_goal"] is (1.1 <= to.GOAL_ADDED_MS["tenants-redis"])
    assert memory["added_cpu_us"]["median"] == 50 and redis["cpu_ratio_to_baseline"]["median"] == 1.6
    text = to.table(to.summarize(records))
    assert "| plain | tenants-memory |" in text and "added <= 0.5 ms: met" in text


def test_a_short_run_measures_every_way(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tenants_overhead.py"), "--rounds", "2", "--requests", "3",
         "--warmup", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["summary"]["plain"]) == {"no-tenants", "tenants-memory", "tenants-redis"}
    assert len(result["rounds"]) == 2 * 3 * len(to.KINDS)
    for rec in result["rounds"]:
        assert len(rec["latencies_ms"]) == 3 and rec["server_cpu_us_per_request"] > 0
    assert "| stream | tenants-redis |" in proc.stdout
    # the tenant ways really ran the tenant path: each server stored the bench tenant's usage
    import sqlite3

    for way in ("tenants-memory", "tenants-redis"):
        with sqlite3.connect(tmp_path / "work" / f"usage-{way}.sqlite3") as db:
            [(tenant, requests)] = db.execute("SELECT tenant, requests FROM usage").fetchall()
        assert tenant == "bench" and requests == 2 * 3 * len(to.KINDS) + len(to.KINDS)  # + warm-up
