"""`compare A.json B.json`: side-by-side table of two result files, run by run, with B/A ratios."""

from __future__ import annotations

import math
from typing import Any

ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("completed", ("completed",)),
    ("failed", ("failed",)),
    ("request/s", ("request_throughput",)),
    ("output tok/s", ("output_token_throughput",)),
    ("peak output tok/s", ("peak_output_token_throughput",)),
    ("goodput req/s", ("goodput",)),
    *((f"{m.upper()} {p} ms", (f"{m}_ms", p)) for m in ("ttft", "tpot", "itl", "e2e")
      for p in ("mean", "median", "p99")),
)


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) else None


def _fmt(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if value.is_integer() and abs(value) >= 1 else f"{value:,.2f}"


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    out = []
    if len(a["runs"]) != len(b["runs"]):
        out.append(f"note: {name_a} has {len(a['runs'])} runs, {name_b} has {len(b['runs'])}; comparing the first "
                   f"{min(len(a['runs']), len(b['runs']))} in order")
    for run_a, run_b in zip(a["runs"], b["runs"]):
        out.append(f"=== {run_a['label']} vs {run_b['label']} ===")
        out.append(f"{'metric':<22}{name_a[:16]:>18}{name_b[:16]:>18}{'B/A':>9}")
        for label, path in ROWS:
            va, vb = _get(run_a["summary"], path), _get(run_b["summary"], path)
            ratio = "-" if va in (None, 0) or vb is None or not math.isfinite(va) else f"{vb / va:.3f}"
            out.append(f"{label:<22}{_fmt(va):>18}{_fmt(vb):>18}{ratio:>9}")
    return "\n".join(out)
