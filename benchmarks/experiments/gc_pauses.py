#!/usr/bin/env python3
"""Full garbage collections in the gateway, with the startup heap frozen or not, side by side.

`server.freeze_gc_heap` (server/gc_heap.py) freezes the heap the engine and its libraries leave
behind, as `vllm serve` does, so a full collection no longer walks ~600k objects on the event loop.
Two gateways on the same profile, the flag on and off, both up at once; each cell runs one
`loadtest` against one of them, the order rotating per repeat. Per cell: the full collections the
gateway timed (`gateway_gc_full_collection_seconds`), their total and mean pause, and the client's
TTFT p99 and out tok/s. Result lines go to --out; the table compares pause time per 1,000 requests.

    .venv/bin/python benchmarks/gc_pauses.py --device cpu --out /tmp/gc.jsonl          # ~4 min on 2 cores
    # GPU (vLLM 0.26 on PYTHONPATH, the synthetic Gemma): --device gpu --concurrency 256 --output-tokens 256
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import engine_side  # noqa: E402
import http_overhead as ho  # noqa: E402
from benchlib import ROOT  # noqa: E402

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
        return v if isinstance(v, str) else str(v) if isinstance(v, int) else benchlib.fmt_num(v)

    lines = ["| " + " | ".join(title for title, _ in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[key]) for _, key in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_profile_args(ap, "profile override (repeatable), applied to both gateways")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=400, help="per cell")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--input-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=4, help="short outputs: many requests, much allocation")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--loadtest-workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("gc_pauses.jsonl"))
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--deadline-s", type=float, default=900.0)
    a = ap.parse_args()
    t_end = time.monotonic() + a.deadline_s
    workdir = (a.workdir or Path(tempfile.mkdtemp(prefix="gc-pauses-"))).resolve()
    a.out = a.out.resolve()
    config = a.config or (benchlib.GPU_CONFIG if a.device == "gpu" else benchlib.CPU_CONFIG)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    servers: dict[str, Any] = {}
    recs: list[dict[str, Any]] = []
    try:
        for way, frozen in WAYS.items():  # one after the other: vLLM sizes its KV cache while it starts
            share = {"engine": {"gpu_memory_utilization": 0.3}} if a.device == "gpu" else {}
            settings, profile, _ = benchlib.gateway_profile(
                a, config, workdir / way, benchlib.deep_merge(share, {"server": {"freeze_gc_heap": frozen}}))
            servers[way], _ = ho.start_http_server("gateway", settings, profile, workdir / way, t_end)
            model = settings.served_model_name
        for rep in range(a.repeats):
            for way in (list(WAYS) if rep % 2 == 0 else list(reversed(WAYS))):
                server = servers[way]
                raw = workdir / f"{way}-r{rep}.json"
                before = gc_totals(server.base_url)
                cmd = ho.loadtest_cmd(server.base_url, model, a.concurrency, a.requests, a.concurrency,
                                      a.input_tokens, a.output_tokens, a.vocab_size, rep, raw,
                                      workers=a.loadtest_workers)
                with (workdir / f"{way}-loadtest.log").open("a") as log:
                    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=benchlib.clean_env(),
                                   timeout=max(1.0, t_end - time.monotonic()), check=True)
                after = gc_totals(server.base_url)
                run = json.loads(raw.read_text())["runs"][0]  # one parse: the file holds every request (MBs)
                summary = run["summary"]
                rec = ho.result_line(way, a.concurrency, summary, bench="gc_pauses", run_id=run_id, repeat=rep,
                                     device=a.device, freeze_gc_heap=WAYS[way],
                                     gc_full_collections=int(after.get("count", 0) - before.get("count", 0)),
                                     gc_pause_ms=round(1000 * (after.get("sum", 0) - before.get("sum", 0)), 2),
                                     **stream_gaps(run["requests"]))
                benchlib.append_jsonl(a.out, rec)
                recs.append(rec)
                print(f"[{way}] rep {rep}: {rec['completed']} requests, {rec['gc_full_collections']} full collections, "
                      f"{rec['gc_pause_ms']} ms paused, TTFT p99 {rec['ttft_p99_ms']} ms, longest token gap "
                      f"{rec['max_token_gap_ms']} ms, {rec['requests_with_stall']} requests with a gap >= "
                      f"{int(1000 * STALL_GAP_S)} ms", flush=True)
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        print(f"[gc] stopped: {str(exc)[:2000]}", flush=True)
    finally:
        for server in servers.values():
            server.stop(grace_s=30)
    for server in servers.values():
        startup = re.findall(r"startup heap frozen out of the garbage collector \((\d+) ms\)", server.log_tail(10**7))
        if startup:
            print(f"startup freeze (one full collection before freezing): {startup[-1]} ms", flush=True)
    print(table(summarize(recs)), flush=True)


if __name__ == "__main__":
    main()
