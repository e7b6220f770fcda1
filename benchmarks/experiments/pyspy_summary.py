#!/usr/bin/env python3
"""Where a py-spy profile of the gateway spends its samples (issue 14, goal 3).

Reads py-spy's collapsed stacks (`py-spy record --format raw`, one line per distinct stack:
`frame;frame;...;leaf COUNT`, root first; with `--threads` the root is `thread (TID): NAME`) and
prints:

- samples per thread and, given the sampling window (`--rate`, `--duration-s`), the share of it
  each thread was busy: samples whose leaf is a wait (selector, uvloop's C loop under `Runner.run`,
  an idle thread-pool worker, a lock or queue wait: WAIT_LEAVES in lib/pyspy.py) count as waiting,
  so the event loop's thread busy near 100% means a saturated loop;
- the top N functions by self samples (leaf) and by inclusive samples (anywhere in the stack,
  once per stack), line numbers dropped so one function is one row;
- self and inclusive samples per module group (asyncio, uvicorn, starlette, fastapi, pydantic,
  json, vLLM's output processor, detokenizer, other vLLM, the gateway's own code, ...).

It can also write the same samples as a speedscope file (`--speedscope`): one py-spy sampler
gives both files (two samplers at once would double the pauses of a blocking py-spy).

    python3 -m benchmarks.experiments.pyspy_summary gateway.txt --top 25 --speedscope gateway.speedscope.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.lib.pyspy import parse, report, speedscope


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("collapsed", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", default=None, help="only threads whose label contains this (e.g. MainThread)")
    ap.add_argument("--rate", type=float, default=None, help="py-spy's sampling rate (Hz), for busy shares")
    ap.add_argument("--duration-s", type=float, default=None, help="py-spy's recording time, for busy shares")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--speedscope", type=Path, default=None, help="also write a speedscope file here")
    a = ap.parse_args(argv)
    prof = parse(a.collapsed.read_text(errors="replace"), a.thread)
    window = a.rate * a.duration_s if a.rate and a.duration_s else None
    text = report(prof, a.top, window)
    if a.thread is None and len(prof.threads) > 1:  # the event loop's thread alone as well
        main_label = next((lb for lb in prof.threads if "MainThread" in lb), None)
        if main_label:
            text += f"\n\n######## {main_label} only\n" + report(parse(a.collapsed.read_text(errors="replace"),
                                                                      main_label), a.top, window)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    if a.speedscope:
        a.speedscope.write_text(json.dumps(speedscope(prof, a.collapsed.name)))
    return 0 if prof.total else 1


if __name__ == "__main__":
    sys.exit(main())
