"""Where a decode step's time goes: GPU kernel time against wall time, from the torch profiler traces
vLLM's workers write (`profiler_config={"profiler": "torch", ...}`, `LLM.start_profile()` /
`stop_profile()`). Stdlib only, as profiles.py is.

A step that keeps the GPU busy 95% of its wall time is bound by the GPU (kernels, memory traffic);
one that keeps it busy 30% is bound by the CPU around it (scheduling, input preparation, sampling,
output processing, kernel launches). Kernels replayed from a CUDA graph are recorded like any other.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", []) if isinstance(doc, dict) else doc


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(trace_dir: Path, tokens: int, top: int = 12, files: list[Path] | None = None) -> dict:
    """Summary of the traces under `trace_dir` for a run that produced `tokens` output tokens:
    the GPU's busy time (union of kernel, copy and memset intervals) against the span from the first
    to the last of them, per token, and the kernels that took the most GPU time. `files`: only these
    (the traces of one profiled run; none gives an empty summary), else every trace under `trace_dir`."""
    files = sorted(p for p in (files if files is not None else trace_dir.rglob("*"))
                   if p.is_file() and (p.suffix == ".gz" or p.suffix == ".json"))
    best: dict | None = None
    for path in files:
        try:
            events = _events(path)
        except (OSError, ValueError, EOFError):
            continue
        gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e]
        if not gpu:
            continue  # the frontend's CPU-only trace
        intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
        span = max(e for _, e in intervals) - min(s for s, _ in intervals)
        busy = _union_us(intervals)
        by_name: dict[str, float] = {}
        for e in gpu:
            name = e.get("name", "?")[:120]
            by_name[name] = by_name.get(name, 0.0) + float(e["dur"])
        launches = sum(1 for e in events if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch")
        summary = {
            "trace": path.name,
            "tokens": tokens,
            "gpu_events": len(gpu),
            "graph_launches": launches,
            "span_ms": round(span / 1000, 3),
            "gpu_busy_ms": round(busy / 1000, 3),
            "gpu_busy_fraction": round(busy / span, 3) if span else None,
            "wall_ms_per_token": round(span / 1000 / tokens, 3) if tokens else None,
            "gpu_ms_per_token": round(busy / 1000 / tokens, 3) if tokens else None,
            "top_kernels_ms": {
                k: round(v / 1000, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
            },
        }
        if best is None or summary["gpu_events"] > best["gpu_events"]:
            best = summary
    return best or {"trace": None, "files": [p.name for p in files], "tokens": tokens}
