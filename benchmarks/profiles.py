#!/usr/bin/env python3
"""Engine-profile benchmark for Gemma 4 E2B on one GPU (issue 9, part 1).

Each profile runs in a fresh subprocess with vLLM's offline `LLM` class (a new engine per
profile), `load_format="dummy"` on the Gemma 4 E2B text config in benchmarks/fixtures/models/ (real
shapes, random weights), no tokenizer (`skip_tokenizer_init=True`, token-id prompts) and
`detokenize=False`. Every workload is warmed up on the same shapes with *different* random
prompts, then timed on fresh random prompts (token ids in [0, 262144)), so prefix caching never
hits. `ignore_eos=True` makes every request produce exactly `max_tokens` tokens. `--repeats N` times
each workload N times (fresh prompts each), and the table shows the median with its min-max.

One JSON line per (profile, workload, repeat) is appended to --out as soon as it is measured, so a
run stopped at its deadline still returns data; a summary table is printed at the end.

    # on the GPU machine (vLLM 0.26.0 on PYTHONPATH)
    python3 -m benchmarks.profiles --out $OUT/results.jsonl --deadline-s 560 \
        --profiles defaults,no_prefix_cache,fast_prefill,fast_prefill_eager
    # the same profiles up at once, cells interleaved (the machine's drift falls on all alike)
    python3 -m benchmarks.profiles --interleave --repeats 3 --out $OUT/results.jsonl \
        --profiles defaults,defaults_full_decode_only --trace-profiles defaults
    # here, without vLLM: exercise the driver with a fake engine
    python3 -m benchmarks.profiles --dry-run --out /tmp/dry.jsonl
    # a table from one or more result files
    python3 -m benchmarks.profiles --table benchmarks/results/2026-11-29-h200-profiles.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from benchmarks.fixtures import GEMMA_CONFIG_DIR as MODEL_DIR
from benchmarks.lib.gpu import gpu_total_gib, wait_gpu_free
from benchmarks.lib.profiles_report import WORKLOADS, load, table

VOCAB = 262144

# Base = what `vllm serve` picks on a 141 GB Hopper GPU (configs/gemma4-e2b-h200-vllm-defaults.yaml):
# max_num_seqs 1024, max_num_batched_tokens 8192, prefix caching on, fast prefill off, graphs on.
BASE = {
    "max_num_seqs": 1024,
    "max_num_batched_tokens": 8192,
    "enable_prefix_caching": True,
    "kv_sharing_fast_prefill": False,
    "enforce_eager": False,
}


def _p(**kw):
    d = dict(BASE)
    d.update(kw)
    return d


NOPC = {"enable_prefix_caching": False}
FP = {"enable_prefix_caching": False, "kv_sharing_fast_prefill": True}

PROFILES: dict[str, dict] = {
    "defaults": _p(),
    "no_prefix_cache": _p(**NOPC),
    "fast_prefill": _p(**FP),
    "fast_prefill_eager": _p(**FP, enforce_eager=True),
    # the profile shipped before this benchmark (configs/gemma4-e2b-h200.yaml @ 5983717)
    "fast_prefill_512_16k": _p(**FP, max_num_seqs=512, max_num_batched_tokens=16384),
    "fast_prefill_16k": _p(**FP, max_num_batched_tokens=16384),
    "fast_prefill_32k": _p(**FP, max_num_batched_tokens=32768),
    "fast_prefill_256_16k": _p(**FP, max_num_seqs=256, max_num_batched_tokens=16384),
    "fast_prefill_no_async": _p(**FP, async_scheduling=False),
    "fast_prefill_async": _p(**FP, async_scheduling=True),
    "fast_prefill_piecewise": _p(**FP, compilation_config={"cudagraph_mode": "PIECEWISE"}),
    "fast_prefill_16k_capture1024": _p(
        **FP, max_num_batched_tokens=16384, compilation_config={"max_cudagraph_capture_size": 1024}
    ),
    "no_prefix_cache_16k": _p(**NOPC, max_num_batched_tokens=16384),
    "no_prefix_cache_32k": _p(**NOPC, max_num_batched_tokens=32768),
    "no_prefix_cache_async": _p(**NOPC, async_scheduling=True),
    "no_prefix_cache_no_async": _p(**NOPC, async_scheduling=False),
    "no_prefix_cache_eager": _p(**NOPC, enforce_eager=True),
    # issue 14, goal 6: does Model Runner V2 (no fast prefill) with a large token budget keep the
    # defaults' decode and reach fast prefill's 4K prefill, and at which max_num_seqs
    "no_prefix_cache_32k_256seqs": _p(**NOPC, max_num_seqs=256, max_num_batched_tokens=32768),
    "no_prefix_cache_32k_512seqs": _p(**NOPC, max_num_seqs=512, max_num_batched_tokens=32768),
    "no_prefix_cache_32k_no_async": _p(**NOPC, max_num_batched_tokens=32768, async_scheduling=False),
    # issue 37: the engine's own flags on both shipped profiles (the decode profile is vLLM's
    # defaults, the prefill profile fast_prefill_32k). FP8 weights are vLLM's online dynamic
    # quantization of the bf16 checkpoint; the FP8 KV cache is e4m3 with unit scales.
    "defaults_fp8": _p(quantization="fp8"),
    "defaults_fp8kv": _p(kv_cache_dtype="fp8"),
    "defaults_fp8_fp8kv": _p(quantization="fp8", kv_cache_dtype="fp8"),
    "defaults_full_decode_only": _p(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "defaults_piecewise": _p(compilation_config={"cudagraph_mode": "PIECEWISE"}),
    "defaults_fp8_full_decode_only": _p(quantization="fp8", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}),
    "defaults_no_async": _p(async_scheduling=False),
    "fast_prefill_32k_fp8": _p(**FP, max_num_batched_tokens=32768, quantization="fp8"),
    "fast_prefill_32k_fp8_fp8kv": _p(**FP, max_num_batched_tokens=32768, quantization="fp8", kv_cache_dtype="fp8"),
    "fast_prefill_32k_full_decode_only": _p(
        **FP, max_num_batched_tokens=32768, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}
    ),
}

COMMON = {
    "dtype": "bfloat16",
    "max_model_len": 32768,
    "gpu_memory_utilization": 0.90,
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "seed": 0,
    "disable_log_stats": True,
}


def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]


# --------------------------------------------------------------------------------- child
def build(name: str, spec: dict, model: str, dry: bool, trace_dir: Path | None = None,
          share: dict | None = None):
    """The offline engine for one profile: (llm, run, info, start_s). `run(prompts, out_tokens)` times
    one generate call. `share` overrides the memory settings (several engines on the GPU at once)."""
    t0 = time.perf_counter()
    info: dict = {}
    llm = None
    if not dry:
        from vllm import LLM
        import vllm

        kwargs = dict(COMMON)
        kwargs.update(spec)
        kwargs.update(share or {})
        if trace_dir is not None:
            # the profiler is idle until start_profile(); its settings do not enter the compile hash
            kwargs["profiler_config"] = {
                "profiler": "torch", "torch_profiler_dir": str(trace_dir),
                "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
            }
        llm = LLM(model=model, **kwargs)
        info["vllm"] = vllm.__version__
        try:
            cfg = llm.llm_engine.vllm_config
            info["async_scheduling"] = bool(getattr(cfg.scheduler_config, "async_scheduling", None))
            info["cudagraph_mode"] = str(getattr(cfg.compilation_config, "cudagraph_mode", None))
            sizes = getattr(cfg.compilation_config, "cudagraph_capture_sizes", None) or []
            info["max_capture_size"] = max(sizes) if sizes else None
            info["num_gpu_blocks"] = getattr(cfg.cache_config, "num_gpu_blocks", None)
        except Exception as exc:  # introspection only
            info["introspection_error"] = repr(exc)
    if share:
        info["share"] = share
    start_s = time.perf_counter() - t0
    print(f"[{name}] engine up in {start_s:.1f}s {info}", flush=True)

    def run(prompts: list[list[int]], out_tokens: int) -> tuple[float, int, int]:
        if dry:
            time.sleep(0.01)
            return 0.01, sum(map(len, prompts)), out_tokens * len(prompts)
        from vllm import SamplingParams, TokensPrompt

        sp = SamplingParams(
            max_tokens=out_tokens, min_tokens=out_tokens, ignore_eos=True, temperature=0.0,
            detokenize=False,
        )
        reqs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(reqs, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        return dt, n_in, n_out

    return llm, run, info, start_s


def warm_and_time(name: str, wl: str, rng: random.Random, run, repeats: range, start_s: float, spec: dict,
                  info: dict, dry: bool, out: Path, warm: bool = True) -> None:
    n, lin, lout, metric = WORKLOADS[wl]
    if warm:
        # warm-up: same prompt length and output length, different random prompts; capped at
        # 64 prompts for the 4K prefill (the engine's batches are capped by
        # max_num_batched_tokens anyway), full concurrency for decode so every graph size is hit
        wn = min(n, 64) if lin >= 4096 else n
        run(random_prompts(rng, wn, lin), lout)
    for repeat in repeats:
        dt, n_in, n_out = run(random_prompts(rng, n, lin), lout)
        record(name, wl, metric, repeat, dt, n_in, n_out, start_s, spec, info, dry, out)


def child(name: str, spec: dict, workloads: list[str], out: Path, model: str, dry: bool,
          repeats: int = 1, trace_dir: Path | None = None) -> None:
    t0 = time.perf_counter()
    llm, run, info, start_s = build(name, spec, model, dry, trace_dir)
    rng = random.Random(zlib.crc32(name.encode()) ^ int(time.time()))
    for wl in workloads:
        warm_and_time(name, wl, rng, run, range(repeats), start_s, spec, info, dry, out)
    if trace_dir is not None:
        trace_single_stream(llm, name, rng, run, trace_dir, out, dry)
        trace_decode_batch(llm, name, rng, run, trace_dir, out, dry)
    print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    os._exit(0)  # skip engine teardown: the process is ending anyway


def serve_child(name: str, spec: dict, out: Path, model: str, dry: bool, trace_dir: Path | None,
                share: dict) -> None:
    """One engine of an interleaved sweep: build it, say READY, then run what the parent asks on
    stdin, one line at a time (`run WORKLOAD REPEAT`, `trace`, `quit`), answering DONE after each."""
    llm, run, info, start_s = build(name, spec, model, dry, trace_dir, share)
    rng = random.Random(zlib.crc32(name.encode()) ^ int(time.time()))
    warmed: set[str] = set()
    print(f"READY {name}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        try:
            if cmd[0] == "run":
                wl, repeat = cmd[1], int(cmd[2])
                warm_and_time(name, wl, rng, run, range(repeat, repeat + 1), start_s, spec, info, dry, out,
                              warm=wl not in warmed)
                warmed.add(wl)
            elif cmd[0] == "trace" and trace_dir is not None:
                trace_single_stream(llm, name, rng, run, trace_dir, out, dry)
                trace_decode_batch(llm, name, rng, run, trace_dir, out, dry)
        except Exception as exc:  # report and go on: the other engines' cells still count
            print(f"[{name}] {line.strip()} failed: {exc!r}", flush=True)
        print(f"DONE {name}", flush=True)
    os._exit(0)


def _traced(llm, trace_dir: Path, dry: bool, fn):
    """fn() under the profiler; (its result, the trace files it wrote)."""
    before = set(trace_dir.rglob("*")) if trace_dir.exists() else set()
    if not dry:
        llm.start_profile()
    result = fn()
    if not dry:
        llm.stop_profile()
    return result, sorted(set(trace_dir.rglob("*")) - before) if trace_dir.exists() else []


def _append_steps(out: Path, rec: dict) -> None:
    with out.with_name(out.stem + "-steps.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"[{rec['profile']}] step trace: {rec}", flush=True)


def trace_single_stream(llm, name: str, rng: random.Random, run, trace_dir: Path, out: Path, dry: bool,
                        tokens: int = 128) -> None:
    """One traced single stream (1 x 1024 in, `tokens` out) after the timed runs: the GPU's kernel
    time against the wall time of its steps (benchmarks/lib/step_trace.py), one line in
    <out>-steps.jsonl."""
    from benchmarks.lib.step_trace import summarise

    (dt, _, n_out), files = _traced(llm, trace_dir, dry, lambda: run(random_prompts(rng, 1, 1024), tokens))
    _append_steps(out, {"profile": name, "elapsed_s": round(dt, 4), "tokens_per_s_traced": round(n_out / dt, 1),
                        **summarise(trace_dir, n_out, files=files)})


def trace_decode_batch(llm, name: str, rng: random.Random, run, trace_dir: Path, out: Path, dry: bool,
                       streams: int = 256, prompt: int = 512, steps: int = 128) -> None:
    """Where a 256-stream decode step's time goes. The same batch runs with 1 output token (prefill
    only) and with 1 + `steps`, untraced and traced; the differences are the decode steps alone: the
    untraced wall time per step against the GPU's kernel time per step (the profiler slows the host,
    so its own wall time is not the untraced one). One line in <out>-steps.jsonl."""
    from benchmarks.lib.step_trace import summarise

    def once(out_tokens: int) -> float:
        return run(random_prompts(rng, streams, prompt), out_tokens)[0]

    wall = {n: once(n) for n in (1, 1 + steps)}
    busy = {}
    for n in (1, 1 + steps):
        _, files = _traced(llm, trace_dir, dry, lambda n=n: once(n))
        busy[n] = summarise(trace_dir, streams * n, top=200, files=files)
    # the kernels of the decode steps alone: the longer run's minus the prefill-only run's
    k_long, k_short = busy[1 + steps].get("top_kernels_ms") or {}, busy[1].get("top_kernels_ms") or {}
    decode_kernels = {k: round((v - k_short.get(k, 0.0)) / steps, 4) for k, v in k_long.items()}
    wall_step = (wall[1 + steps] - wall[1]) * 1000 / steps
    gpu_step = ((busy[1 + steps].get("gpu_busy_ms") or 0) - (busy[1].get("gpu_busy_ms") or 0)) / steps
    events_step = ((busy[1 + steps].get("gpu_events") or 0) - (busy[1].get("gpu_events") or 0)) / steps
    _append_steps(out, {
        "profile": name, "kind": f"decode_{streams}_streams", "streams": streams, "prompt_tokens": prompt,
        "decode_steps": steps, "untraced_wall_ms_per_step": round(wall_step, 3),
        "gpu_ms_per_step": round(gpu_step, 3),
        "gpu_busy_fraction_untraced": round(gpu_step / wall_step, 3) if wall_step > 0 else None,
        "gpu_events_per_step": round(events_step, 1),
        "top_kernels_ms_per_step": dict(sorted(decode_kernels.items(), key=lambda kv: -kv[1])[:12]),
    })


def record(name: str, wl: str, metric: str, repeat: int, dt: float, n_in: int, n_out: int, start_s: float,
           spec: dict, info: dict, dry: bool, out: Path) -> None:
    tok = (n_in + n_out) if metric == "total" else n_out
    rec = {
        "profile": name, "workload": wl, "repeat": repeat, "metric": f"{metric}_tok_s",
        "tok_s": round(tok / dt, 1), "elapsed_s": round(dt, 4),
        "prompts": WORKLOADS[wl][0], "prompt_tokens": n_in, "output_tokens": n_out,
        "total_tok_s": round((n_in + n_out) / dt, 1), "output_tok_s": round(n_out / dt, 1),
        "engine_start_s": round(start_s, 1), "engine_args": spec, "engine_info": info,
        "dry_run": dry, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with out.open("a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"[{name}] {wl} #{repeat}: {rec['tok_s']:.1f} {metric} tok/s ({dt:.2f}s)", flush=True)


# -------------------------------------------------------------------------------- parent
def end_session(proc: subprocess.Popen) -> None:
    """End a child and its session: the engine core is a separate process in the child's session."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def interleave(a, workloads: list[str], env: dict, t_end: float) -> None:
    """Every profile's engine up at once (started together: one cold compile's wait for all), then
    repeat by repeat, workload by workload, one cell at a time, the profiles' order rotating each
    repeat: a drift of the machine falls on every profile alike."""
    import queue

    names = a.profiles.split(",")
    kv_gib = a.kv_cache_gib
    total = gpu_total_gib()
    if total:
        # what one engine holds besides its KV cache: ~9 GiB of bf16 weights, activations at 8192
        # batched tokens, CUDA graphs, the CUDA context
        kv_gib = min(kv_gib, round(0.9 * total / len(names) - 13, 1))
    print(f"interleaving {len(names)} engines, KV cache {kv_gib} GiB each (GPU: {total} GiB)", flush=True)
    share = {"gpu_memory_utilization": round(0.9 / len(names), 3), "kv_cache_memory_bytes": int(kv_gib * 2**30)}
    logf = a.log.open("a") if a.log else None
    procs: dict[str, subprocess.Popen] = {}
    lines: dict[str, queue.Queue] = {}

    def pump(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if logf:
                logf.write(line)
                logf.flush()
            if line.startswith(("READY ", "DONE ")) or f"[{name}]" in line or "Traceback" in line or "Error" in line:
                print(line.rstrip()[:400], flush=True)
            if line.startswith(("READY ", "DONE ")):
                lines[name].put(line.split()[0])
        lines[name].put("EOF")

    for name in names:
        cmd = [sys.executable, "-m", "benchmarks.profiles", "--serve-child", name, "--out", str(a.out),
               "--model", a.model, "--share", json.dumps(share)] + (["--dry-run"] if a.dry_run else [])
        if name in a.trace_profiles.split(","):
            cmd += ["--trace-dir", str(a.out.parent / f"trace-{name}")]
        procs[name] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, errors="replace",
                                       start_new_session=True)
        lines[name] = queue.Queue()
        threading.Thread(target=pump, args=(name, procs[name]), daemon=True).start()

    def wait_for(name: str, word: str) -> bool:
        try:
            got = lines[name].get(timeout=max(1.0, t_end - time.monotonic()))
        except queue.Empty:
            got = "deadline"
        if got != word:
            print(f"[{name}] out of the sweep: {got} instead of {word}", flush=True)
            return False
        return True

    live = [n for n in names if wait_for(n, "READY")]

    def ask(name: str, command: str) -> None:
        if name not in live:
            return
        if time.monotonic() > t_end - a.min_left_s / 4:
            print(f"[{name}] skipped {command}: deadline", flush=True)
            return
        try:
            procs[name].stdin.write(command + "\n")
            procs[name].stdin.flush()
        except OSError:
            live.remove(name)
            return
        if not wait_for(name, "DONE"):
            live.remove(name)

    for repeat in range(a.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        for wl in workloads:
            for name in order:
                ask(name, f"run {wl} {repeat}")
    for name in names:
        if name in a.trace_profiles.split(","):
            ask(name, "trace")
    for name, proc in procs.items():
        try:
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        except OSError:
            pass
    time.sleep(2)
    for proc in procs.values():
        end_session(proc)
    wait_gpu_free()
    if logf:
        logf.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="defaults,no_prefix_cache,fast_prefill,fast_prefill_eager")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", type=Path, default=Path("profiles.jsonl"))
    ap.add_argument("--log", type=Path, default=None, help="append each child's output here")
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--deadline-s", type=float, default=560.0, help="stop starting/running after this")
    ap.add_argument("--min-left-s", type=float, default=60.0, help="do not start a profile with less left")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per workload (fresh prompts each)")
    ap.add_argument("--trace-profiles", default="",
                    help="these profiles also trace one single stream (GPU kernel time against wall time)")
    ap.add_argument("--trace-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help="fake engine: test the driver without vLLM")
    ap.add_argument("--table", nargs="*", type=Path, help="print a table from result files and exit")
    ap.add_argument("--interleave", action="store_true",
                    help="all profiles' engines up at once, each on an equal share of the GPU's memory; "
                         "cells run one at a time, repeat by repeat, the profiles' order rotating")
    ap.add_argument("--kv-cache-gib", type=float, default=16.0,
                    help="with --interleave: each engine's KV cache (fixed, so the engines starting "
                         "together do not see each other in vLLM's memory profiling)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve-child", help=argparse.SUPPRESS)
    ap.add_argument("--share", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.table is not None:
        print(table(load(a.table)))
        return
    workloads = a.workloads.split(",")
    if a.serve_child:
        serve_child(a.serve_child, PROFILES[a.serve_child], a.out, a.model, a.dry_run, a.trace_dir,
                    json.loads(a.share))
        return
    if a.child:
        child(a.child, PROFILES[a.child], workloads, a.out, a.model, a.dry_run, a.repeats, a.trace_dir)
        return

    t_end = time.monotonic() + a.deadline_s
    env = dict(os.environ)
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/vllm-cache")
    env.setdefault("PYTHONUNBUFFERED", "1")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    if a.interleave:
        interleave(a, workloads, env, t_end)
        print(table(load([a.out])), flush=True)
        return
    for name in a.profiles.split(","):
        left = t_end - time.monotonic()
        if left < a.min_left_s:
            print(f"[{name}] skipped: {left:.0f}s left", flush=True)
            continue
        cmd = [sys.executable, "-m", "benchmarks.profiles", "--child", name, "--workloads", a.workloads,
               "--out", str(a.out), "--model", a.model, "--repeats", str(a.repeats)] + (["--dry-run"] if a.dry_run else [])
        if name in a.trace_profiles.split(","):
            cmd += ["--trace-dir", str(a.out.parent / f"trace-{name}")]
        t = time.monotonic()
        logf = a.log.open("a") if a.log else None
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        keys = ("[" + name + "]", "Traceback", "Error", "runner", "Runner", "fast_prefill",
                "async scheduling", "Async scheduling", "cudagraph", "CUDA graph")

        def pump() -> None:
            for line in proc.stdout:
                if logf:
                    logf.write(line)
                if any(k in line for k in keys):
                    print(line.rstrip()[:400], flush=True)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = "deadline"
        th.join(timeout=5)
        end_session(proc)
        wait_gpu_free()
        if logf:
            logf.close()
        print(f"[{name}] exit {rc} after {time.monotonic() - t:.0f}s", flush=True)
    recs = load([a.out])
    print(table(recs), flush=True)


if __name__ == "__main__":
    main()
