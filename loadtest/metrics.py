"""Summary statistics of a run: counts, throughputs, latency percentiles, goodput under SLOs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtest.records import RequestRecord

# SLO names accepted on the command line -> how to read the value (seconds) from a record.
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), so numbers match vLLM's."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe(values: Sequence[float]) -> dict[str, float]:
    """mean/median/p90/p99/min/max in milliseconds."""
    ms = [v * 1000.0 for v in values]
    if not ms:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "min", "max")}
    return {"mean": sum(ms) / len(ms), "median": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "min": min(ms), "max": max(ms)}


def _token_times(record: RequestRecord) -> list[tuple[float, float]]:
    """(arrival time, tokens) per chunk; usage tokens spread evenly over the chunks."""
    if record.ttft_s is None or record.chunks == 0:
        return []
    per_chunk = record.output_tokens / record.chunks
    t = record.sent_s + record.ttft_s
    out = [(t, per_chunk)]
    for gap in record.itl_s:
        t += gap
        out.append((t, per_chunk))
    return out


def peak_output_rate(records: Sequence[RequestRecord], window_s: float = 1.0) -> float:
    """Most output tokens seen in any one-second bucket, like vLLM's `Peak output token throughput`."""
    buckets: dict[int, float] = {}
    for r in records:
        for t, n in _token_times(r):
            key = int(t // window_s)
            buckets[key] = buckets.get(key, 0.0) + n
    return max(buckets.values(), default=0.0) / window_s


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.latency_s,
              "itl": max(record.itl_s) if record.itl_s else None}
    for name, limit in slos_ms.items():
        value = values[name]
        # A one-token answer has no TPOT/ITL: it cannot violate a decode SLO.
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slos_ms: dict[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    dur = duration_s if duration_s > 0 else math.nan
    in_tokens = sum(r.prompt_tokens or r.input_tokens_requested or 0 for r in ok)
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or f"HTTP {r.status}")[:120]
        errors[key] = errors.get(key, 0) + 1
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "input_token_throughput": in_tokens / dur,
        "output_token_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
        "peak_output_token_throughput": peak_output_rate(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # A stream of tokens that decode to nothing (e.g. special tokens) still counts as tokens: this
        # says whether the text arrived (a real model: ~4 characters a token).
        "output_chars_per_token": sum(r.output_chars for r in ok) / out_tokens if out_tokens else math.nan,
        "ttft_ms": describe([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": describe([g for r in ok for g in r.itl_s]),
        "e2e_ms": describe([r.latency_s for r in ok if r.latency_s is not None]),
        "send_lag_ms": describe([max(0.0, r.send_lag_s) for r in records]),
        "errors": errors,
    }
    if slos_ms:
        good = sum(1 for r in ok if meets_slos(r, slos_ms))
        summary["slos_ms"] = dict(slos_ms)
        summary["goodput"] = good / dur
        summary["good_requests"] = good
    return summary
