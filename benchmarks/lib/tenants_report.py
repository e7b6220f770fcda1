"""What tenants_overhead.py reports: per kind of request and way, the scripted run's latency and
server CPU against `no-keys` round by round (goal: under 0.1 ms added), and the real engine's
throughput and p50 latency with tenants against without (goals: >= 0.99x, within 1 ms)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.lib.scripted_server import BASELINE, SCRIPTED_WAYS

VLLM_WAYS = (BASELINE, "tenants")
KINDS = ("plain", "stream")
GOAL_SCRIPTED_ADDED_MS = 0.1
GOAL_VLLM_THROUGHPUT_RATIO = 0.99
GOAL_VLLM_P50_DELTA_MS = 1.0


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    """Median, min and max of `values`, rounded to `digits`."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def quantile(values: list[float], q: float) -> float:
    """The value at rank q (0-1) of `values`, nearest rank below."""
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def summarize_scripted(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind and way: latency over all requests and server CPU per request; per round, the
    ratio and difference of each to the baseline's in the same round."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        per_way: dict[str, Any] = {}
        rounds = sorted({r["round"] for r in records})
        blocks = {(r["way"], r["round"]): r for r in records if r["kind"] == kind}
        latency = {key: statistics.median(r["latencies_ms"]) for key, r in blocks.items()}
        cpu = {key: r["server_cpu_us_per_request"] for key, r in blocks.items()}
        for way in sorted({r["way"] for r in records}, key=SCRIPTED_WAYS.index):
            every = [v for r in records if r["kind"] == kind and r["way"] == way for v in r["latencies_ms"]]
            entry: dict[str, Any] = {"requests": len(every), "median_ms": round(statistics.median(every), 4),
                                     "p90_ms": round(quantile(every, 0.9), 4),
                                     "server_cpu_us_per_request": round(statistics.median(
                                         [cpu[(way, n)] for n in rounds]), 1)}
            if way != BASELINE:
                added = [latency[(way, n)] - latency[(BASELINE, n)] for n in rounds]
                entry.update({
                    "ratio_to_baseline": spread([latency[(way, n)] / max(latency[(BASELINE, n)], 1e-9)
                                                 for n in rounds]),
                    "added_ms": spread(added),
                    "cpu_ratio_to_baseline": spread([cpu[(way, n)] / max(cpu[(BASELINE, n)], 1e-9) for n in rounds]),
                    "added_cpu_us": spread([cpu[(way, n)] - cpu[(BASELINE, n)] for n in rounds], 1),
                })
                if way == "tenants":
                    entry.update(goal_added_ms=GOAL_SCRIPTED_ADDED_MS,
                                 meets_goal=statistics.median(added) < GOAL_SCRIPTED_ADDED_MS)
            per_way[way] = entry
        out[kind] = per_way
    return out


def scripted_table(summary: dict[str, Any]) -> str:
    lines = ["| request | way | latency median / p90 ms | latency x no-keys (median, min-max over rounds) | "
             "added ms (median, min-max) | server CPU us/request | CPU x no-keys (median, min-max) | goal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, ways in summary.items():
        for way, e in ways.items():
            head = f"| {kind} | {way} | {e['median_ms']:.3f} / {e['p90_ms']:.3f} |"
            if way == BASELINE:
                lines.append(f"{head} 1 | 0 | {e['server_cpu_us_per_request']:.0f} | 1 | |")
                continue
            r, a, c = e["ratio_to_baseline"], e["added_ms"], e["cpu_ratio_to_baseline"]
            goal = (f"< {e['goal_added_ms']} ms: {'met' if e['meets_goal'] else 'MISSED'}"
                    if "goal_added_ms" in e else "")
            lines.append(f"{head} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
                         f"{a['median']:+.3f} ({a['min']:+.3f} to {a['max']:+.3f}) | "
                         f"{e['server_cpu_us_per_request']:.0f} | {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}) | "
                         f"{goal} |")
    return "\n".join(lines)


def summarize_vllm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["round"], r["way"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    out: dict[str, Any] = {}
    for way in VLLM_WAYS:
        mine = [by[(n, way)] for n in rounds]
        out[way] = {"output_token_throughput": spread([r["output_token_throughput"] for r in mine], 2),
                    "e2e_p50_ms": spread([r["e2e_ms"]["median"] for r in mine], 1),
                    "ttft_p50_ms": spread([r["ttft_ms"]["median"] for r in mine], 1),
                    "failed": sum(r["failed"] for r in mine)}
    ratio = [by[(n, "tenants")]["output_token_throughput"] / by[(n, BASELINE)]["output_token_throughput"]
             for n in rounds]
    delta = [by[(n, "tenants")]["e2e_ms"]["median"] - by[(n, BASELINE)]["e2e_ms"]["median"] for n in rounds]
    ttft = [by[(n, "tenants")]["ttft_ms"]["median"] - by[(n, BASELINE)]["ttft_ms"]["median"] for n in rounds]
    out["tenants_vs_no_keys"] = {
        "throughput_ratio": spread(ratio), "e2e_p50_delta_ms": spread(delta, 1), "ttft_p50_delta_ms": spread(ttft, 1),
        "goal": {"throughput_ratio_at_least": GOAL_VLLM_THROUGHPUT_RATIO, "p50_delta_ms_within": GOAL_VLLM_P50_DELTA_MS},
        "meets_throughput_goal": statistics.median(ratio) >= GOAL_VLLM_THROUGHPUT_RATIO,
        "meets_p50_goal": abs(statistics.median(delta)) <= GOAL_VLLM_P50_DELTA_MS,
    }
    return out


def vllm_table(summary: dict[str, Any]) -> str:
    lines = ["| way | output tok/s (median, min-max) | e2e p50 ms (median, min-max) | TTFT p50 ms | failed |",
             "| --- | --- | --- | --- | --- |"]
    for way in VLLM_WAYS:
        e = summary[way]
        t, p, f = e["output_token_throughput"], e["e2e_p50_ms"], e["ttft_p50_ms"]
        lines.append(f"| {way} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | {p['median']:.0f} "
                     f"({p['min']:.0f}-{p['max']:.0f}) | {f['median']:.0f} | {e['failed']} |")
    c = summary["tenants_vs_no_keys"]
    r, d = c["throughput_ratio"], c["e2e_p50_delta_ms"]
    lines.append(f"\ntenants / no-keys per round: throughput {r['median']:.4f} ({r['min']:.4f}-{r['max']:.4f}), "
                 f"goal >= {GOAL_VLLM_THROUGHPUT_RATIO}: {'met' if c['meets_throughput_goal'] else 'MISSED'}; "
                 f"e2e p50 {d['median']:+.1f} ms ({d['min']:+.1f} to {d['max']:+.1f}), goal within "
                 f"{GOAL_VLLM_P50_DELTA_MS} ms: {'met' if c['meets_p50_goal'] else 'MISSED'}")
    return "\n".join(lines)
