"""Human-readable summary table of one run."""

from __future__ import annotations

import math
from typing import Any

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))


def _num(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:,.{digits}f}"


def format_summary(label: str, s: dict[str, Any]) -> str:
    lines = [f"=== {label} ===",
             f"{'completed / failed':<34}{s['completed']} / {s['failed']}",
             f"{'duration (s)':<34}{_num(s['duration_s'])}",
             f"{'request throughput (req/s)':<34}{_num(s['request_throughput'], 3)}",
             f"{'input token throughput (tok/s)':<34}{_num(s['input_token_throughput'])}",
             f"{'output token throughput (tok/s)':<34}{_num(s['output_token_throughput'])}",
             f"{'peak output throughput (tok/s)':<34}{_num(s['peak_output_token_throughput'])}",
             f"{'output text (chars per token)':<34}{_num(s.get('output_chars_per_token', math.nan))}"]
    if "goodput" in s:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items())
        lines.append(f"{'goodput (req/s) [' + slos + ']':<34}{_num(s['goodput'], 3)} ({s['good_requests']} good)")
    lines.append(f"{'(ms)':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key, name in LATENCIES:
        d = s[key]
        lines.append(f"{name:<14}" + "".join(f"{_num(d[p]):>10}" for p in ("mean", "median", "p90", "p99")))
    lag = s["send_lag_ms"]
    lines.append(f"{'client send lag (ms)':<34}mean {_num(lag['mean'])}, p99 {_num(lag['p99'])}, max {_num(lag['max'])}")
    for err, n in s.get("errors", {}).items():
        lines.append(f"  error x{n}: {err}")
    return "\n".join(lines)
