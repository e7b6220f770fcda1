#!/usr/bin/env python3
"""What tenants cost per request: the gateway's HTTP stack on the scripted engine
(tests/fakes.py, which answers at once), so the difference between the ways is the gateway's own
work, served three ways side by side:

- `no-tenants`:     no keys file (every request is tenant `default`: per-tenant metrics only);
- `tenants-memory`: a keys file whose tenant has all three limits (requests and tokens per
                    minute, monthly tokens; high enough never to refuse): authentication by
                    digest, the body read for the reservation, the in-memory limiter, settlement,
                    the usage store (SQLite, flushed every second);
- `tenants-redis`:  the same with `limiter: redis` on a local redis-server (one Lua script to
                    admit, one to settle, over loopback);
- `before` (with --before-tree DIR, a checkout of the commit before tenants): what a deployment
                    without a keys file paid before, to show what `no-tenants` costs it now.

Each way is its own uvicorn process (the gateway's HTTP options, uvloop). One client process
sends requests one at a time (keep-alive), interleaved request by request: one request to each
way in turn (the order rotates each round), so drift on a shared machine hits all ways alike.
Reported per way and request kind (plain, streamed): median and p90 latency and the server
process's CPU time per request, and per round their ratio to `no-tenants` and the added
milliseconds / microseconds, with the median and spread (min, max) over rounds.

    git archive <commit before tenants> | tar -x -C /tmp/before
    .venv/bin/python benchmarks/tenants_overhead.py --rounds 20 --requests 50 --before-tree /tmp/before \
        --out benchmarks/results/2026-12-01-cpu-tenants-overhead.json
    # one way's server alone (what the driver starts)
    .venv/bin/python benchmarks/tenants_overhead.py --serve tenants-memory --port 8100 --workdir /tmp/w
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402

WAYS = ("before", "no-tenants", "tenants-memory", "tenants-redis")
BASELINE = "no-tenants"
KINDS = ("plain", "stream")
KEY = "sk-bench"
KEYS_FILE = f"""tenants:
  bench:
    keys: [{KEY}]
    requests_per_minute: 1000000000
    tokens_per_minute: 1000000000000
    monthly_tokens: 1000000000000000
"""
# Goals (the added median latency of one request on the scripted engine, on this 2-core CPU
# machine); a real engine's request takes tens of milliseconds or more on top.
GOAL_ADDED_MS = {"tenants-memory": 0.5, "tenants-redis": 1.5}
# A text prompt: its reservation (characters / 4) differs from what the scripted engine counts
# (one token per word), so every request is settled as a real one is.
PROMPT = " ".join(["word"] * 32)
MAX_TOKENS = 16


# ------------------------------------------------------------------------- one way's server
def serve(way: str, port: int, workdir: Path, redis_url: str | None, tree: Path = ROOT) -> None:
    sys.path.insert(0, str(tree))
    import uvicorn

    from server.app import build_app
    from server.holder import EngineHolder
    from server.http_protocol import uvicorn_http_options
    from server.settings import EngineProfile, Settings
    from tests.fakes import FakeEngine

    tenants: dict[str, Any] = {}
    if way != "no-tenants":
        keys = workdir / f"keys-{way}.yaml"  # each way its own: the servers start at once
        keys.write_text(KEYS_FILE)
        tenants = {"keys_file": keys, "usage_db": workdir / f"usage-{way}.sqlite3"}
        if way == "tenants-redis":
            tenants.update(limiter="redis", redis_url=redis_url)
    extra = {"tenants": tenants} if way != "before" else {}  # the tree before tenants has no such section
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake",
                                             max_model_len=4096),
                        server={"state_dir": workdir}, **extra)
    engine = FakeEngine()
    engine.info.max_model_len = 4096

    async def factory(_: Settings) -> FakeEngine:
        return engine

    async def main() -> None:
        holder = EngineHolder(settings, factory)
        app = build_app(settings, holder)
        tenancy = getattr(app.state, "tenancy", None)
        await holder.start()
        if tenancy is not None:
            await tenancy.start()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                lifespan="off", **uvicorn_http_options(settings.server.max_header_bytes))
        server = uvicorn.Server(config)
        # uvicorn re-raises SIGTERM once it has stopped, which would end the process before the
        # usage store's last flush below; stop it by hand instead.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        try:
            await server.serve()
        finally:
            if tenancy is not None:
                await tenancy.stop()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


# ------------------------------------------------------------------------- the driver
async def one_request(client: Any, kind: str) -> float:
    body: dict[str, Any] = {"model": "fake", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    started = time.perf_counter()
    if kind == "plain":
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    else:
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            text = "".join([chunk async for chunk in r.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]") and '"completion_tokens":16' in text.replace(" ", "")
    return (time.perf_counter() - started) * 1000


def cpu_seconds(pid: int) -> float:
    """CPU time of the process's threads: Linux's scheduler counts it in nanoseconds
    (/proc/PID/schedstat), where user+system times tick every 10 ms, coarse for a block of requests."""
    try:
        return sum(int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                   for tid in os.listdir(f"/proc/{pid}/task")) / 1e9
    except OSError:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system


async def drive(urls: dict[str, str], pids: dict[str, int], rounds: int, requests: int,
                warmup: int) -> list[dict[str, Any]]:
    import httpx

    clients = {way: httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
               for way, url in urls.items()}
    records = []
    try:
        for way, client in clients.items():
            for kind in KINDS:
                for _ in range(warmup):
                    await one_request(client, kind)
        ways = list(urls)
        for rnd in range(rounds):
            order = ways[rnd % len(ways):] + ways[:rnd % len(ways)]
            for kind in KINDS:
                # One request of each way in turn: drift on a shared machine hits the ways alike.
                # A server is idle while the others answer, so its CPU time over the whole block
                # is its own requests' (the settlement after the last byte included).
                latencies: dict[str, list[float]] = {way: [] for way in order}
                cpu_start = {way: cpu_seconds(pids[way]) for way in order}
                for _ in range(requests):
                    for way in order:
                        latencies[way].append(await one_request(clients[way], kind))
                for way in order:
                    cpu_us = (cpu_seconds(pids[way]) - cpu_start[way]) / requests * 1e6
                    records.append({"round": rnd, "position": order.index(way), "way": way, "kind": kind,
                                    "server_cpu_us_per_request": round(cpu_us, 1),
                                    "latencies_ms": [round(v, 4) for v in latencies[way]]})
    finally:
        for client in clients.values():
            await client.aclose()
    return records


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind and way: latency over all requests and server CPU per request; per round, the
    ratio and difference of each to the baseline's in the same round."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        per_way: dict[str, Any] = {}
        rounds = sorted({r["round"] for r in records})
        blocks = {(r["way"], r["round"]): r for r in records if r["kind"] == kind}
        latency = {key: statistics.median(r["latencies_ms"]) for key, r in blocks.items()}
        cpu = {key: r["server_cpu_us_per_request"] for key, r in blocks.items()}
        for way in sorted({r["way"] for r in records}, key=WAYS.index):
            every = [v for r in records if r["kind"] == kind and r["way"] == way for v in r["latencies_ms"]]
            entry: dict[str, Any] = {"requests": len(every), "median_ms": round(statistics.median(every), 4),
                                     "p90_ms": round(quantile(every, 0.9), 4),
                                     "server_cpu_us_per_request": round(statistics.median(
                                         [cpu[(way, n)] for n in rounds]), 1)}
            if way != BASELINE:
                added = [latency[(way, n)] - latency[(BASELINE, n)] for n in rounds]
                entry.update({
                    "ratio_to_baseline": spread([latency[(way, n)] / max(latency[(BASELINE, n)], 1e-9) for n in rounds]),
                    "added_ms": spread(added),
                    "cpu_ratio_to_baseline": spread([cpu[(way, n)] / max(cpu[(BASELINE, n)], 1e-9) for n in rounds]),
                    "added_cpu_us": spread([cpu[(way, n)] - cpu[(BASELINE, n)] for n in rounds], 1),
                })
                goal = GOAL_ADDED_MS.get(way)
                if goal is not None:
                    entry.update(goal_added_ms=goal, meets_goal=statistics.median(added) <= goal)
            per_way[way] = entry
        out[kind] = per_way
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["| request | way | latency median / p90 ms | latency x no-tenants (median, min-max over rounds) | "
             "added ms (median, min-max) | server CPU us/request | CPU x no-tenants (median, min-max) | goal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, ways in summary.items():
        for way, e in ways.items():
            head = (f"| {kind} | {way} | {e['median_ms']:.3f} / {e['p90_ms']:.3f} |")
            if way == BASELINE:
                lines.append(f"{head} 1 | 0 | {e['server_cpu_us_per_request']:.0f} | 1 | |")
                continue
            r, a, c = e["ratio_to_baseline"], e["added_ms"], e["cpu_ratio_to_baseline"]
            goal = (f"added <= {e['goal_added_ms']} ms: {'met' if e['meets_goal'] else 'MISSED'}"
                    if "goal_added_ms" in e else "")
            lines.append(f"{head} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
                         f"{a['median']:+.3f} ({a['min']:+.3f} to {a['max']:+.3f}) | "
                         f"{e['server_cpu_us_per_request']:.0f} | {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}) | "
                         f"{goal} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.redis_server import start_redis

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tenants-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    redis = start_redis(workdir / "redis")
    servers = []
    ways = [w for w in WAYS if w in args.ways and (w != "before" or args.before_tree)]
    try:
        for way in ways:
            port = benchlib.free_port()
            tree = Path(args.before_tree).resolve() if way == "before" else ROOT
            cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", way, "--port", str(port),
                   "--workdir", str(workdir), "--redis-url", redis.url, "--tree", str(tree)]
            servers.append(benchlib.start_server(way, cmd, workdir / f"{way}.log", port,
                                                 benchlib.clean_env({"PYTHONPATH": str(tree)}), cwd=tree))
        for server in servers:
            server.wait_ready("/ready", 120)
        records = asyncio.run(drive({s.name: s.base_url for s in servers}, {s.name: s.proc.pid for s in servers},
                                    args.rounds, args.requests, args.warmup))
    finally:
        for server in servers:
            server.stop(grace_s=10)
        redis.stop()
    summary = summarize(records)
    return {
        "bench": "tenants_overhead", "time": benchlib.now_utc(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_end": [round(v, 2) for v in os.getloadavg()]},
        "setup": {"engine": "tests/fakes.py FakeEngine (no model, answers at once)",
                  "before_tree": args.before_tree,
                  "request": {"prompt": f"{len(PROMPT.split())} words (text)", "max_tokens": MAX_TOKENS,
                              "route": "/v1/completions"},
                  "server_cpu": "CPU time of the way's server process (all its threads, from "
                                "/proc/PID/task/*/schedstat) over each block of requests, divided by the requests",
                  "rounds": args.rounds, "requests_per_way_kind_round": args.requests, "concurrency": 1,
                  "interleaving": "request by request: one request to each way in turn; the order rotates "
                                  "by one each round"},
        "summary": summary,
        "rounds": records,
    }


def dump(result: dict[str, Any]) -> str:
    """The result as JSON: the summary indented, each round's block of latencies on one line."""
    head = json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1)
    rounds = ",\n  ".join(json.dumps(r) for r in result["rounds"])
    return f'{head[:-2]},\n "rounds": [\n  {rounds}\n ]\n}}\n'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=50, help="requests per way, kind and round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed requests per way and kind first")
    ap.add_argument("--ways", default=",".join(WAYS), type=lambda s: [w for w in s.split(",") if w])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir")
    ap.add_argument("--serve", choices=WAYS, help="(internal) serve one way on --port")
    ap.add_argument("--port", type=int)
    ap.add_argument("--redis-url")
    ap.add_argument("--before-tree", help="a checkout of the commit before tenants: adds the way `before`")
    ap.add_argument("--tree", type=Path, default=ROOT, help="(internal) the tree whose server package --serve runs")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port, Path(args.workdir), args.redis_url, args.tree)
        return
    if BASELINE not in args.ways:
        ap.error(f"--ways must include {BASELINE}")
    result = run(args)
    print(table(result["summary"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dump(result))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
