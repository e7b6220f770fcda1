#!/usr/bin/env python3
"""What the HTTP layer costs (issue 9, part 2): one engine profile served three ways, one after
another on the same machine, each in a fresh process tree with the same engine settings:

- `inproc`:  vLLM's AsyncLLM in a child process, no HTTP: the same closed loop as `loadtest`
             (c workers, streaming DELTA outputs, same prompts, same sampling), timed per request;
- `gateway`: `python -m server serve` on loopback, driven by `python -m loadtest run`;
- `vllm`:    `vllm serve` (python -m vllm.entrypoints.openai.api_server) with the engine flags
             the gateway passes to AsyncEngineArgs, driven by the *identical* loadtest command;
- `vllmN`:   the same with `--api-server-count N` (N API-server processes on one engine core:
             experiment G0 of docs/design/multi-frontend.md, e.g. `--ways vllm,vllm2,vllm4`).

All three start from one effective profile (--config plus the benchmark's overrides, written to
WORKDIR/profile.yaml): the gateway reads that file, the other two get `engine_args_kwargs()` of
it. Prompts are random token ids (exact lengths, `loadtest --vocab-size`, the same seed per
concurrency in every way), outputs have a fixed length (`ignore_eos`), temperature 0, streaming.
On the GPU the model is Gemma 4 E2B's text config with dummy weights plus a synthetic byte-level
tokenizer (benchmarks/fixtures/synth_tokenizer.py): the gateway needs a tokenizer (it cannot start with
`skip_tokenizer_init`), so every way detokenizes, as a real deployment does.

One JSON line per (way, concurrency) is appended to --out as soon as it is measured; a deadline
stops the run before the device's 10-minute limit.

    # GPU (vLLM 0.26 on PYTHONPATH, see benchmarks/device/http-ways.sh)
    python3 -m benchmarks.http_overhead --deadline-s 540 --out $OUT/part2.jsonl --workdir $OUT/work
    # CPU smoke with the embedded model
    .venv/bin/python -m benchmarks.http_overhead --device cpu --concurrency 1,4 --requests 8 \
        --input-tokens 64 --output-tokens 16 --out /tmp/smoke.jsonl
    # a markdown table (and the goal check) from result files
    python3 -m benchmarks.http_overhead --table benchmarks/results/2026-11-29-cpu-http-overhead-smoke.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import servers
from benchmarks.lib.driver import add_run_args, add_workload_args, start_run
from benchmarks.lib.gpu import wait_gpu_free
from benchmarks.lib.servers import ROOT
from benchmarks.lib.ways import WAYS, goal_check, http_cell, inproc_child_cmd, parse_ways, start_http_server, table


def run_http_way(way: str, a: argparse.Namespace, settings, profile: Path, workdir: Path,  # noqa: ANN001
                 t_end: float, meta: dict[str, Any]) -> None:
    try:
        server, start_s = start_http_server(way, settings, profile, workdir, t_end)
    except (RuntimeError, TimeoutError) as exc:
        print(f"[{way}] failed: {str(exc)[:3000]}", flush=True)
        return
    try:
        for c in [int(x) for x in a.concurrency.split(",")]:
            left = t_end - time.monotonic()
            if left < a.min_left_s / 4:
                print(f"[{way}] c={c} skipped: {left:.0f}s left", flush=True)
                break
            http_cell(way, server, c, a, settings.served_model_name, workdir, t_end,
                      {**meta, "engine_start_s": round(start_s, 1)})
    finally:
        server.stop(grace_s=30)
        if a.device == "gpu":
            wait_gpu_free()


def run_inproc_way(a: argparse.Namespace, profile: Path, workdir: Path, t_end: float, meta: dict[str, Any]) -> None:
    cmd, env = inproc_child_cmd(a, profile, workdir, t_end, meta, a.min_left_s, concurrency=a.concurrency)
    log = workdir / "inproc.log"
    print("[inproc] starting the AsyncLLM child", flush=True)
    with log.open("ab") as lf:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=max(1.0, t_end - time.monotonic()))
    except subprocess.TimeoutExpired:
        rc = "deadline"
    servers.stop_group(proc, grace_s=1)
    if a.device == "gpu":
        wait_gpu_free()
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("[inproc]") or "Error" in line[:200]:
            print(line[:400], flush=True)
    print(f"[inproc] exit {rc}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override, e.g. engine.max_num_seqs=256 (repeatable)")
    ap.add_argument("--ways", default=",".join(WAYS), help="which ways, in order (also vllmN: "
                    "vllm serve --api-server-count N)")
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 2 x concurrency, >= 16)")
    ap.add_argument("--cell-output-tokens", type=int, default=0,
                    help="without --requests: at least this many output tokens per run (more requests)")
    add_workload_args(ap)
    ap.add_argument("--loadtest-workers", type=int, default=1,
                    help="loadtest client processes per HTTP run (loadtest --workers; capped at the "
                         "concurrency): one Python client is itself the bottleneck at c = 256")
    ap.add_argument("--run-id", default=None, help="tag of this run's lines (several invocations, e.g. one "
                    "way each, can share one; --doc collects the lines with this tag)")
    add_run_args(ap, out="http_overhead.jsonl", deadline_s=540.0, doc=False)
    ap.add_argument("--min-left-s", type=float, default=90.0, help="do not start a way with less left")
    ap.add_argument("--doc", type=Path, default=None,
                    help="also write {meta, results} of this run's lines here (for benchmarks/results/)")
    ap.add_argument("--table", nargs="*", type=Path, help="print the table from result files and exit")
    a = ap.parse_args()

    if a.table is not None:
        print(table(servers.load_jsonl(a.table)))
        return
    ways = parse_ways(a.ways)
    run = start_run(a, "http-overhead")
    t_end, workdir = run.t_end, run.workdir
    config = a.config or (servers.GPU_CONFIG if a.device == "gpu" else servers.CPU_CONFIG)
    settings, profile, overrides = servers.gateway_profile(a, config, workdir)
    from server.engine import engine_args_kwargs

    meta = {"run_id": a.run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", "label": a.label or f"{a.device} run", "device": a.device, "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
            "overrides": overrides.get("engine", {}), "input_tokens": a.input_tokens,
            "output_tokens": a.output_tokens, "vocab_size": a.vocab_size,
            "prompts": "token ids (loadtest --vocab-size), same seed per concurrency in every way",
            "tokenizer": "synthetic byte-level BPE (synth_tokenizer.py)" if a.device == "gpu" else "model's own",
            "engine_args": {k: v for k, v in engine_args_kwargs(settings).items() if k != "model"}}
    print(f"profile {profile} (from {config}); workdir {workdir}; out {a.out}", flush=True)
    for way in ways:
        left = t_end - time.monotonic()
        if left < a.min_left_s:
            print(f"[{way}] skipped: {left:.0f}s left", flush=True)
            continue
        t = time.monotonic()
        if way == "inproc":
            run_inproc_way(a, profile, workdir, t_end, meta)
        else:
            run_http_way(way, a, settings, profile, workdir, t_end, meta)
        print(f"[{way}] done after {time.monotonic() - t:.0f}s", flush=True)
    recs = servers.load_jsonl([a.out])
    print(table(recs), flush=True)
    if a.doc:
        mine = [r for r in recs if r.get("run_id") == meta["run_id"]]
        doc_meta = {"label": meta["label"], "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                    "loadavg_at_end": list(os.getloadavg()), "goal_check": goal_check(mine)}
        print(f"wrote {servers.write_doc(a.doc, doc_meta, mine)}", flush=True)


if __name__ == "__main__":
    main()
