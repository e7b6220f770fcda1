#!/usr/bin/env python3
"""py-spy on the gateway process under load (issue 14, goal 3: "profile the gateway on the GPU
first, then decide").

The gateway starts exactly as http_overhead.py's `gateway` way does (lib/servers.gateway_profile:
the prefill profile with the synthetic Gemma model on the GPU, the embedded model on the CPU;
lib/ways.start_http_server), then one `loadtest` run (token-id prompts, `--duration`, its own
warm-up of c requests, several client processes) keeps c streams in flight while py-spy samples
the gateway process only (no `--subprocesses`: the engine core is vLLM's own, no `--native`):

1. after --settle-s, `py-spy record --format raw --threads` for --record-s (collapsed stacks);
2. `py-spy dump` once (every thread's stack at one instant);
3. the loadtest finishes; its result line (the same fields as http_overhead.py's) goes to
   OUT_DIR/pyspy.jsonl: py-spy pauses the process for each sample (unless nonblocking), so the
   throughput is that of a profiled gateway, not a benchmark number;
4. benchmarks/lib/pyspy.py writes the top functions (self and inclusive) and the module groups
   to OUT_DIR/summary.txt and the same samples as OUT_DIR/gateway.speedscope.json.

If py-spy fails (no ptrace permission in a container, say), it is retried with `--nonblocking`,
and whatever failed is written at the top of summary.txt; the loadtest result is written anyway.

    # GPU: benchmarks/device/pyspy.sh (py-spy carried from .gpu/py-spy)
    # CPU, tiny
    .venv/bin/python -m benchmarks.experiments.pyspy_gateway --device cpu --concurrency 4 --input-tokens 32 \\
        --output-tokens 64 --record-s 5 --settle-s 4 --py-spy /tmp/tools/bin/py-spy --out-dir /tmp/pyspy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lib import engine_side, pyspy, servers
from benchmarks.lib.driver import add_run_args, add_workload_args, start_run
from benchmarks.lib.servers import ROOT
from benchmarks.lib.ways import client_workers, loadtest_cmd, result_line, start_http_server


def run_pyspy(py_spy: str, args: list[str], timeout_s: float, notes: list[str], what: str) -> bool:
    """One py-spy command, blocking first, then `--nonblocking`; failures go into `notes`."""
    for extra in ([], ["--nonblocking"]):
        cmd = [py_spy, *args[:1], *extra, *args[1:]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            notes.append(f"{what}{' --nonblocking' if extra else ''}: {type(exc).__name__}: {exc}")
            continue
        tail = (proc.stdout + proc.stderr).strip()[-1500:]
        if proc.returncode == 0:
            notes.append(f"{what}: ok{' (--nonblocking)' if extra else ''}; {tail.splitlines()[-1] if tail else ''}"
                         if what == "record" else f"{what}: ok{' (--nonblocking)' if extra else ''}")
            return True
        notes.append(f"{what}{' --nonblocking' if extra else ''}: exit {proc.returncode}: {tail}")
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override, e.g. engine.max_num_seqs=256 (repeatable)")
    ap.add_argument("--concurrency", type=int, default=256)
    add_workload_args(ap)
    ap.add_argument("--loadtest-workers", type=int, default=4, help="client processes (so the client is not the limit)")
    ap.add_argument("--settle-s", type=float, default=15.0, help="from the loadtest's start (its warm-up) to py-spy")
    ap.add_argument("--record-s", type=float, default=25.0)
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--py-spy", default="py-spy", help="the py-spy binary")
    ap.add_argument("--out-dir", type=Path, required=True, help="pyspy.jsonl, gateway.txt, summary.txt, ...")
    add_run_args(ap, out=None, deadline_s=540.0, doc=False)
    a = ap.parse_args()
    run = start_run(a, "pyspy-gateway")
    t_end, workdir = run.t_end, run.workdir
    out = a.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = a.config or (servers.GPU_CONFIG if a.device == "gpu" else servers.CPU_CONFIG)
    settings, profile, overrides = servers.gateway_profile(a, config, workdir)
    notes: list[str] = [f"command: {' '.join(sys.argv)}", f"profile: {config.name} + {json.dumps(overrides)}"]
    meta = {"label": a.label or f"{a.device} py-spy run", "device": a.device, "profiled": True,
            "input_tokens": a.input_tokens, "output_tokens": a.output_tokens, "vocab_size": a.vocab_size}
    raw, collapsed = workdir / "loadtest-pyspy.json", out / "gateway.txt"
    server = None
    load = None
    result = None
    try:
        server, start_s = start_http_server("gateway", settings, profile, workdir, t_end)
        notes.append(f"gateway pid {server.proc.pid}, ready in {start_s:.1f} s")
        # the loadtest outlasts py-spy: its warm-up and settle, the recording, the dump, a margin
        load_s = a.settle_s + a.record_s + 10.0  # counted after its warm-up, which adds margin
        left = t_end - time.monotonic()
        if left < load_s + 30:
            load_s = max(5.0, left - 40)
            a.record_s = max(3.0, min(a.record_s, load_s - a.settle_s - 5))
            notes.append(f"deadline: load shortened to {load_s:.0f} s, recording to {a.record_s:.0f} s")
        cmd = loadtest_cmd(server.base_url, settings.served_model_name, a.concurrency, 0, a.concurrency,
                              a.input_tokens, a.output_tokens, a.vocab_size, a.seed, raw,
                              workers=a.loadtest_workers)
        i = cmd.index("-n")
        del cmd[i:i + 2]  # a duration, not a count: the prompts cycle through loadtest's pool
        cmd += ["--duration", f"{load_s:.0f}"]
        notes.append("loadtest: " + " ".join(cmd[1:]))
        log = (workdir / "loadtest.log").open("a")
        # py-spy is a reaped child too, so the clients' CPU is not told apart here
        meter = engine_side.CellMeter(server.proc.pid, lambda: engine_side.scrape(server.base_url), False)
        load = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=servers.clean_env(),
                                start_new_session=True)
        time.sleep(a.settle_s)
        if load.poll() is not None:
            notes.append(f"the loadtest exited {load.returncode} before py-spy started (see loadtest.log)")
        else:
            pid = str(server.proc.pid)
            run_pyspy(a.py_spy, ["record", "--pid", pid, "--duration", f"{a.record_s:.0f}", "--rate", str(a.rate),
                                 "--threads", "--format", "raw", "-o", str(collapsed)],
                      a.record_s + 60, notes, "record")
            dump = subprocess.run([a.py_spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=60) \
                if load.poll() is None else None
            if dump is not None and dump.returncode != 0:  # same fallback as the recording
                dump = subprocess.run([a.py_spy, "dump", "--nonblocking", "--pid", pid], capture_output=True,
                                      text=True, timeout=60)
            if dump is not None:
                (out / "dump.txt").write_text(dump.stdout + dump.stderr)
                notes.append(f"dump: exit {dump.returncode}")
        try:
            load.wait(timeout=max(5.0, t_end - time.monotonic() - 40))
        except subprocess.TimeoutExpired:
            notes.append("the loadtest did not finish before the deadline: stopped")
        side = meter.stop()
        notes.append("over the whole load, profiled (lib/engine_side.py): "
                     + ", ".join(f"{k} {v}" for k, v in side.items()))
        if load.returncode == 0 and raw.exists():
            summary = json.loads(raw.read_text())["runs"][0]["summary"]
            result = result_line("gateway", a.concurrency, summary, loadtest_workers=client_workers(
                a.concurrency, a.loadtest_workers), duration_asked_s=round(load_s), engine_start_s=round(start_s, 1),
                **side, **meta)
            servers.append_jsonl(out / "pyspy.jsonl", result)
            notes.append(f"loadtest (profiled, so slower than unprofiled): {result['completed']} requests, "
                         f"{result['output_token_throughput']:.0f} out tok/s, TTFT p50/p99 {result['ttft_p50_ms']}/"
                         f"{result['ttft_p99_ms']} ms, TPOT p50 {result['tpot_p50_ms']} ms, failed {result['failed']}, "
                         f"text {result['output_chars_per_token']} chars per token")
        else:
            notes.append(f"loadtest exit {load.returncode}: no result line (see loadtest.log)")
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as exc:
        notes.append(f"stopped: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        if load is not None and load.poll() is None:
            servers.stop_group(load, grace_s=5)
        if server is not None:
            server.stop(grace_s=30)
    text = "\n".join(notes) + "\n\n"
    if collapsed.exists() and collapsed.stat().st_size:
        prof = pyspy.parse(collapsed.read_text(errors="replace"))
        window = a.rate * a.record_s
        text += pyspy.report(prof, 25, window)
        main_label = next((lb for lb in prof.threads if "MainThread" in lb), None)
        if main_label and len(prof.threads) > 1:
            text += f"\n\n######## {main_label} only (the event loop)\n" + pyspy.report(
                pyspy.parse(collapsed.read_text(errors="replace"), main_label), 25, window)
        (out / "gateway.speedscope.json").write_text(json.dumps(pyspy.speedscope(prof, "gateway")))
    else:
        text += "no samples: py-spy recorded nothing (see the notes above)\n"
    (out / "summary.txt").write_text(text)
    print(text, flush=True)
    sys.exit(0 if result is not None else 1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
