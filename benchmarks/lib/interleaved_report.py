"""What http_interleaved.py reports from its result lines: per (way, concurrency) the medians and
spread over the repeats, their ratios to in-process and to `vllm serve`, the engine side and CPU
per cell, the client check's verdict; and each engine's share of GPU memory when all are up."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.lib import servers
from benchmarks.lib.ways import ratio, way_label, way_order

CLIENT_CHECK_LIMIT = 0.03  # doubling the client processes may move the total by less than this


def memory_share(engines: int) -> float:
    """Each engine's `gpu_memory_utilization` with `engines` up at once on one GPU: 0.3 for up to
    three (the share every earlier interleaved run used), less beyond, so that all fit in 0.9."""
    return min(0.3, int(90 / max(1, engines)) / 100)


SIDE_FIELDS = ("tpot_p50_ms", "engine_itl_ms", "engine_tokens_per_step", "engine_prefill_ms", "engine_queue_ms",
               "frontend_cpu_cores", "engine_cpu_cores", "client_cpu_cores", "host_cpu_busy_pct")


def _median(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def side_table(rows: list[dict[str, Any]]) -> str:
    """The engine core's own timing and the CPU per cell (lib/engine_side.py), medians over the repeats:
    a client TPOT above the engine's per-token interval is frontend delay; an engine interval that
    grows with the frontend's work is the engine core slowed beside it."""
    f = servers.fmt_num
    out = ["| concurrency | way | client TPOT p50 ms | engine per-token interval ms | engine tokens per step "
           "| engine prefill ms | engine queue ms | frontend CPU cores | engine CPU cores | client CPU cores "
           "| host CPU busy % |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = " | ".join(f(r.get(f"{k}_median")) for k in SIDE_FIELDS)
        out.append(f"| {r['concurrency']} | {way_label(r['way'])} | {cells} |")
    return "\n".join(out)


def summarize(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and spread per (way, concurrency) over the repeats; ratios of medians."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("bench") == "http_overhead" and not r.get("client_check"):
            cells.setdefault((r["way"], r["concurrency"]), []).append(r)
    rows = []
    for (way, c), rs in sorted(cells.items(), key=lambda kv: (kv[0][1], way_order(kv[0][0]))):
        tok = [r["output_token_throughput"] for r in rs]
        ttft = [r["ttft_p50_ms"] for r in rs if r["ttft_p50_ms"] is not None]
        ttft99 = [r["ttft_p99_ms"] for r in rs if r.get("ttft_p99_ms") is not None]
        chars = [r["output_chars_per_token"] for r in rs if r.get("output_chars_per_token") is not None]
        rows.append({"way": way, "concurrency": c, "repeats": len(rs), "out_tok_s_median": round(statistics.median(tok), 1),
                     "out_tok_s_min": round(min(tok), 1), "out_tok_s_max": round(max(tok), 1),
                     "ttft_p50_ms_median": round(statistics.median(ttft), 2) if ttft else None,
                     "ttft_p50_ms_min": min(ttft) if ttft else None, "ttft_p50_ms_max": max(ttft) if ttft else None,
                     "ttft_p99_ms_median": round(statistics.median(ttft99), 2) if ttft99 else None,
                     "ttft_p99_ms_min": min(ttft99) if ttft99 else None,
                     "ttft_p99_ms_max": max(ttft99) if ttft99 else None,
                     "failed": sum(r["failed"] or 0 for r in rs),
                     "output_chars_per_token": round(statistics.median(chars), 2) if chars else None,
                     **{f"{k}_median": _median(rs, k) for k in SIDE_FIELDS}})
    by = {(r["way"], r["concurrency"]): r for r in rows}
    for r in rows:
        for ref in ("inproc", "vllm"):
            base = by.get((ref, r["concurrency"]))
            if base and r["way"] != ref:
                r[f"vs_{ref}"] = ratio(r["out_tok_s_median"], base["out_tok_s_median"])
    return rows


def client_verdict(change: float) -> str:
    """What doubling the client processes says: a gain means the client was the bottleneck; a loss
    (seen on the H200: -39% to -44% at c = 32) means noise or clients taking CPU from the servers."""
    if abs(change) < CLIENT_CHECK_LIMIT:
        return "enough clients"
    if change > 0:
        return "THE CLIENT LIMITS THIS RUN"
    return "SLOWER WITH MORE CLIENTS: noise or CPU contention, not settled"


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    f = servers.fmt_num
    out = ["| concurrency | way | repeats | out tok/s median (min-max) | TTFT p50 median ms (min-max) "
           "| TTFT p99 median ms (min-max) | vs in-process | vs vllm serve | failed | text chars per token |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['concurrency']} | {way_label(r['way'])} | {r['repeats']} | {f(r['out_tok_s_median'])} "
                   f"({f(r['out_tok_s_min'])}-{f(r['out_tok_s_max'])}) | {f(r['ttft_p50_ms_median'])} "
                   f"({f(r.get('ttft_p50_ms_min'))}-{f(r.get('ttft_p50_ms_max'))}) | {f(r.get('ttft_p99_ms_median'))} "
                   f"({f(r.get('ttft_p99_ms_min'))}-{f(r.get('ttft_p99_ms_max'))}) | "
                   f"{f(r.get('vs_inproc'))} | {f(r.get('vs_vllm'))} | {r['failed']} "
                   f"| {f(r.get('output_chars_per_token'))} |")
    for ck in checks:
        out.append(f"\nClient check, {ck['way']} at c = {ck['concurrency']}: {ck['workers']} -> {ck['workers_doubled']} "
                   f"processes moved out tok/s by {ck['change'] * 100:+.1f}% "
                   f"({client_verdict(ck['change'])}).")
    return "\n".join(out)
