"""What the GC-pauses experiment (experiments/gc_pauses.py) reads and reports: the full collections
the gateway timed (`gateway_gc_full_collection_seconds` on /metrics), the pauses the streams saw
(gaps between two tokens), and per way (startup heap frozen or not) the pause time per 1,000
requests."""

from __future__ import annotations

import re
import statistics
from typing import Any

from benchmarks.lib import engine_side, servers

WAYS = {"frozen": True, "unfrozen": False}
GC_SAMPLE = re.compile(r"^gateway_gc_full_collection_seconds_(count|sum) ([0-9.eE+-]+)$", re.M)


def gc_totals(base_url: str) -> dict[str, float]:
    """{"count": full collections so far, "sum": their seconds} from the gateway's /metrics."""
    text = engine_side.metrics_text(base_url, timeout_s=10)
    if text is None:
        raise OSError(f"no /metrics from {base_url}")
    return {k: float(v) for k, v in GC_SAMPLE.findall(text)}


# A gap between two tokens of one stream this long is a stalled event loop, not decoding: the H200's
# per-token interval at c = 256 is ~10-15 ms, and an unfrozen full collection took ~480 ms.
STALL_GAP_S = 0.3
RAMP_TOKENS = 5  # the first gaps of a stream include other requests' prefills: not counted


def stream_gaps(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """What the clients saw of the pauses, from one cell's loadtest requests (`runs[0].requests`,
    per-request token gaps): the longest gap between two tokens of a stream, how many gaps reached
    STALL_GAP_S, and how many requests saw at least one."""
    gaps = [(r.get("itl_s") or [])[RAMP_TOKENS:] for r in requests]
    stalls = [sum(g >= STALL_GAP_S for g in gs) for gs in gaps]
    return {"max_token_gap_ms": round(1000 * max((max(gs) for gs in gaps if gs), default=0.0), 1),
            "token_gaps_over_stall": sum(stalls), "requests_with_stall": sum(1 for n in stalls if n)}


def summarize(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for way in WAYS:
        rs = [r for r in recs if r["way"] == way]
        if not rs:
            continue
        n_req = sum(r["completed"] for r in rs)
        pause_ms = sum(r["gc_pause_ms"] for r in rs)
        full = sum(r["gc_full_collections"] for r in rs)
        rows.append({"way": way, "cells": len(rs), "requests": n_req, "full_collections": full,
                     "pause_ms_total": round(pause_ms, 1),
                     "pause_ms_mean": round(pause_ms / full, 2) if full else None,
                     "pause_ms_per_1k_requests": round(1000 * pause_ms / n_req, 1) if n_req else None,
                     "ttft_p99_ms_median": statistics.median(r["ttft_p99_ms"] for r in rs),
                     "out_tok_s_median": statistics.median(r["output_token_throughput"] for r in rs),
                     "max_token_gap_ms": max((r["max_token_gap_ms"] for r in rs if "max_token_gap_ms" in r),
                                             default="-"),
                     "requests_with_stall": sum(r.get("requests_with_stall", 0) for r in rs)})
    return rows


COLUMNS = (("startup heap", "way"), ("cells", "cells"), ("requests", "requests"),
           ("full collections", "full_collections"), ("pause total ms", "pause_ms_total"),
           ("pause mean ms", "pause_ms_mean"), ("pause ms per 1,000 requests", "pause_ms_per_1k_requests"),
           ("TTFT p99 ms (median)", "ttft_p99_ms_median"), ("out tok/s (median)", "out_tok_s_median"),
           ("longest gap between two tokens ms", "max_token_gap_ms"),
           (f"requests with a gap >= {int(1000 * STALL_GAP_S)} ms", "requests_with_stall"))


def table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return v if isinstance(v, str) else str(v) if isinstance(v, int) else servers.fmt_num(v)

    lines = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[key]) for _, key in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
