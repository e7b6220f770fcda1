#!/usr/bin/env python3
"""Gateway vs in-process vs `vllm serve`, every engine up at once, cells interleaved (issue 14).

http_overhead.py runs the ways one after another, so drift between them (tens of percent between
H200 runs) lands in the ratios. Here the three engines start once, side by side on one device
(`engine.gpu_memory_utilization` 0.3 each on the GPU, less with more than three engines; only the
way being measured has work), and
each (concurrency, repeat) cell runs every way in turn, the order rotating, so the ways share the
machine's drift. Same profile, prompts (seed per concurrency and repeat), loadtest command and
result lines as http_overhead.py (its `inproc` child reads cells from stdin).

Then the client check (issue 14, goal 0): at the largest concurrency each HTTP way runs once more
with twice the load-client processes; if the total moves by 3% or more, the client was a
bottleneck and the run says so.

Reported: per (way, concurrency) the median out tok/s, TTFT p50 and TTFT p99 over the repeats
with the spread, the ratios of medians to in-process and to `vllm serve`, and the goal check.

`--text-prompts` (issue 14, goal 4): text prompts that the model's tokenizer encodes to exactly
--input-tokens ids (loadtest `--text-prompts --tokenizer MODEL_DIR`), the same texts for every HTTP
way, so each server tokenizes while it streams to the others. HTTP ways only: the in-process way
has no HTTP tokenization step to compare and is left out.

    # GPU, one device call (vLLM 0.26 on PYTHONPATH): benchmarks/device/http-ways.sh with INTERLEAVED=1
    python3 -m benchmarks.http_interleaved --repeats 3 --loadtest-workers 4 --deadline-s 540 --out $OUT/i.jsonl
    # GPU, text prompts at c = 64 (benchmarks/device/http-ways.sh with TEXT=1 INTERLEAVED=1 WAYS=gateway,vllm ...)
    python3 -m benchmarks.http_interleaved --text-prompts --ways gateway,vllm --concurrency 64 --input-tokens 4096 \\
        --output-tokens 16 --out $OUT/t.jsonl
    # G0 of docs/design/multi-frontend.md: `vllm serve` with 1, 2 and 4 API servers beside in-process
    INTERLEAVED=1 WAYS=inproc,vllm,vllm2,vllm4 CONCURRENCY=256 WORKERS=8 EXTRA=--no-client-check \\
        bash benchmarks/device/http-ways.sh
    # CPU smoke with the embedded model
    .venv/bin/python -m benchmarks.http_interleaved --device cpu --concurrency 1,2 --repeats 2 \\
        --requests 4 --input-tokens 32 --output-tokens 8 --out /tmp/i.jsonl
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import servers
from benchmarks.lib.driver import add_run_args, add_workload_args, start_run
from benchmarks.lib.interleaved_report import memory_share, side_table, summarize, table
from benchmarks.lib.servers import ROOT
from benchmarks.lib.ways import (CELL_DONE, WAYS, client_workers, http_cell, inproc_child_cmd, parse_ways,
                                 start_http_server)


class InprocCells:
    """The in-process way's child, kept up and fed one cell at a time."""

    def __init__(self, a: argparse.Namespace, profile: Path, workdir: Path, t_end: float, meta: dict[str, Any]):
        cmd, env = inproc_child_cmd(a, profile, workdir, t_end, meta, 0)
        self.log = (workdir / "inproc.log").open("a")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)

    def _until(self, marker: str) -> bool:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith("[inproc]"):
                print(line.rstrip()[:400], flush=True)
            if line.startswith(marker):
                return True
        return False  # the child exited

    def ready(self) -> bool:
        return self._until("[inproc] engine up")

    def cell(self, c: int, rep: int) -> bool:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{c} {rep}\n")
        self.proc.stdin.flush()
        return self._until(CELL_DONE)

    def stop(self) -> None:
        servers.stop_group(self.proc, grace_s=1)
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override (repeatable); default on gpu: engine.gpu_memory_utilization=0.3 "
                            "(0.9 / engines beyond three)")
    ap.add_argument("--ways", default=",".join(WAYS), help="which ways (also vllmN: vllm serve "
                    "--api-server-count N, experiment G0 of docs/design/multi-frontend.md)")
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--cell-output-tokens", type=int, default=0,
                    help="without --requests: at least this many output tokens per cell (more requests)")
    add_workload_args(ap)
    ap.add_argument("--loadtest-workers", type=int, default=4)
    ap.add_argument("--no-client-check", action="store_true")
    ap.add_argument("--text-prompts", action="store_true", help="text prompts of exactly --input-tokens tokens "
                    "(the model's tokenizer), tokenized by each server; HTTP ways only")
    add_run_args(ap, out="http_interleaved.jsonl", deadline_s=540.0)
    a = ap.parse_args()
    run = start_run(a, "http-interleaved")
    t_end, workdir = run.t_end, run.workdir
    gpu = a.device == "gpu"
    config = a.config or (servers.GPU_CONFIG if gpu else servers.CPU_CONFIG)
    ways = parse_ways(a.ways)
    if a.text_prompts and "inproc" in ways:
        print("[interleaved] --text-prompts: the in-process way is left out (no HTTP tokenization step)", flush=True)
        ways.remove("inproc")
    share = {"engine": {"gpu_memory_utilization": memory_share(len(ways))}} if gpu else {}
    settings, profile, overrides = servers.gateway_profile(a, config, workdir, share)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    meta = {"run_id": run_id, "label": a.label or f"{a.device} interleaved", "device": a.device,
            "overrides": overrides.get("engine", {}), "input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
            "vocab_size": a.vocab_size, "interleaved": True,
            "prompts": "text (loadtest --text-prompts --tokenizer MODEL_DIR)" if a.text_prompts else "token ids"}
    if a.text_prompts:
        a.text_tokenizer = str(settings.model_path())  # the tokenizer every server loads: exact lengths
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    http_servers: dict[str, Any] = {}
    inproc: InprocCells | None = None
    checks: list[dict[str, Any]] = []
    try:
        # One engine at a time: vLLM sizes its KV cache from the memory it sees change while it
        # profiles, so an engine starting beside another got none on the H200 (-0.55 GiB at 0.3).
        if "inproc" in ways:
            inproc = InprocCells(a, profile, workdir, t_end, meta)
            if not inproc.ready():
                raise RuntimeError("the in-process engine did not start (see inproc.log)")
        for way in (w for w in ways if w != "inproc"):
            http_servers[way], start_s = start_http_server(way, settings, profile, workdir, t_end)
            meta[f"{way}_start_s"] = round(start_s, 1)
        turn = 0
        for rep in range(a.repeats):
            for c in concurrencies:
                order = ways[turn % len(ways):] + ways[:turn % len(ways)]
                turn += 1
                for way in order:
                    if time.monotonic() > t_end - 30:
                        raise TimeoutError("deadline")
                    if way == "inproc":
                        assert inproc is not None
                        if not inproc.cell(c, rep):
                            raise RuntimeError("the in-process child exited")
                    else:
                        http_cell(way, http_servers[way], c, a, settings.served_model_name, workdir, t_end, meta, rep=rep)
        if not a.no_client_check:
            c = max(concurrencies)
            if client_workers(c, 2 * a.loadtest_workers) == client_workers(c, a.loadtest_workers):
                servers_to_check: dict[str, Any] = {}  # already one client process per request in flight
                print(f"[interleaved] client check skipped: c = {c} has no room for more client processes", flush=True)
            else:
                servers_to_check = http_servers
            for way in servers_to_check:
                base = [r for r in servers.load_jsonl([a.out]) if r.get("run_id") == run_id and r["way"] == way
                        and r["concurrency"] == c and not r.get("client_check")]
                doubled = http_cell(way, http_servers[way], c, a, settings.served_model_name, workdir, t_end,
                                       {**meta, "client_check": True}, rep=a.repeats,
                                       workers=2 * a.loadtest_workers)
                if base and doubled:
                    median = statistics.median(r["output_token_throughput"] for r in base)
                    checks.append({"way": way, "concurrency": c, "workers": client_workers(c, a.loadtest_workers),
                                   "workers_doubled": doubled["loadtest_workers"],
                                   "change": round(doubled["output_token_throughput"] / median - 1, 4)})
    except (RuntimeError, TimeoutError) as exc:
        print(f"[interleaved] stopped: {str(exc)[:2000]}", flush=True)
    finally:
        if inproc is not None:
            inproc.stop()
        for server in http_servers.values():
            server.stop(grace_s=30)
    recs = [r for r in servers.load_jsonl([a.out]) if r.get("run_id") == run_id]
    rows = summarize(recs)
    print(table(rows, checks), flush=True)
    print("\nEngine side and CPU per cell (medians; lib/engine_side.py):\n" + side_table(rows), flush=True)
    if a.doc:
        doc_meta = {"label": meta["label"], "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                    "loadavg_at_end": list(os.getloadavg()), "summary": rows, "client_checks": checks}
        print(f"wrote {servers.write_doc(a.doc, doc_meta, recs)}", flush=True)


if __name__ == "__main__":
    main()
