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

    # GPU, one device call (vLLM 0.26 on PYTHONPATH): benchmarks/gpu/part2.sh with INTERLEAVED=1
    python3 benchmarks/http_interleaved.py --repeats 3 --loadtest-workers 4 --deadline-s 540 --out $OUT/i.jsonl
    # GPU, text prompts at c = 64 (benchmarks/gpu/part2.sh with TEXT=1 INTERLEAVED=1 WAYS=gateway,vllm ...)
    python3 benchmarks/http_interleaved.py --text-prompts --ways gateway,vllm --concurrency 64 --input-tokens 4096 \\
        --output-tokens 16 --out $OUT/t.jsonl
    # G0 of docs/design/multi-frontend.md: `vllm serve` with 1, 2 and 4 API servers beside in-process
    INTERLEAVED=1 WAYS=inproc,vllm,vllm2,vllm4 CONCURRENCY=256 WORKERS=8 EXTRA=--no-client-check \\
        bash benchmarks/gpu/part2.sh
    # CPU smoke with the embedded model
    .venv/bin/python benchmarks/http_interleaved.py --device cpu --concurrency 1,2 --repeats 2 \\
        --requests 4 --input-tokens 32 --output-tokens 8 --out /tmp/i.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
import http_overhead as ho  # noqa: E402
from benchlib import ROOT  # noqa: E402

CLIENT_CHECK_LIMIT = 0.03  # doubling the client processes may move the total by less than this


class InprocCells:
    """The in-process way's child, kept up and fed one cell at a time."""

    def __init__(self, a: argparse.Namespace, profile: Path, workdir: Path, t_end: float, meta: dict[str, Any]):
        env = benchlib.clean_env({"VLLM_RPC_BASE_PATH": str(benchlib.rpc_dir(workdir, "inproc-run")),
                                  "TMPDIR": str(workdir / "inproc-tmp")})
        for key in ("VLLM_RPC_BASE_PATH", "TMPDIR"):
            Path(env[key]).mkdir(parents=True, exist_ok=True)
        env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
        cmd = [sys.executable, str(Path(ho.__file__).resolve()), "--child-inproc", "--cells-stdin",
               "--profile", str(profile), "--out", str(a.out), "--input-tokens", str(a.input_tokens),
               "--output-tokens", str(a.output_tokens), "--vocab-size", str(a.vocab_size), "--seed", str(a.seed),
               "--deadline-at", str(time.time() + (t_end - time.monotonic())), "--min-left-s", "0",
               "--meta", json.dumps(meta), "--cell-output-tokens", str(a.cell_output_tokens)] + (
                   ["--requests", str(a.requests)] if a.requests else [])
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
        return self._until(ho.CELL_DONE)

    def stop(self) -> None:
        benchlib.stop_group(self.proc, grace_s=1)
        self.log.close()


def memory_share(engines: int) -> float:
    """Each engine's `gpu_memory_utilization` with `engines` up at once on one GPU: 0.3 for up to
    three (the share every earlier interleaved run used), less beyond, so that all fit in 0.9."""
    return min(0.3, int(90 / max(1, engines)) / 100)


SIDE_FIELDS = ("tpot_p50_ms", "engine_itl_ms", "engine_tokens_per_step", "engine_prefill_ms", "engine_queue_ms",
               "frontend_cpu_cores", "engine_cpu_cores", "client_cpu_cores", "host_cpu_busy_pct")


def _median(rs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def side_table(rows: list[dict[str, Any]]) -> str:
    """The engine core's own timing and the CPU per cell (engine_side.py), medians over the repeats:
    a client TPOT above the engine's per-token interval is frontend delay; an engine interval that
    grows with the frontend's work is the engine core slowed beside it."""
    f = benchlib.fmt_num
    out = ["| concurrency | way | client TPOT p50 ms | engine per-token interval ms | engine tokens per step "
           "| engine prefill ms | engine queue ms | frontend CPU cores | engine CPU cores | client CPU cores "
           "| host CPU busy % |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = " | ".join(f(r.get(f"{k}_median")) for k in SIDE_FIELDS)
        out.append(f"| {r['concurrency']} | {ho.way_label(r['way'])} | {cells} |")
    return "\n".join(out)


def summarize(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and spread per (way, concurrency) over the repeats; ratios of medians."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("bench") == "http_overhead" and not r.get("client_check"):
            cells.setdefault((r["way"], r["concurrency"]), []).append(r)
    rows = []
    for (way, c), rs in sorted(cells.items(), key=lambda kv: (kv[0][1], ho.way_order(kv[0][0]))):
        tok = [r["output_token_throughput"] for r in rs]
        ttft = [r["ttft_p50_ms"] for r in rs if r["ttft_p50_ms"] is not None]
        ttft99 = [r["ttft_p99_ms"] for r in rs if r.get("ttft_p99_ms") is not None]
        chars = [r["output_chars_per_token"] for r in rs if r.get("output_chars_per_token") is not None]
        rows.append({"way": way, "concurrency": c, "repeats": len(rs), "out_tok_s_median": round(statistics.median(tok), 1),
                     "out_tok_s_min": round(min(tok), 1), "out_tok_s_max": round(max(tok), 1),
                     "ttft_p50_ms_median": round(statistics.median(ttft), 2) if ttft else None,
                     "ttft_p50_ms_min": min(ttft) if ttft else None, "ttft_p50_ms_max": max(ttft) if ttft else None,
                     "ttft_p99_ms_median": round(statistics.median(ttft99), 2) if ttft99 else None,
                     "ttft_p99_ms_min": min(ttft99) if ttft99 else None,
                     "ttft_p99_ms_max": max(ttft99) if ttft99 else None,
                     "failed": sum(r["failed"] or 0 for r in rs),
                     "output_chars_per_token": round(statistics.median(chars), 2) if chars else None,
                     **{f"{k}_median": _median(rs, k) for k in SIDE_FIELDS}})
    by = {(r["way"], r["concurrency"]): r for r in rows}
    for r in rows:
        for ref in ("inproc", "vllm"):
            base = by.get((ref, r["concurrency"]))
            if base and r["way"] != ref:
                r[f"vs_{ref}"] = ho.ratio(r["out_tok_s_median"], base["out_tok_s_median"])
    return rows


def client_verdict(change: float) -> str:
    """What doubling the client processes says: a gain means the client was the bottleneck; a loss
    (seen on the H200: -39% to -44% at c = 32) means noise or clients taking CPU from the servers."""
    if abs(change) < CLIENT_CHECK_LIMIT:
        return "enough clients"
    if change > 0:
        return "THE CLIENT LIMITS THIS RUN"
    return "SLOWER WITH MORE CLIENTS: noise or CPU contention, not settled"


def table(rows: list[dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    f = benchlib.fmt_num
    out = ["| concurrency | way | repeats | out tok/s median (min-max) | TTFT p50 median ms (min-max) "
           "| TTFT p99 median ms (min-max) | vs in-process | vs vllm serve | failed | text chars per token |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['concurrency']} | {ho.way_label(r['way'])} | {r['repeats']} | {f(r['out_tok_s_median'])} "
                   f"({f(r['out_tok_s_min'])}-{f(r['out_tok_s_max'])}) | {f(r['ttft_p50_ms_median'])} "
                   f"({f(r.get('ttft_p50_ms_min'))}-{f(r.get('ttft_p50_ms_max'))}) | {f(r.get('ttft_p99_ms_median'))} "
                   f"({f(r.get('ttft_p99_ms_min'))}-{f(r.get('ttft_p99_ms_max'))}) | "
                   f"{f(r.get('vs_inproc'))} | {f(r.get('vs_vllm'))} | {r['failed']} "
                   f"| {f(r.get('output_chars_per_token'))} |")
    for ck in checks:
        out.append(f"\nClient check, {ck['way']} at c = {ck['concurrency']}: {ck['workers']} -> {ck['workers_doubled']} "
                   f"processes moved out tok/s by {ck['change'] * 100:+.1f}% "
                   f"({client_verdict(ck['change'])}).")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchlib.add_profile_args(ap, "profile override (repeatable); default on gpu: engine.gpu_memory_utilization=0.3 "
                            "(0.9 / engines beyond three)")
    ap.add_argument("--ways", default=",".join(ho.WAYS), help="which ways (also vllmN: vllm serve "
                    "--api-server-count N, experiment G0 of docs/design/multi-frontend.md)")
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--cell-output-tokens", type=int, default=0,
                    help="without --requests: at least this many output tokens per cell (more requests)")
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loadtest-workers", type=int, default=4)
    ap.add_argument("--no-client-check", action="store_true")
    ap.add_argument("--text-prompts", action="store_true", help="text prompts of exactly --input-tokens tokens "
                    "(the model's tokenizer), tokenized by each server; HTTP ways only")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=Path("http_interleaved.jsonl"))
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--doc", type=Path, default=None)
    a = ap.parse_args()
    t_end = time.monotonic() + a.deadline_s
    workdir = (a.workdir or Path(tempfile.mkdtemp(prefix="http-interleaved-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    a.out = a.out.resolve()
    gpu = a.device == "gpu"
    config = a.config or (benchlib.GPU_CONFIG if gpu else benchlib.CPU_CONFIG)
    ways = ho.parse_ways(a.ways)
    if a.text_prompts and "inproc" in ways:
        print("[interleaved] --text-prompts: the in-process way is left out (no HTTP tokenization step)", flush=True)
        ways.remove("inproc")
    share = {"engine": {"gpu_memory_utilization": memory_share(len(ways))}} if gpu else {}
    settings, profile, overrides = benchlib.gateway_profile(a, config, workdir, share)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    meta = {"run_id": run_id, "label": a.label or f"{a.device} interleaved", "device": a.device,
            "overrides": overrides.get("engine", {}), "input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
            "vocab_size": a.vocab_size, "interleaved": True,
            "prompts": "text (loadtest --text-prompts --tokenizer MODEL_DIR)" if a.text_prompts else "token ids"}
    if a.text_prompts:
        a.text_tokenizer = str(settings.model_path())  # the tokenizer every server loads: exact lengths
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    servers: dict[str, Any] = {}
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
            servers[way], start_s = ho.start_http_server(way, settings, profile, workdir, t_end)
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
                        ho.http_cell(way, servers[way], c, a, settings.served_model_name, workdir, t_end, meta, rep=rep)
        if not a.no_client_check:
            c = max(concurrencies)
            if ho.client_workers(c, 2 * a.loadtest_workers) == ho.client_workers(c, a.loadtest_workers):
                servers_to_check: dict[str, Any] = {}  # already one client process per request in flight
                print(f"[interleaved] client check skipped: c = {c} has no room for more client processes", flush=True)
            else:
                servers_to_check = servers
            for way in servers_to_check:
                base = [r for r in benchlib.load_jsonl([a.out]) if r.get("run_id") == run_id and r["way"] == way
                        and r["concurrency"] == c and not r.get("client_check")]
                doubled = ho.http_cell(way, servers[way], c, a, settings.served_model_name, workdir, t_end,
                                       {**meta, "client_check": True}, rep=a.repeats,
                                       workers=2 * a.loadtest_workers)
                if base and doubled:
                    median = statistics.median(r["output_token_throughput"] for r in base)
                    checks.append({"way": way, "concurrency": c, "workers": ho.client_workers(c, a.loadtest_workers),
                                   "workers_doubled": doubled["loadtest_workers"],
                                   "change": round(doubled["output_token_throughput"] / median - 1, 4)})
    except (RuntimeError, TimeoutError) as exc:
        print(f"[interleaved] stopped: {str(exc)[:2000]}", flush=True)
    finally:
        if inproc is not None:
            inproc.stop()
        for server in servers.values():
            server.stop(grace_s=30)
    recs = [r for r in benchlib.load_jsonl([a.out]) if r.get("run_id") == run_id]
    rows = summarize(recs)
    print(table(rows, checks), flush=True)
    print("\nEngine side and CPU per cell (medians; engine_side.py):\n" + side_table(rows), flush=True)
    if a.doc:
        doc_meta = {"label": meta["label"], "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                    "loadavg_at_end": list(os.getloadavg()), "summary": rows, "client_checks": checks}
        print(f"wrote {benchlib.write_doc(a.doc, doc_meta, recs)}", flush=True)


if __name__ == "__main__":
    main()
