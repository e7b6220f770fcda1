#!/usr/bin/env python3
"""What tenants cost (issue 17), measured side by side in one run, two ways:

1. `vllm`: the real gateway (`llm-gateway serve`, the CPU engine and embedded model) with a keys
   file of 2 tenants at generous limits (every limit kind on, never reached), against the same
   gateway with no keys, at concurrency 64: 32 streams per tenant key (no key for `no-keys`),
   token-id prompts, fixed output length. Goal: throughput >= 0.99x of `no-keys` and p50 latency
   within 1 ms.
2. `scripted`: the gateway's HTTP stack on the scripted engine (tests/fakes.py, answers at once),
   so the HTTP layer is the whole cost: one request at a time, alternating the 2 tenants' keys.
   Goal: less than 0.1 ms added per request. Also reported: the same with the limits in Redis
   (`tenants-redis`, a local redis-server), and, with --before-tree, the commit before tenants.

Both interleave: every round runs every way in turn (the order rotating each round; the scripted
run alternates request by request), so drift on a shared machine hits all ways alike. Reported:
per round the ratio / difference to `no-keys`, then the median and spread (min-max) over rounds.

    git archive <commit before tenants> | tar -x -C /tmp/before      # optional
    .venv/bin/python benchmarks/tenants_overhead.py --before-tree /tmp/before \\
        --out benchmarks/results/2026-12-01-cpu-tenants-overhead.json
    .venv/bin/python benchmarks/tenants_overhead.py --engine scripted --rounds 2 --requests 5  # quick
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

BASELINE = "no-keys"
SCRIPTED_WAYS = ("before", BASELINE, "tenants", "tenants-redis")
VLLM_WAYS = (BASELINE, "tenants")
KINDS = ("plain", "stream")
TENANT_KEYS = ("sk-bench-a", "sk-bench-b")
GENEROUS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 10**4,
            "budget_tokens": 10**15}
GOAL_SCRIPTED_ADDED_MS = 0.1
GOAL_VLLM_THROUGHPUT_RATIO = 0.99
GOAL_VLLM_P50_DELTA_MS = 1.0
# Scripted requests: a text prompt, so the reservation (characters / 4) differs from what the
# scripted engine counts (a token per word) and every request is settled as a real one is.
PROMPT = " ".join(["word"] * 32)
MAX_TOKENS = 16


def keys_file(workdir: Path) -> Path:
    path = workdir / "keys.yaml"
    if not path.exists():
        path.write_text(json.dumps({"keys": [{"name": f"bench-{i}", "key": key, **GENEROUS}
                                             for i, key in enumerate(TENANT_KEYS)]}))
    return path


def spread(values: list[float], digits: int = 4) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def cpu_seconds(pid: int) -> float:
    """CPU time of the process's threads: Linux's scheduler counts it in nanoseconds
    (/proc/PID/task/*/schedstat), where user+system times tick every 10 ms."""
    try:
        return sum(int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                   for tid in os.listdir(f"/proc/{pid}/task")) / 1e9
    except OSError:
        import psutil

        times = psutil.Process(pid).cpu_times()
        return times.user + times.system


# ------------------------------------------------------------------------- scripted: one way's server
def serve_scripted(way: str, port: int, workdir: Path, redis_url: str | None, tree: Path = ROOT) -> None:
    sys.path.insert(0, str(tree))
    import uvicorn

    from server.app import build_app
    from server.holder import EngineHolder
    from server.http_protocol import uvicorn_http_options
    from server.settings import EngineProfile, Settings
    from tests.fakes import FakeEngine

    auth: dict[str, Any] = {}
    if way.startswith("tenants"):
        auth = {"keys_file": keys_file(workdir), "usage_db": workdir / f"usage-{way}.sqlite3"}
        if way == "tenants-redis":
            auth["redis_url"] = redis_url
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake",
                                             max_model_len=4096),
                        server={"state_dir": workdir}, **({"auth": auth} if auth else {}))
    engine = FakeEngine()
    engine.info.max_model_len = 4096

    async def factory(_: Settings) -> FakeEngine:
        return engine

    async def main() -> None:
        holder = EngineHolder(settings, factory)
        app = build_app(settings, holder)
        tenancy = getattr(app.state, "tenancy", None)  # the tree before tenants has none
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


async def one_request(client: Any, kind: str, key: str) -> float:
    body: dict[str, Any] = {"model": "fake", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {key}"}
    started = time.perf_counter()
    if kind == "plain":
        r = await client.post("/v1/completions", json=body, headers=headers)
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
    else:
        body.update(stream=True, stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            r.raise_for_status()
            text = "".join([chunk async for chunk in r.aiter_text()])
        assert text.rstrip().endswith("data: [DONE]") and '"completion_tokens":16' in text.replace(" ", "")
    return (time.perf_counter() - started) * 1000


async def drive_scripted(urls: dict[str, str], pids: dict[str, int], rounds: int, requests: int,
                         warmup: int) -> list[dict[str, Any]]:
    import httpx

    clients = {way: httpx.AsyncClient(base_url=url, timeout=30) for way, url in urls.items()}
    records = []
    try:
        for way, client in clients.items():
            for kind in KINDS:
                for i in range(warmup):
                    await one_request(client, kind, TENANT_KEYS[i % 2])
        ways = list(urls)
        for rnd in range(rounds):
            order = ways[rnd % len(ways):] + ways[:rnd % len(ways)]
            for kind in KINDS:
                # One request of each way in turn. A server is idle while the others answer, so
                # its CPU time over the block is its own requests' (settlement included).
                latencies: dict[str, list[float]] = {way: [] for way in order}
                cpu_start = {way: cpu_seconds(pids[way]) for way in order}
                for i in range(requests):
                    for way in order:
                        latencies[way].append(await one_request(clients[way], kind, TENANT_KEYS[i % 2]))
                for way in order:
                    cpu_us = (cpu_seconds(pids[way]) - cpu_start[way]) / requests * 1e6
                    records.append({"round": rnd, "position": order.index(way), "way": way, "kind": kind,
                                    "server_cpu_us_per_request": round(cpu_us, 1),
                                    "latencies_ms": [round(v, 4) for v in latencies[way]]})
    finally:
        for client in clients.values():
            await client.aclose()
    return records


def summarize_scripted(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind and way: latency over all requests and server CPU per request; per round, the
    ratio and difference of each to the baseline's in the same round."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        per_way: dict[str, Any] = {}
        rounds = sorted({r["round"] for r in records})
        blocks = {(r["way"], r["round"]): r for r in records if r["kind"] == kind}
        latency = {key: statistics.median(r["latencies_ms"]) for key, r in blocks.items()}
        cpu = {key: r["server_cpu_us_per_request"] for key, r in blocks.items()}
        for way in sorted({r["way"] for r in records}, key=SCRIPTED_WAYS.index):
            every = [v for r in records if r["kind"] == kind and r["way"] == way for v in r["latencies_ms"]]
            entry: dict[str, Any] = {"requests": len(every), "median_ms": round(statistics.median(every), 4),
                                     "p90_ms": round(quantile(every, 0.9), 4),
                                     "server_cpu_us_per_request": round(statistics.median(
                                         [cpu[(way, n)] for n in rounds]), 1)}
            if way != BASELINE:
                added = [latency[(way, n)] - latency[(BASELINE, n)] for n in rounds]
                entry.update({
                    "ratio_to_baseline": spread([latency[(way, n)] / max(latency[(BASELINE, n)], 1e-9)
                                                 for n in rounds]),
                    "added_ms": spread(added),
                    "cpu_ratio_to_baseline": spread([cpu[(way, n)] / max(cpu[(BASELINE, n)], 1e-9) for n in rounds]),
                    "added_cpu_us": spread([cpu[(way, n)] - cpu[(BASELINE, n)] for n in rounds], 1),
                })
                if way == "tenants":
                    entry.update(goal_added_ms=GOAL_SCRIPTED_ADDED_MS,
                                 meets_goal=statistics.median(added) < GOAL_SCRIPTED_ADDED_MS)
            per_way[way] = entry
        out[kind] = per_way
    return out


def scripted_table(summary: dict[str, Any]) -> str:
    lines = ["| request | way | latency median / p90 ms | latency x no-keys (median, min-max over rounds) | "
             "added ms (median, min-max) | server CPU us/request | CPU x no-keys (median, min-max) | goal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, ways in summary.items():
        for way, e in ways.items():
            head = f"| {kind} | {way} | {e['median_ms']:.3f} / {e['p90_ms']:.3f} |"
            if way == BASELINE:
                lines.append(f"{head} 1 | 0 | {e['server_cpu_us_per_request']:.0f} | 1 | |")
                continue
            r, a, c = e["ratio_to_baseline"], e["added_ms"], e["cpu_ratio_to_baseline"]
            goal = (f"< {e['goal_added_ms']} ms: {'met' if e['meets_goal'] else 'MISSED'}"
                    if "goal_added_ms" in e else "")
            lines.append(f"{head} {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
                         f"{a['median']:+.3f} ({a['min']:+.3f} to {a['max']:+.3f}) | "
                         f"{e['server_cpu_us_per_request']:.0f} | {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}) | "
                         f"{goal} |")
    return "\n".join(lines)


def run_scripted(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tests.redis_server import start_redis

    redis = start_redis(workdir / "redis")
    servers = []
    ways = [w for w in SCRIPTED_WAYS if w != "before" or args.before_tree]
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
        records = asyncio.run(drive_scripted({s.name: s.base_url for s in servers}, {s.name: s.proc.pid for s in servers},
                                             args.rounds, args.requests, args.warmup))
    finally:
        for server in servers:
            server.stop(grace_s=10)
        redis.stop()
    return {"setup": {"engine": "tests/fakes.py FakeEngine (no model, answers at once)",
                      "before_tree": args.before_tree, "tenants": len(TENANT_KEYS), "limits": GENEROUS,
                      "request": {"prompt": f"{len(PROMPT.split())} words (text)", "max_tokens": MAX_TOKENS,
                                  "route": "/v1/completions"},
                      "rounds": args.rounds, "requests_per_way_kind_round": args.requests, "concurrency": 1,
                      "server_cpu": "CPU time of the way's server process (its threads' schedstat) over each "
                                    "block of requests, divided by the requests",
                      "interleaving": "request by request, one to each way in turn; the order rotates each round"},
            "summary": summarize_scripted(records), "rounds": records}


# ------------------------------------------------------------------------- vllm: the real gateway
async def drive_load(base_url: str, keys: tuple[str | None, ...], per_key_concurrency: int, per_key_requests: int,
                     input_len: int, output_len: int, seed: int, warmup: int) -> dict[str, Any]:
    """One closed-loop load per key, all at once; their records merged into one summary."""
    from loadtest.client import Endpoint
    from loadtest.metrics import summarize
    from loadtest.runner import Bounds, Load, run_load
    from loadtest.workloads import RandomWorkload, random_specs

    workload = RandomWorkload(input_len=input_len, output_len=output_len, vocab_size=49152)
    runs = await asyncio.gather(*(
        run_load(Endpoint(base_url=base_url, model="smollm2-135m-instruct", api_key=key, ignore_eos=True),
                 Load("concurrency", per_key_concurrency), Bounds(num_requests=per_key_requests),
                 random_specs(workload, per_key_requests, seed + i),
                 warmup_specs=random_specs(workload, warmup, seed + 100 + i) if warmup else ())
        for i, key in enumerate(keys)))
    records = [r for run in runs for r in run.records]
    summary = summarize(records, max(run.duration_s for run in runs))
    return {k: summary[k] for k in ("completed", "failed", "duration_s", "request_throughput",
                                    "output_token_throughput", "ttft_ms", "e2e_ms", "errors")}


def run_vllm(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    servers = {}
    config = ROOT / "configs" / "embedded-cpu.yaml"
    try:
        for way in VLLM_WAYS:
            port = benchlib.free_port()
            cmd = [sys.executable, "-m", "server", "serve", "--config", str(config), "--port", str(port),
                   "--state-dir", str(ROOT / ".state")]
            env = {"LLM_GATEWAY_AUTH__USAGE_DB": str(workdir / "usage-vllm.sqlite3")}
            if way == "tenants":
                cmd += ["--keys-file", str(keys_file(workdir))]
            servers[way] = benchlib.start_server(way, cmd, workdir / f"vllm-{way}.log", port, benchlib.clean_env(env))
        for server in servers.values():
            server.wait_ready("/ready", 600)
        runs = []
        ways = list(VLLM_WAYS)
        per_key = args.vllm_concurrency // len(TENANT_KEYS)
        for rnd in range(args.vllm_rounds):
            for way in ways[rnd % 2:] + ways[:rnd % 2]:
                keys: tuple[str | None, ...] = TENANT_KEYS if way == "tenants" else (None,) * len(TENANT_KEYS)
                result = asyncio.run(drive_load(servers[way].base_url, keys, per_key, args.vllm_requests // len(keys),
                                                args.input_len, args.output_len, seed=1000 * rnd,
                                                warmup=per_key if rnd == 0 else 0))
                runs.append({"round": rnd, "way": way, **result})
                print(f"  vllm round {rnd} {way}: {result['output_token_throughput']:.1f} tok/s, "
                      f"e2e p50 {result['e2e_ms'].get('median', float('nan')):.1f} ms", flush=True)
    finally:
        for server in servers.values():
            server.stop(grace_s=60)
    return {"setup": {"engine": f"vLLM CPU, {config.name} (embedded SmolLM2-135M)", "tenants": len(TENANT_KEYS),
                      "limits": GENEROUS, "concurrency": args.vllm_concurrency,
                      "requests_per_way_round": args.vllm_requests, "input_len": args.input_len,
                      "output_len": args.output_len, "stream": True, "ignore_eos": True,
                      "load": f"{len(TENANT_KEYS)} closed loops of {per_key} at once (one per tenant key; no key "
                              "for no-keys)", "rounds": args.vllm_rounds},
            "summary": summarize_vllm(runs), "rounds": runs}


def summarize_vllm(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["round"], r["way"]): r for r in runs}
    rounds = sorted({r["round"] for r in runs})
    out: dict[str, Any] = {}
    for way in VLLM_WAYS:
        mine = [by[(n, way)] for n in rounds]
        out[way] = {"output_token_throughput": spread([r["output_token_throughput"] for r in mine], 2),
                    "e2e_p50_ms": spread([r["e2e_ms"]["median"] for r in mine], 1),
                    "ttft_p50_ms": spread([r["ttft_ms"]["median"] for r in mine], 1),
                    "failed": sum(r["failed"] for r in mine)}
    ratio = [by[(n, "tenants")]["output_token_throughput"] / by[(n, BASELINE)]["output_token_throughput"]
             for n in rounds]
    delta = [by[(n, "tenants")]["e2e_ms"]["median"] - by[(n, BASELINE)]["e2e_ms"]["median"] for n in rounds]
    ttft = [by[(n, "tenants")]["ttft_ms"]["median"] - by[(n, BASELINE)]["ttft_ms"]["median"] for n in rounds]
    out["tenants_vs_no_keys"] = {
        "throughput_ratio": spread(ratio), "e2e_p50_delta_ms": spread(delta, 1), "ttft_p50_delta_ms": spread(ttft, 1),
        "goal": {"throughput_ratio_at_least": GOAL_VLLM_THROUGHPUT_RATIO, "p50_delta_ms_within": GOAL_VLLM_P50_DELTA_MS},
        "meets_throughput_goal": statistics.median(ratio) >= GOAL_VLLM_THROUGHPUT_RATIO,
        "meets_p50_goal": abs(statistics.median(delta)) <= GOAL_VLLM_P50_DELTA_MS,
    }
    return out


def vllm_table(summary: dict[str, Any]) -> str:
    lines = ["| way | output tok/s (median, min-max) | e2e p50 ms (median, min-max) | TTFT p50 ms | failed |",
             "| --- | --- | --- | --- | --- |"]
    for way in VLLM_WAYS:
        e = summary[way]
        t, p, f = e["output_token_throughput"], e["e2e_p50_ms"], e["ttft_p50_ms"]
        lines.append(f"| {way} | {t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | {p['median']:.0f} "
                     f"({p['min']:.0f}-{p['max']:.0f}) | {f['median']:.0f} | {e['failed']} |")
    c = summary["tenants_vs_no_keys"]
    r, d = c["throughput_ratio"], c["e2e_p50_delta_ms"]
    lines.append(f"\ntenants / no-keys per round: throughput {r['median']:.4f} ({r['min']:.4f}-{r['max']:.4f}), "
                 f"goal >= {GOAL_VLLM_THROUGHPUT_RATIO}: {'met' if c['meets_throughput_goal'] else 'MISSED'}; "
                 f"e2e p50 {d['median']:+.1f} ms ({d['min']:+.1f} to {d['max']:+.1f}), goal within "
                 f"{GOAL_VLLM_P50_DELTA_MS} ms: {'met' if c['meets_p50_goal'] else 'MISSED'}")
    return "\n".join(lines)


# ------------------------------------------------------------------------- output
def dump(result: dict[str, Any]) -> str:
    """JSON with the summaries indented and each round's record on one line."""
    def section(doc: dict[str, Any], indent: str) -> str:
        head = json.dumps({k: v for k, v in doc.items() if k != "rounds"}, indent=1)
        rows = f",\n{indent}  ".join(json.dumps(r) for r in doc.get("rounds", []))
        return f'{head[:-2]},\n "rounds": [\n  {rows}\n ]\n}}' if "rounds" in doc else head

    parts = {k: v for k, v in result.items() if k not in ("scripted", "vllm")}
    text = json.dumps(parts, indent=1)[:-2]
    for name in ("vllm", "scripted"):
        if name in result:
            text += f',\n "{name}": ' + section(result[name], " ").replace("\n", "\n ")
    return text + "\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["both", "scripted", "vllm"], default="both")
    ap.add_argument("--rounds", type=int, default=20, help="scripted: rounds")
    ap.add_argument("--requests", type=int, default=50, help="scripted: requests per way, kind and round")
    ap.add_argument("--warmup", type=int, default=20, help="scripted: untimed requests per way and kind first")
    ap.add_argument("--before-tree", help="scripted: a checkout of the commit before tenants, served as `before`")
    ap.add_argument("--vllm-rounds", type=int, default=3)
    ap.add_argument("--vllm-concurrency", type=int, default=64)
    ap.add_argument("--vllm-requests", type=int, default=128, help="requests per way and round")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workdir")
    ap.add_argument("--serve", choices=SCRIPTED_WAYS, help="(internal) serve one scripted way on --port")
    ap.add_argument("--port", type=int)
    ap.add_argument("--redis-url")
    ap.add_argument("--tree", type=Path, default=ROOT, help="(internal) the tree whose server package --serve runs")
    args = ap.parse_args()
    if args.serve:
        serve_scripted(args.serve, args.port, Path(args.workdir), args.redis_url, args.tree)
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tenants-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"bench": "tenants_overhead", "time": benchlib.now_utc(),
                              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    if args.engine in ("both", "vllm"):
        result["vllm"] = run_vllm(args, workdir)
        print(vllm_table(result["vllm"]["summary"]), flush=True)
    if args.engine in ("both", "scripted"):
        result["scripted"] = run_scripted(args, workdir)
        print(scripted_table(result["scripted"]["summary"]), flush=True)
    result["machine"]["load_avg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dump(result))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
