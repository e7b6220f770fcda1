"""The engine-profile benchmark's driver without vLLM (`python -m benchmarks.profiles --dry-run`):
repeats, and a table of medians with spreads (benchmarks/lib/profiles_report.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.lib import profiles_report

ROOT = Path(__file__).resolve().parents[2]


def _rec(profile: str, workload: str, tok_s: float, repeat: int = 0) -> dict:
    return {"profile": profile, "workload": workload, "repeat": repeat, "tok_s": tok_s}


def test_table_shows_median_spread_and_ratio_of_medians() -> None:
    recs = [_rec("defaults", "decode_256x512_256", v, i) for i, v in enumerate((10_000, 12_000, 11_000))]
    recs += [_rec("no_prefix_cache_32k", "decode_256x512_256", v, i) for i, v in enumerate((13_200, 9_000, 14_000))]
    recs += [_rec("no_prefix_cache_32k", "single_1x1024_256", 280.0)]
    lines = profiles_report.table(recs).splitlines()
    assert lines[0] == "| profile | decode_256x512_256 | single_1x1024_256 |"
    assert lines[2] == "| defaults | 11.00k (10.00k-12.00k) | - |"
    # 13.2k / 11k: the ratio is of medians, not of best runs
    assert lines[3] == "| no_prefix_cache_32k | 13.20k (9.00k-14.00k) 1.20x | 280 |"


def test_dry_run_writes_one_line_per_repeat(tmp_path: Path) -> None:
    out = tmp_path / "dry.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.profiles", "--dry-run", "--repeats", "3",
         "--profiles", "defaults,no_prefix_cache_32k_512seqs", "--workloads", "decode_32x512_256,prefill_4x1024_1",
         "--out", str(out), "--deadline-s", "60", "--min-left-s", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 2 * 2 * 3
    seen = {(r["profile"], r["workload"], r["repeat"]) for r in recs}
    assert ("no_prefix_cache_32k_512seqs", "prefill_4x1024_1", 2) in seen
    assert {r["engine_args"]["max_num_seqs"] for r in recs if r["profile"] == "no_prefix_cache_32k_512seqs"} == {512}
    assert "(" in run.stdout.splitlines()[-1]  # the final table shows the spread of the repeats


def test_step_trace_counts_overlapping_kernels_once(tmp_path: Path) -> None:
    """GPU busy time is the union of kernel intervals (two streams overlap), against the span from
    the first kernel to the last; the frontend's CPU-only trace is passed over."""
    import gzip

    from benchmarks.lib.step_trace import summarise

    worker = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 500, "dur": 1000},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 3000, "dur": 1000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 5},
    ]
    with gzip.open(tmp_path / "worker.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": worker}, f)
    (tmp_path / "frontend.pt.trace.json").write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "schedule", "ts": 0, "dur": 9000}]}))
    s = summarise(tmp_path, tokens=2)
    assert s["trace"] == "worker.pt.trace.json.gz"
    assert (s["span_ms"], s["gpu_busy_ms"], s["gpu_busy_fraction"]) == (4.0, 2.5, 0.625)
    assert (s["wall_ms_per_token"], s["gpu_ms_per_token"], s["graph_launches"]) == (2.0, 1.25, 1)
    assert list(s["top_kernels_ms"]) == ["gemm", "attn", "copy"]


def test_dry_run_traces_the_named_profiles_only(tmp_path: Path) -> None:
    out = tmp_path / "dry.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.profiles", "--dry-run", "--profiles", "defaults,defaults_fp8",
         "--workloads", "single_1x1024_256", "--trace-profiles", "defaults_fp8", "--out", str(out),
         "--deadline-s", "60", "--min-left-s", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    steps = [json.loads(line) for line in (tmp_path / "dry-steps.jsonl").read_text().splitlines()]
    assert [(s["profile"], s.get("kind")) for s in steps] == [("defaults_fp8", None), ("defaults_fp8", "decode_256_streams")]
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["engine_args"].get("quantization") for r in recs if r["profile"] == "defaults_fp8"} == {"fp8"}


def test_interleaved_dry_run_rotates_the_profiles_and_traces_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "dry.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.profiles", "--dry-run", "--interleave", "--repeats", "2",
         "--profiles", "defaults,defaults_full_decode_only", "--workloads", "decode_32x512_256,single_1x1024_256",
         "--trace-profiles", "defaults_full_decode_only", "--kv-cache-gib", "8", "--out", str(out),
         "--deadline-s", "60", "--min-left-s", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    cells = [(r["repeat"], r["workload"], r["profile"]) for r in recs]
    # repeat by repeat, workload by workload, the profiles' order rotating
    assert cells == [
        (0, "decode_32x512_256", "defaults"), (0, "decode_32x512_256", "defaults_full_decode_only"),
        (0, "single_1x1024_256", "defaults"), (0, "single_1x1024_256", "defaults_full_decode_only"),
        (1, "decode_32x512_256", "defaults_full_decode_only"), (1, "decode_32x512_256", "defaults"),
        (1, "single_1x1024_256", "defaults_full_decode_only"), (1, "single_1x1024_256", "defaults"),
    ]
    assert {r["engine_info"]["share"]["gpu_memory_utilization"] for r in recs} == {0.45}
    assert {r["engine_info"]["share"]["kv_cache_memory_bytes"] for r in recs} == {8 * 2**30}
    steps = [json.loads(line) for line in (tmp_path / "dry-steps.jsonl").read_text().splitlines()]
    assert [(s["profile"], s.get("kind")) for s in steps] == [
        ("defaults_full_decode_only", None), ("defaults_full_decode_only", "decode_256_streams")]
