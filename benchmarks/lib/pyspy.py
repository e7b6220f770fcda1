"""Where a py-spy profile spends its samples: py-spy's collapsed stacks (`py-spy record --format raw`,
one line per distinct stack: `frame;frame;...;leaf COUNT`, root first; with `--threads` the root is
`thread (TID): NAME`) parsed into samples per thread (waiting or busy), per function (self and
inclusive) and per module group, the text report of them, and a speedscope document of the same
samples. Used by experiments/pyspy_summary.py and experiments/pyspy_gateway.py."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

WAITING = "waiting (selector, uvloop in C, idle pool thread)"
# Leaf frames that mean "this thread waits" (func pattern, file pattern). py-spy's own idle filter
# let such samples through in a container (CPU check, 2026-12-02), so they are counted here. With
# uvloop (the gateway's loop) the loop's C code has no Python frame: a leaf `Runner.run` is the loop
# in epoll or in uvloop's C work (socket writes included), so the loop thread's busy share is the
# Python work on it.
WAIT_LEAVES: list[tuple[re.Pattern[str], re.Pattern[str]]] = [(re.compile(f), re.compile(p)) for f, p in [
    (r".", r"(^|/)selectors\.py$"),
    (r"^Runner\.run$|^run$|^BaseEventLoop\.run_(forever|until_complete)$", r"(asyncio/(runners|base_events)|uvloop/__init__)\.py$"),
    (r"^_worker$", r"(^|/)concurrent/futures/thread\.py$"),
    (r"wait|^Thread\.join", r"(^|/)threading\.py$"),
    (r"^(Queue\.)?get$", r"(^|/)queue\.py$"),
    (r"^wait$", r"(^|/)multiprocessing/connection\.py$"),
]]
# (group, pattern on a frame's file path); the first match wins, so specific before general.
GROUPS: list[tuple[str, re.Pattern[str]]] = [(name, re.compile(pat)) for name, pat in [
    ("vllm output processor", r"vllm/v1/engine/output_processor\.py$"),
    ("tokenizer / detokenizer", r"(vllm/v1/engine/detokenizer\.py|vllm/.*detokeniz|tokenizers/|transformers/tokenization)"),
    ("vllm async_llm / core client", r"vllm/v1/engine/(async_llm|core_client)\.py$"),
    ("vllm other", r"(^|/)vllm/"),
    ("msgspec / zmq", r"(^|/)(msgspec|zmq)/"),
    ("uvicorn", r"(^|/)uvicorn/"),
    ("starlette", r"(^|/)starlette/"),
    ("fastapi", r"(^|/)fastapi/"),
    ("pydantic", r"(^|/)pydantic(_core)?/"),
    ("json", r"(^|/)(json|orjson)/"),
    ("gateway code", r"(^|/)(server|loadtest)/"),
    ("asyncio", r"(^|/)asyncio/"),
    ("threading / concurrent", r"(^|/)(threading\.py|concurrent/|queue\.py)"),
    ("prometheus", r"(^|/)prometheus_client/"),
]]
FRAME_RE = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def split_frame(frame: str) -> tuple[str, str]:
    """`func (path/file.py:123)` -> ("func", "path/file.py"); anything else -> (frame, "")."""
    m = FRAME_RE.match(frame.strip())
    if not m:
        return frame.strip(), ""
    return m.group("func"), m.group("file")


def function_key(frame: str) -> str:
    func, path = split_frame(frame)
    return f"{func} ({path})" if path else func


def is_waiting(frame: str) -> bool:
    func, path = split_frame(frame)
    return any(f.search(func) and p.search(path) for f, p in WAIT_LEAVES)


def group_of(frame: str) -> str:
    _, path = split_frame(frame)
    if not path:
        return "other"
    for name, pat in GROUPS:
        if pat.search(path):
            return name
    return "other stdlib / libraries"


@dataclass
class Profile:
    total: int = 0
    threads: Counter = field(default_factory=Counter)
    thread_idle: Counter = field(default_factory=Counter)
    self_fn: Counter = field(default_factory=Counter)
    incl_fn: Counter = field(default_factory=Counter)
    self_group: Counter = field(default_factory=Counter)
    incl_group: Counter = field(default_factory=Counter)
    stacks: list[tuple[str, list[str], int]] = field(default_factory=list)  # (thread, frames, count)
    skipped_lines: int = 0


def parse(text: str, thread: str | None = None) -> Profile:
    """Collapsed stacks -> counters; `thread` keeps only threads whose label contains it."""
    prof = Profile()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        stack, _, count_s = line.rpartition(" ")
        try:
            count = int(count_s)
        except ValueError:
            prof.skipped_lines += 1
            continue
        frames = [f for f in stack.split(";") if f]
        label = "(all)"
        while frames and (frames[0].startswith("thread (") or frames[0].startswith("process ")):
            label = frames.pop(0) if frames[0].startswith("thread (") else label
        if thread and thread not in label:
            continue
        if not frames:
            prof.skipped_lines += 1
            continue
        prof.total += count
        prof.threads[label] += count
        prof.stacks.append((label, frames, count))
        leaf = frames[-1]
        prof.self_fn[function_key(leaf)] += count
        leaf_group = WAITING if is_waiting(leaf) else group_of(leaf)
        prof.self_group[leaf_group] += count
        if leaf_group == WAITING:
            prof.thread_idle[label] += count
        for key in {function_key(f) for f in frames}:
            prof.incl_fn[key] += count
        for g in {group_of(f) for f in frames}:
            prof.incl_group[g] += count
    return prof


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:5.1f}%" if total else "    -"


def report(prof: Profile, top: int = 25, window_samples: float | None = None) -> str:
    t = prof.total
    idle = sum(prof.thread_idle.values())
    busy = t - idle
    out = [f"samples: {t} ({idle} waiting: selector, uvloop in C, idle pool threads; {busy} busy)"
           + (f"; {prof.skipped_lines} unparsed lines" if prof.skipped_lines else "")]
    out.append("\n== samples per thread (share of all; busy = samples not waiting / (rate x duration): "
               "the event loop's thread near 100% = a saturated loop)")
    for label, n in prof.threads.most_common():
        wait = prof.thread_idle.get(label, 0)
        busy_share = f"  [busy {100.0 * (n - wait) / window_samples:.0f}% of the window]" if window_samples else ""
        out.append(f"{_pct(n, t)}  {n:7d}  {label}{busy_share}"
                   + (f"  [waiting {_pct(wait, n).strip()} of its samples]" if wait else ""))
    out.append(f"\n== top {top} functions by self samples (% of all | % of busy)")
    for key, n in prof.self_fn.most_common(top):
        out.append(f"{_pct(n, t)} | {'    -' if is_waiting(key) else _pct(n, busy)}"
                   f"  {n:7d}  {key}")
    out.append(f"\n== top {top} functions by inclusive samples (% of all)")
    for key, n in prof.incl_fn.most_common(top):
        out.append(f"{_pct(n, t)}  {n:7d}  {key}")
    out.append("\n== module groups: self (leaf) and inclusive samples (% of all)")
    out.append("   self  inclusive  group")
    for g in sorted(set(prof.self_group) | set(prof.incl_group), key=lambda g: -prof.self_group.get(g, 0)):
        out.append(f"{_pct(prof.self_group.get(g, 0), t)}  {_pct(prof.incl_group.get(g, 0), t)}     {g}")
    return "\n".join(out)


def speedscope(prof: Profile, name: str) -> dict:
    """The samples as a speedscope document (one sampled profile per thread, aggregated stacks)."""
    frames: list[dict] = []
    index: dict[str, int] = {}
    profiles = []
    for label in [lb for lb, _ in prof.threads.most_common()]:
        samples, weights = [], []
        for lb, stack, count in prof.stacks:
            if lb != label:
                continue
            ids = []
            for f in stack:
                if f not in index:
                    func, path = split_frame(f)
                    index[f] = len(frames)
                    m = FRAME_RE.match(f.strip())
                    entry: dict = {"name": func, "file": path}
                    if m and m.group("line"):
                        entry["line"] = int(m.group("line"))
                    frames.append(entry)
                ids.append(index[f])
            samples.append(ids)
            weights.append(count)
        profiles.append({"type": "sampled", "name": label, "unit": "none", "startValue": 0,
                         "endValue": sum(weights), "samples": samples, "weights": weights})
    return {"$schema": "https://www.speedscope.app/file-format-schema.json", "name": name,
            "shared": {"frames": frames}, "profiles": profiles, "exporter": "benchmarks/lib/pyspy.py"}
