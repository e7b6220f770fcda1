#!/usr/bin/env python3
"""A fair share of a full engine between tenants (auth.fair_share), against first come first
served, side by side in one run on the real gateway (vLLM CPU engine, embedded model, a small
`max_num_seqs` so the engine is full).

Two gateways, one per way, both up for the whole run, measured in turn (the order rotates each
round): `fair` (auth.fair_share on, the default with a keys file) and `fifo` (off: every request
goes to vLLM's queue at once). `--ways` may add `vllm`: `vllm serve` on the same engine flags, the
anchor that tells the engine's own wait from the gateway's (no tenants there: A and B are just two
clients, and it has no weighted split). Each round, in each way:

1. `b_alone`: tenant B sends short streams (8 tokens) one at a time; its TTFT.
2. `a_alone`: tenant A floods with `--flood` concurrent long streams (64 tokens); its output
   tokens per second over the window once the engine is full.
3. `a_with_b`: A floods as in 2 while B sends as in 1: B's TTFT, A's tokens per second, and how
   long one of A's requests takes in the engine (first token to last).

Then, in `fair` only, `weights`: tenants W3 (share 3) and W1 (share 1) both flood; the split of
the tokens they receive over the window.

Goals (issue 38): in `fair`, B's TTFT p50 under the flood at most B's TTFT alone plus one of A's
requests (`fifo`: B waits for A's queue), A's tokens per second alone at least 0.9x of `fifo`'s,
and the weighted split near 3:1.

    .venv/bin/python -m benchmarks.fair_share --out benchmarks/results/<date>-cpu-fair-share.json
    .venv/bin/python -m benchmarks.fair_share --rounds 1 --window 8      # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fixtures import synth_tokenizer
from benchmarks.lib import fair_load, servers, ways
from benchmarks.lib.fair_report import WAYS, summarize
from benchmarks.lib.servers import ROOT

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b", "w3": "sk-bench-w3", "w1": "sk-bench-w1"}
SHARES = {"a": 1, "b": 1, "w3": 3, "w1": 1}
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 64
"""A flooding request's output (ignore_eos: exactly this many): tokens per second are the requests
that ended within the window times this (a stream's chunks may merge several tokens)."""


def keys_file(workdir: Path) -> Path:
    path = workdir / "keys.yaml"
    path.write_text("keys:\n" + "".join(f"  - {{name: {name}, key: {key}, share: {SHARES[name]}}}\n"
                                        for name, key in KEYS.items()))
    return path


async def light(client: httpx.AsyncClient, tally: fair_load.Tally, args: argparse.Namespace, model: str) -> None:
    """Tenant B: `--light-concurrency` loops of short streams, one at a time each."""
    await asyncio.gather(*(fair_load.one_at_a_time(client, tally, "b", KEYS["b"], model, requests=args.light,
                                                   max_tokens=8, seed=i)
                           for i in range(args.light_concurrency)))


async def measure_way(url: str, args: argparse.Namespace, weights: bool, flood: int, model: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=4 * flood + 8, max_keepalive_connections=4 * flood + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # 1. B alone
        tally = fair_load.Tally()
        await light(client, tally, args, model)
        out["b_alone"] = fair_load.summary(tally.of("b"))

        async def flooded(tenants: list[str], concurrency: int, with_b: bool) -> fair_load.Tally:
            tally = fair_load.Tally()
            stop = asyncio.Event()
            if args.flood_workers > 1:
                # The heavier share takes more of the engine's tokens, so its client gets more
                # processes: on the H200 one process read at most ~2.5-4k tokens per second.
                procs = [fair_load.FloodProcesses(url, t, KEYS[t], model, concurrency=concurrency, max_tokens=MAX_TOKENS,
                                                  workers=args.flood_workers * (2 if SHARES[t] > 1 else 1))
                         for t in tenants]
                floods = []
            else:
                procs = []
                floods = [asyncio.ensure_future(fair_load.flood(client, tally, t, KEYS[t], model, concurrency=concurrency,
                                                                max_tokens=MAX_TOKENS, stop=stop)) for t in tenants]
            await fair_load.wait_running(client, min(args.seqs, concurrency * len(tenants)), timeout_s=120)
            await asyncio.sleep(2.0)  # past the ramp: every place taken, queues formed
            before = await fair_load.completion_tokens(client)
            start = time.monotonic()
            if with_b:
                await light(client, tally, args, model)
            remaining = args.window - (time.monotonic() - start)
            if remaining > 0:
                await asyncio.sleep(remaining)
            tally.window = (start, time.monotonic())
            after = await fair_load.completion_tokens(client)
            tally.server_tokens_per_s = {t: (after[t] - before.get(t, 0.0)) / (tally.window[1] - tally.window[0])
                                         for t in after}
            for task in floods:  # abandoned streams: the gateway aborts them
                task.cancel()
            await asyncio.gather(*floods, return_exceptions=True)
            for proc in procs:
                tally.requests.extend(await asyncio.to_thread(proc.stop))
            await asyncio.sleep(1.0)
            return tally

        # 2. A alone
        tally = await flooded(["a"], flood, with_b=False)
        out["a_alone"] = {"tokens_per_s": round(tally.finished_per_s("a") * MAX_TOKENS, 2),
                          **fair_load.summary(tally.of("a"))}
        # 3. A flooding, B one at a time
        tally = await flooded(["a"], flood, with_b=True)
        out["a_with_b"] = {"a_tokens_per_s": round(tally.finished_per_s("a") * MAX_TOKENS, 2),
                           "b": fair_load.summary(tally.of("b")),
                           "a": fair_load.summary(tally.of("a"))}
        if weights:
            tally = await flooded(["w3", "w1"], flood // 2, with_b=False)
            w3, w1 = tally.finished_per_s("w3") * MAX_TOKENS, tally.finished_per_s("w1") * MAX_TOKENS
            s3, s1 = (tally.server_tokens_per_s.get(t, 0.0) for t in ("w3", "w1"))
            out["weights"] = {"w3_tokens_per_s": round(w3, 2), "w1_tokens_per_s": round(w1, 2),
                              "split": round(w3 / w1, 3) if w1 else None,
                              # the same window counted by the gateway (gateway_tenant_tokens)
                              "server_w3_tokens_per_s": round(s3, 2), "server_w1_tokens_per_s": round(s1, 2),
                              "server_split": round(s3 / s1, 3) if s1 else None}
    return out


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def start_gateways(args: argparse.Namespace, workdir: Path, keys: Path) -> tuple[dict[str, servers.Server], str]:
    """One server per way, all up for the whole run; the model name they serve."""
    running: dict[str, servers.Server] = {}
    model = MODEL
    synth = synth_tokenizer.build(servers.gpu_model_dir(workdir / "gemma-4-e2b-synth")) if args.device == "gpu" else None
    for way in args.ways:
        port = servers.free_port()
        config = args.config or servers.CPU_CONFIG
        extra = {"engine": {"extra_engine_args": args.engine_args}} if args.engine_args else {}
        if way == "vllm" or args.device == "gpu" or extra:
            # the device's model (on the GPU the synthetic Gemma directory, dummy weights), a private
            # state dir, and on the GPU the memory split between the engines; the profile's own flags
            # otherwise. A gateway takes max_num_seqs from its environment, `vllm serve` from here.
            over = servers.device_overrides(args.device, workdir / way, synth)
            if args.device == "gpu":
                over = servers.deep_merge(over, {"engine": {"gpu_memory_utilization": args.gpu_memory_utilization}})
            if way == "vllm":
                over = servers.deep_merge(over, {"engine": {"max_num_seqs": args.seqs}})
            settings = servers.effective_settings(config, servers.deep_merge(over, extra))
            model = settings.engine.served_model_name or model
            if way == "vllm":  # the anchor: `vllm serve` with the gateways' engine flags
                running[way] = ways.launch_http_server("vllm", settings, workdir / f"{way}.yaml", workdir, way)
                running[way].wait_ready("/health", 900)
                continue
            config = servers.write_settings(settings, workdir / f"{way}.yaml")
        cmd = [sys.executable, "-m", "server", "serve", "--config", str(config), "--port", str(port),
               "--keys-file", str(keys)]
        if args.device == "cpu":
            cmd += ["--state-dir", str(ROOT / ".state")]
        env = {"LLM_GATEWAY_ENGINE__MAX_NUM_SEQS": str(args.seqs),
               "LLM_GATEWAY_AUTH__FAIR_SHARE": "true" if way == "fair" else "false",
               "LLM_GATEWAY_AUTH__USAGE_DB": str(workdir / f"usage-{way}.sqlite3")}
        running[way] = servers.start_server(way, cmd, workdir / f"{way}.log", port, servers.clean_env(env))
        if args.device == "gpu":  # one engine start at a time: the second finds the compile cache warm
            running[way].wait_ready("/ready", 900)
    for way, server in running.items():
        server.wait_ready("/health" if way == "vllm" else "/ready", 900)
    return running, model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--config", type=Path, help="the profile (default: the embedded CPU one; on the GPU, say which)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.42, help="each of the two engines' share (GPU)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=4, help="the engine's max_num_seqs (small: the engine is full)")
    ap.add_argument("--flood", default="32", help="tenant A's concurrent streams; several levels comma-separated")
    ap.add_argument("--flood-workers", type=int, default=1, help="client processes a flood is spread over")
    ap.add_argument("--light", type=int, default=6, help="tenant B's requests per phase (per loop)")
    ap.add_argument("--light-concurrency", type=int, default=1, help="tenant B's loops of one request at a time")
    ap.add_argument("--window", type=float, default=20.0, help="seconds each flood is measured")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no round after this (0: none)")
    ap.add_argument("--ways", type=lambda v: tuple(v.split(",")), default=WAYS,
                    help="the gateways to run and measure: fair,fifo (default) or one of them")
    ap.add_argument("--engine-args", type=json.loads, default={},
                    help='engine.extra_engine_args for every gateway, as JSON (e.g. \'{"stream_interval": 4}\')')
    ap.add_argument("--out", type=Path, help="results file (JSON)")
    args = ap.parse_args()
    if not args.ways or set(args.ways) - set(WAYS):
        ap.error(f"--ways: one or more of {','.join(WAYS)}")
    levels = [int(x) for x in str(args.flood).split(",")]
    t_end = time.monotonic() + args.deadline_s if args.deadline_s else None

    running: dict[str, servers.Server] = {}
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fair-share-") as tmp:
        workdir = Path(tmp)
        keys = keys_file(workdir)
        try:
            running, model = start_gateways(args, workdir, keys)
            for rnd in range(args.rounds):
                if t_end is not None and time.monotonic() > t_end:
                    print(f"deadline: stopped before round {rnd}", flush=True)
                    break
                for flood in levels:
                    for way in args.ways[rnd % len(args.ways):] + args.ways[:rnd % len(args.ways)]:
                        result = asyncio.run(measure_way(running[way].base_url, args, way == "fair", flood, model))
                        rounds.append({"round": rnd, "way": way, "flood": flood, **result})
                        if args.out:  # what is measured so far, should a later round not finish
                            write(args, rounds, levels, args.out)
                        print(f"round {rnd} flood {flood} {way}: B ttft p50 alone {num(result['b_alone']['ttft_p50_s'])} s, "
                              f"flooded {num(result['a_with_b']['b']['ttft_p50_s'])} s; A {result['a_alone']['tokens_per_s']:.1f} "
                              f"tok/s alone, request {num(result['a_alone']['service_p50_s'])} s in the engine"
                              + (f"; weights 3:1 -> {result['weights']['split']} (gateway's count {result['weights']['server_split']})" if "weights" in result else ""), flush=True)
        finally:
            for server in running.values():
                server.stop(grace_s=60)
            if args.device == "gpu":
                for way in args.ways:
                    log = workdir / f"{way}.log"
                    if log.exists() and args.out:
                        (args.out.parent / f"{args.out.stem}-{way}.log").write_text(log.read_text()[-200000:])
    doc = write(args, rounds, levels, args.out)
    print(json.dumps(doc["summary"], indent=2))
    if args.out:
        print(f"wrote {args.out}")
    return 0


def write(args: argparse.Namespace, rounds: list[dict[str, Any]], levels: list[int], out: Path | None) -> dict[str, Any]:
    summary = ({f"flood_{c}": summarize([r for r in rounds if r["flood"] == c]) for c in levels}
               if len(levels) > 1 else summarize(rounds))
    engine = (f"vLLM CPU, {servers.CPU_CONFIG.name} (embedded SmolLM2-135M)" if args.device == "cpu" else
              f"vLLM GPU, {(args.config or servers.GPU_CONFIG).name} (Gemma 4 E2B shapes, dummy weights, synthetic "
              f"tokenizer), gpu_memory_utilization {args.gpu_memory_utilization} each")
    doc = {"benchmark": "fair_share", "when": servers.now_utc(), "machine": platform.node(),
           "setup": {"engine": engine, "device": args.device,
                     "max_num_seqs": args.seqs, "flood_concurrency": levels, "flood_max_tokens": MAX_TOKENS,
                     "flood_client_processes": args.flood_workers,
                     "throughput": "requests of a tenant that ended within the window x flood_max_tokens, per second",
                     "light_requests": args.light, "light_concurrency": args.light_concurrency,
                     "light_max_tokens": 8, "window_s": args.window,
                     "extra_engine_args": args.engine_args,
                     "shares": SHARES, "rounds": args.rounds, "stream": True, "ignore_eos": True,
                     "ways": list(args.ways),
                     "interleaving": ("both gateways up for the whole run; the ways measured in turn, the "
                                      "order rotating each round" if len(args.ways) > 1 else "one gateway")},
           "summary": summary, "rounds": rounds}
    if out:
        out.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    sys.exit(main())
