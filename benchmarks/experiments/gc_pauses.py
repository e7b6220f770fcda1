#!/usr/bin/env python3
"""Full garbage collections in the gateway, with the startup heap frozen or not, side by side.

`server.freeze_gc_heap` (server/gc_heap.py) freezes the heap the engine and its libraries leave
behind, as `vllm serve` does, so a full collection no longer walks ~600k objects on the event loop.
Two gateways on the same profile, the flag on and off, both up at once; each cell runs one
`loadtest` against one of them, the order rotating per repeat. Per cell: the full collections the
gateway timed (`gateway_gc_full_collection_seconds`), their total and mean pause, and the client's
TTFT p99 and out tok/s. Result lines go to --out; the table compares pause time per 1,000 requests.

    .venv/bin/python -m benchmarks.experiments.gc_pauses --device cpu --out /tmp/gc.jsonl          # ~4 min on 2 cores
    # GPU (vLLM 0.26 on PYTHONPATH, the synthetic Gemma): --device gpu --concurrency 256 --output-tokens 256
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from typing import Any

from benchmarks.lib import servers
from benchmarks.lib.driver import add_run_args, add_workload_args, start_run
from benchmarks.lib.gc_report import STALL_GAP_S, WAYS, gc_totals, stream_gaps, summarize, table
from benchmarks.lib.servers import ROOT
from benchmarks.lib.ways import loadtest_cmd, result_line, start_http_server

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override (repeatable), applied to both gateways")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=400, help="per cell")
    ap.add_argument("--repeats", type=int, default=2)
    add_workload_args(ap, input_tokens=32, output_tokens=4, output_help="short outputs: many requests, much allocation",
                      seed=False)
    ap.add_argument("--loadtest-workers", type=int, default=2)
    add_run_args(ap, out="gc_pauses.jsonl", deadline_s=900.0, label=False, doc=False)
    a = ap.parse_args()
    run = start_run(a, "gc-pauses")
    t_end, workdir = run.t_end, run.workdir
    config = a.config or (servers.GPU_CONFIG if a.device == "gpu" else servers.CPU_CONFIG)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    gateways: dict[str, Any] = {}
    recs: list[dict[str, Any]] = []
    try:
        for way, frozen in WAYS.items():  # one after the other: vLLM sizes its KV cache while it starts
            share = {"engine": {"gpu_memory_utilization": 0.3}} if a.device == "gpu" else {}
            settings, profile, _ = servers.gateway_profile(
                a, config, workdir / way, servers.deep_merge(share, {"server": {"freeze_gc_heap": frozen}}))
            gateways[way], _ = start_http_server("gateway", settings, profile, workdir / way, t_end)
            model = settings.served_model_name
        for rep in range(a.repeats):
            for way in (list(WAYS) if rep % 2 == 0 else list(reversed(WAYS))):
                server = gateways[way]
                raw = workdir / f"{way}-r{rep}.json"
                before = gc_totals(server.base_url)
                cmd = loadtest_cmd(server.base_url, model, a.concurrency, a.requests, a.concurrency,
                                      a.input_tokens, a.output_tokens, a.vocab_size, rep, raw,
                                      workers=a.loadtest_workers)
                with (workdir / f"{way}-loadtest.log").open("a") as log:
                    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=servers.clean_env(),
                                   timeout=max(1.0, t_end - time.monotonic()), check=True)
                after = gc_totals(server.base_url)
                run = json.loads(raw.read_text())["runs"][0]  # one parse: the file holds every request (MBs)
                summary = run["summary"]
                rec = result_line(way, a.concurrency, summary, bench="gc_pauses", run_id=run_id, repeat=rep,
                                     device=a.device, freeze_gc_heap=WAYS[way],
                                     gc_full_collections=int(after.get("count", 0) - before.get("count", 0)),
                                     gc_pause_ms=round(1000 * (after.get("sum", 0) - before.get("sum", 0)), 2),
                                     **stream_gaps(run["requests"]))
                servers.append_jsonl(a.out, rec)
                recs.append(rec)
                print(f"[{way}] rep {rep}: {rec['completed']} requests, {rec['gc_full_collections']} full collections, "
                      f"{rec['gc_pause_ms']} ms paused, TTFT p99 {rec['ttft_p99_ms']} ms, longest token gap "
                      f"{rec['max_token_gap_ms']} ms, {rec['requests_with_stall']} requests with a gap >= "
                      f"{int(1000 * STALL_GAP_S)} ms", flush=True)
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as exc:
        print(f"[gc] stopped: {str(exc)[:2000]}", flush=True)
    finally:
        for server in gateways.values():
            server.stop(grace_s=30)
    for server in gateways.values():
        startup = re.findall(r"startup heap frozen out of the garbage collector \((\d+) ms\)", server.log_tail(10**7))
        if startup:
            print(f"startup freeze (one full collection before freezing): {startup[-1]} ms", flush=True)
    print(table(summarize(recs)), flush=True)


if __name__ == "__main__":
    main()
