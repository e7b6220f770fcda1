#!/usr/bin/env python3
"""What tenants cost (issue 17), measured side by side in one run, two ways:

1. `vllm`: the real gateway (`llm-gateway serve`, the CPU engine and embedded model) with a keys
   file of 2 tenants at generous limits (every limit kind on, never reached), against the same
   gateway with no keys, at concurrency 64: 32 streams per tenant key (no key for `no-keys`),
   token-id prompts, fixed output length. Goal: throughput >= 0.99x of `no-keys` and p50 latency
   within 1 ms.
2. `scripted`: the gateway's HTTP stack on the scripted engine (testbed/fakes.py, answers at once;
   one lib/scripted_server.py process per way),
   so the HTTP layer is the whole cost: one request at a time, alternating the 2 tenants' keys.
   Goal: less than 0.1 ms added per request. Also reported: the same with the limits in Redis
   (`tenants-redis`, a local redis-server), and, with --before-tree, the commit before tenants.

Both interleave: every round runs every way in turn (the order rotating each round; the scripted
run alternates request by request), so drift on a shared machine hits all ways alike. Reported:
per round the ratio / difference to `no-keys`, then the median and spread (min-max) over rounds.

    git archive <commit before tenants> | tar -x -C /tmp/before      # optional
    .venv/bin/python -m benchmarks.tenants_overhead --before-tree /tmp/before \\
        --out benchmarks/results/2026-12-01-cpu-tenants-overhead.json
    .venv/bin/python -m benchmarks.tenants_overhead --engine scripted --rounds 2 --requests 5  # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import scripted_server, servers
from benchmarks.lib.scripted_server import GENEROUS, SCRIPTED_WAYS, TENANT_KEYS, keys_file
from benchmarks.lib.servers import ROOT
from benchmarks.lib.tenants_report import (KINDS, VLLM_WAYS, scripted_table, summarize_scripted, summarize_vllm,
                                           vllm_table)

# Scripted requests: a text prompt, tokenized once by serving, whose count the tenant's admission
# reuses; the GENEROUS limits include max_concurrent, so every request is settled (its slot given
# back) as a real one is.
PROMPT = " ".join(["word"] * 32)
MAX_TOKENS = 16


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


def run_scripted(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from testbed.redis_server import start_redis

    redis = start_redis(workdir / "redis")
    running = []
    ways = [w for w in SCRIPTED_WAYS if w != "before" or args.before_tree]
    try:
        for way in ways:
            tree = Path(args.before_tree).resolve() if way == "before" else ROOT
            running.append(scripted_server.start(way, way, tree, workdir, workdir / f"{way}.log", redis.url))
        for server in running:
            server.wait_ready("/ready", 120)
        records = asyncio.run(drive_scripted({s.name: s.base_url for s in running}, {s.name: s.proc.pid for s in running},
                                             args.rounds, args.requests, args.warmup))
    finally:
        for server in running:
            server.stop(grace_s=10)
        redis.stop()
    return {"setup": {"engine": "testbed/fakes.py FakeEngine (no model, answers at once)",
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
    running = {}
    config = ROOT / "configs" / "embedded-cpu.yaml"
    try:
        for way in VLLM_WAYS:
            port = servers.free_port()
            cmd = [sys.executable, "-m", "server", "serve", "--config", str(config), "--port", str(port),
                   "--state-dir", str(ROOT / ".state")]
            env = {"LLM_GATEWAY_AUTH__USAGE_DB": str(workdir / "usage-vllm.sqlite3")}
            if way == "tenants":
                cmd += ["--keys-file", str(keys_file(workdir))]
            running[way] = servers.start_server(way, cmd, workdir / f"vllm-{way}.log", port, servers.clean_env(env))
        for server in running.values():
            server.wait_ready("/ready", 600)
        runs = []
        ways = list(VLLM_WAYS)
        per_key = args.vllm_concurrency // len(TENANT_KEYS)
        for rnd in range(args.vllm_rounds):
            for way in ways[rnd % 2:] + ways[:rnd % 2]:
                keys: tuple[str | None, ...] = TENANT_KEYS if way == "tenants" else (None,) * len(TENANT_KEYS)
                result = asyncio.run(drive_load(running[way].base_url, keys, per_key, args.vllm_requests // len(keys),
                                                args.input_len, args.output_len, seed=1000 * rnd,
                                                warmup=per_key if rnd == 0 else 0))
                runs.append({"round": rnd, "way": way, **result})
                print(f"  vllm round {rnd} {way}: {result['output_token_throughput']:.1f} tok/s, "
                      f"e2e p50 {result['e2e_ms'].get('median', float('nan')):.1f} ms", flush=True)
    finally:
        for server in running.values():
            server.stop(grace_s=60)
    return {"setup": {"engine": f"vLLM CPU, {config.name} (embedded SmolLM2-135M)", "tenants": len(TENANT_KEYS),
                      "limits": GENEROUS, "concurrency": args.vllm_concurrency,
                      "requests_per_way_round": args.vllm_requests, "input_len": args.input_len,
                      "output_len": args.output_len, "stream": True, "ignore_eos": True,
                      "load": f"{len(TENANT_KEYS)} closed loops of {per_key} at once (one per tenant key; no key "
                              "for no-keys)", "rounds": args.vllm_rounds},
            "summary": summarize_vllm(runs), "rounds": runs}


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
    args = ap.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tenants-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"bench": "tenants_overhead", "time": servers.now_utc(),
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
