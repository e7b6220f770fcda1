#!/usr/bin/env python3
"""How many streamed tokens per second the gateway's own frontend can push (issue 14, goal 3).

The gateway runs on the scripted engine (testbed/fakes.py: every token at once, no model; one
lib/scripted_server.py process per tree), so its HTTP/SSE layer and event loop are the whole cost;
`python -m loadtest run` streams token-id completions at a fixed concurrency. Two or more trees
side by side in one run (e.g. the commit before a frontend change and the working tree), each its
own server process, measured in interleaved rounds with the order rotating, so drift on the machine
hits every tree alike. Reported per tree: output tok/s per round, the median and spread, and the
ratio of medians to the first tree. A CPU ratio, not a GPU number: on the H200 the same event loop
also runs vLLM's output processing, so the gain there is smaller than here.

    git worktree add /tmp/before <commit>          # or: git archive <commit> | tar -x -C /tmp/before
    .venv/bin/python -m benchmarks.frontend_capacity --tree before=/tmp/before --tree after=. \\
        --out benchmarks/results/<date>-cpu-frontend-capacity.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import scripted_server
from benchmarks.lib.servers import ROOT


def one_run(base_url: str, a: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "loadtest", "run", "--base-url", base_url, "--concurrency", str(a.concurrency),
           "--num-requests", str(a.requests), "--warmup", str(a.concurrency), "--input-len", "64",
           "--output-len", str(a.output_tokens), "--vocab-size", "900", "--ignore-eos", "--no-progress",
           "--workers", str(a.workers), "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    return {"out_tok_s": summary["output_token_throughput"], "req_s": summary["request_throughput"],
            "ttft_p50_ms": summary["ttft_ms"]["median"], "failed": summary["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PATH (repeatable; default: this tree)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=640)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--workers", type=int, default=1, help="loadtest client processes")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree) or {"this": str(ROOT)}
    workdir = Path(tempfile.mkdtemp(prefix="frontend-capacity-"))
    running = {}
    try:
        for name, path in trees.items():
            (workdir / name).mkdir(parents=True)
            running[name] = scripted_server.start(name, "no-keys", Path(path).resolve(), workdir / name,
                                                  workdir / f"{name}.log")
        for server in running.values():
            server.wait_ready("/ready", 120)
        names = list(running)
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                res = one_run(running[name].base_url, a, workdir / f"{name}-{r}.json")
                runs[name].append({"round": r, **res})
                print(f"round {r} {name}: {res['out_tok_s']:.0f} out tok/s, TTFT p50 {res['ttft_p50_ms']:.1f} ms, "
                      f"failed {res['failed']}", flush=True)
    finally:
        for server in running.values():
            server.stop(grace_s=10)
    first = names[0]
    summary = {}
    for name in names:
        tok = [x["out_tok_s"] for x in runs[name]]
        summary[name] = {"median_out_tok_s": round(statistics.median(tok), 1), "min": round(min(tok), 1),
                         "max": round(max(tok), 1), "failed": sum(x["failed"] for x in runs[name])}
        summary[name]["vs_" + first] = round(summary[name]["median_out_tok_s"] / summary[first]["median_out_tok_s"], 3)
        print(f"{name}: median {summary[name]['median_out_tok_s']:.0f} out tok/s (min {min(tok):.0f}, max {max(tok):.0f}), "
              f"{summary[name]['vs_' + first]:.3f}x {first}", flush=True)
    if a.out:
        doc = {"meta": {"bench": "frontend_capacity", "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                        "trees": trees, "python": platform.python_version(), "cpu_count": os.cpu_count(),
                        "loadavg_at_end": list(os.getloadavg()), "concurrency": a.concurrency,
                        "requests": a.requests, "output_tokens": a.output_tokens, "workers": a.workers,
                        "engine": "testbed/fakes.py FakeEngine (every token at once)"},
               "summary": summary, "runs": runs}
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
