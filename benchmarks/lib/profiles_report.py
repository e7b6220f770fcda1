"""The engine-profile search's workloads (profiles.py runs them) and its result lines read back:
the table of median tok/s per profile and workload. Stdlib only, as profiles.py is."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# name: (number of prompts, prompt tokens, output tokens, metric)
# metric "total" = (prompt + output tokens) / s, "output" = output tokens / s
WORKLOADS: dict[str, tuple[int, int, int, str]] = {
    "prefill_256x4096_16": (256, 4096, 16, "total"),
    "prefill_4x1024_1": (4, 1024, 1, "total"),
    "decode_32x512_256": (32, 512, 256, "output"),
    "decode_256x512_256": (256, 512, 256, "output"),
    "single_1x1024_256": (1, 1024, 256, "output"),
}


def load(paths: list[Path]) -> list[dict]:
    """Result lines from JSON-lines files, a JSON list or a {"meta": ..., "results": [...]} document."""
    recs = []
    for p in paths:
        if not p.exists():
            continue
        text = p.read_text().strip()
        if text.startswith("["):
            recs.extend(json.loads(text))
        elif text.startswith("{") and '"results"' in text[:200000] and "\n{" not in text:
            recs.extend(json.loads(text)["results"])
        else:
            recs.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return recs


def _tok(v: float) -> str:
    return f"{v / 1000:.2f}k" if v >= 1000 else f"{v:.0f}"


def table(recs: list[dict], base: str = "defaults") -> str:
    """Median tok/s per (profile, workload), its min-max when repeated, and the ratio of medians
    to `base`."""
    profiles = list(dict.fromkeys(r["profile"] for r in recs))
    wls = [w for w in WORKLOADS if any(r["workload"] == w for r in recs)]
    runs: dict[tuple[str, str], list[float]] = {}
    for r in recs:
        runs.setdefault((r["profile"], r["workload"]), []).append(r["tok_s"])
    med = {key: statistics.median(values) for key, values in runs.items()}
    head = "| profile | " + " | ".join(wls) + " |"
    lines = [head, "|" + " --- |" * (len(wls) + 1)]
    for p in profiles:
        cells = []
        for w in wls:
            v = med.get((p, w))
            if v is None:
                cells.append("-")
                continue
            cell = _tok(v)
            values = runs[(p, w)]
            if len(values) > 1:
                cell += f" ({_tok(min(values))}-{_tok(max(values))})"
            b = med.get((base, w))
            if b and p != base:
                cell += f" {v / b:.2f}x"
            cells.append(cell)
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
