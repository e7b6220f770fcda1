"""What benchmarks/replicas.py reports from its result lines: per (client, way, concurrency) the
median over the repeats with the spread and the ratio to `vllm serve` by the same client, the goal
check of issue 36, how the replicas split the work, and each engine's memory from its log."""

from __future__ import annotations

import re
import statistics
from typing import Any

from benchmarks.lib import servers
from benchmarks.lib.ways import ratio

GOAL_HIGH_C = 256  # from this concurrency on, the replicas should beat one engine by GOAL_RATIO
GOAL_RATIO = 1.5
GOAL_LOW_RATIO = 0.97  # below it, no worse than today

MEMORY_LINES = {  # vLLM's own log lines (0.26 and 0.32 print them alike)
    "weights_gib": re.compile(r"Model loading took ([0-9.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([0-9.]+) GiB"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([0-9,]+) tokens"),
    "max_concurrency_x": re.compile(r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.,]+)x"),
    "cuda_graphs_gib": re.compile(r"Graph capturing finished in [0-9.]+ secs?, took ([0-9.]+) GiB"),
}


def engine_memory(log: str) -> dict[str, float]:
    """The last value of each MEMORY_LINES line in an engine's log (absent lines are left out)."""
    out: dict[str, float] = {}
    for key, pattern in MEMORY_LINES.items():
        found = pattern.findall(log)
        if found:
            out[key] = float(found[-1].replace(",", ""))
    return out


WARMUP_LINE = re.compile(r"engine warmed up: (\d+) requests in (\d+) ms \(the long prompt alone (\d+) ms\)")


def engine_warmup(log: str) -> dict[str, float] | None:
    """The gateway's last warm-up line (server/lifecycle/warmup.py); None where it did not warm up."""
    found = WARMUP_LINE.findall(log)
    if not found:
        return None
    requests, total, first = found[-1]
    return {"requests": int(requests), "total_ms": float(total), "long_prompt_ms": float(first)}


def balance(before: list[dict[str, float] | None], after: list[dict[str, float] | None]) -> list[float] | None:
    """Each replica's share of the tokens generated between two scrapes of their /metrics."""
    deltas = []
    for b, a in zip(before, after):
        if b is None or a is None:
            return None
        deltas.append(a.get("vllm:generation_tokens_total", 0.0) - b.get("vllm:generation_tokens_total", 0.0))
    total = sum(deltas)
    return [round(d / total, 3) for d in deltas] if total > 0 else None


def way_key(way: str) -> tuple[int, int, int]:
    """vllm serve first, then by replica count (rN before fN at the same N)."""
    if way == "vllm":
        return (0, 0, 0)
    return (1, int(way[1:]) if way[1:].isdigit() else 0, 0 if way.startswith("r") else 1)


def way_label(way: str) -> str:
    if way == "vllm":
        return "vllm serve (one engine)"
    if way.startswith("f"):  # benchmarks/replicas.py --fill-first
        return f"gateway x {way[1:]} behind nginx, fill-first"
    return f"gateway x {way[1:]} behind nginx"


def _median(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return round(statistics.median(got), 2) if got else None


def _med(rs: list[dict[str, Any]], key: str) -> float | None:
    return _median([r.get(key) for r in rs])


def _per_server(r: dict[str, Any], key: str) -> float | None:
    """The mean over a cell's serving engines of one host_cpu share (core_pct, api_pct)."""
    vals = [v[key] for v in (r.get("cpu_by_server") or {}).values() if v.get(key) is not None]
    return round(sum(vals) / len(vals), 1) if vals else None


def summarize(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("bench") == "replicas":
            cells.setdefault((r["client"], int(r["concurrency"]), r["way"]), []).append(r)
    rows = []
    for (client, c, way), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], way_key(kv[0][2]))):
        tok = [r["output_token_throughput"] for r in rs]
        ttft = [r["ttft_p50_ms"] for r in rs if r.get("ttft_p50_ms") is not None]
        rows.append({"client": client, "concurrency": c, "way": way, "replicas": rs[0].get("replicas"),
                     "repeats": len(rs), "out_tok_s_median": round(statistics.median(tok), 1),
                     "out_tok_s_min": round(min(tok), 1), "out_tok_s_max": round(max(tok), 1),
                     "ttft_p50_ms_median": round(statistics.median(ttft), 1) if ttft else None,
                     "ttft_p50_ms_min": min(ttft) if ttft else None, "ttft_p50_ms_max": max(ttft) if ttft else None,
                     "ttft_p99_ms_median": _med(rs, "ttft_p99_ms"), "tpot_p50_ms_median": _med(rs, "tpot_p50_ms"),
                     "gpu_util_mean_pct_median": _med(rs, "gpu_util_mean_pct"),
                     "timed_gpu_util_mean_pct_median": _med(rs, "timed_gpu_util_mean_pct"),
                     "engine_core_pct_median": _median([_per_server(r, "core_pct") for r in rs]),
                     "api_pct_median": _median([_per_server(r, "api_pct") for r in rs]),
                     "machine_busy_cores_median": _med(rs, "machine_busy_cores"),
                     "failed": sum(int(r.get("failed") or 0) for r in rs)})
    by = {(r["client"], r["concurrency"], r["way"]): r for r in rows}
    for r in rows:
        base = by.get((r["client"], r["concurrency"], "vllm"))
        if base and r["way"] != "vllm":
            r["vs_vllm"] = ratio(r["out_tok_s_median"], base["out_tok_s_median"])
            if r["ttft_p50_ms_median"] is not None and base["ttft_p50_ms_median"] is not None:
                r["ttft_vs_vllm"] = ratio(r["ttft_p50_ms_median"], base["ttft_p50_ms_median"])
    return rows


def goal_check(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (client, concurrency): the best replica count by out tok/s against `vllm serve`, and whether
    it meets issue 36's goal there (>= 1.5x at c >= 256 with TTFT p50 no higher; >= 0.97x below)."""
    out = []
    for client, c in sorted({(r["client"], r["concurrency"]) for r in rows}):
        cands = [r for r in rows if r["client"] == client and r["concurrency"] == c and r.get("vs_vllm") is not None]
        if not cands:
            continue
        best = max(cands, key=lambda r: r["vs_vllm"])
        need = GOAL_RATIO if c >= GOAL_HIGH_C else GOAL_LOW_RATIO
        ttft_ok = c < GOAL_HIGH_C or (best.get("ttft_vs_vllm") is not None and best["ttft_vs_vllm"] <= 1.0)
        out.append({"client": client, "concurrency": c, "best_way": best["way"], "vs_vllm": best["vs_vllm"],
                    "ttft_vs_vllm": best.get("ttft_vs_vllm"), "needed": need,
                    "meets": best["vs_vllm"] >= need and ttft_ok and best["failed"] == 0})
    return out


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    f = servers.fmt_num
    out = ["| client | concurrency | way | repeats | out tok/s median (min-max) | vs vllm serve | TTFT p50 ms "
           "median (min-max) | TPOT p50 ms | GPU util % | engine core / API % of a core | busy cores | failed |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['client']} | {r['concurrency']} | {way_label(r['way'])} | {r['repeats']} | "
                   f"{f(r['out_tok_s_median'])} ({f(r['out_tok_s_min'])}-{f(r['out_tok_s_max'])}) | "
                   f"{'-' if r.get('vs_vllm') is None else format(r['vs_vllm'], '.2f') + 'x'} | "
                   f"{f(r['ttft_p50_ms_median'])} ({f(r['ttft_p50_ms_min'])}-{f(r['ttft_p50_ms_max'])}) | "
                   f"{f(r['tpot_p50_ms_median'])} | {f(r.get('timed_gpu_util_mean_pct_median') or r['gpu_util_mean_pct_median'])} | "
                   f"{f(r.get('engine_core_pct_median'))} / {f(r.get('api_pct_median'))} | "
                   f"{f(r.get('machine_busy_cores_median'))} | {r['failed']} |")
    if checks:
        out.append("")
        out.append(f"Goal (issue 36): replicas >= {GOAL_RATIO}x `vllm serve` at c >= {GOAL_HIGH_C} with TTFT p50 "
                   f"no higher, >= {GOAL_LOW_RATIO}x below:")
        for ck in checks:
            ttft = "" if ck.get("ttft_vs_vllm") is None else f", TTFT p50 {ck['ttft_vs_vllm']:.2f}x"
            out.append(f"- {ck['client']}, c = {ck['concurrency']}: best {ck['best_way']} at "
                       f"{ck['vs_vllm']:.2f}x{ttft}: {'meets' if ck['meets'] else 'misses'} (needs {ck['needed']}x)")
    return "\n".join(out)
