#!/usr/bin/env python3
"""N gateway replicas on one GPU behind nginx, against one `vllm serve` (issue 36's table).

Every engine starts once, side by side on one device: `vllm serve` (the anchor) and K gateways
(K = the largest N asked for), each with the same profile, an equal share of the memory and the
same fixed KV cache (`--kv-cache-gib`), so that engines starting together do not see each other in
vLLM's memory profiling. For each N an nginx front door (the shipped site, rendered by
server/replicas/front.py as `llm-gateway serve --replicas N` renders it, per-client limits off)
spreads requests over the first N gateways (`least_conn`). An idle engine does no GPU work, so
`rN` measures N replicas sharing the GPU while the others wait. With `--fill-first M`, each N > 1
also gets a front `fN` over the same gateways that fills the first one up to M open requests before
the others get any (`server.replicas_fill_first`).

Each (concurrency, repeat) cell runs every way in turn, the order rotating, and each way with both
load clients: vLLM's own `vllm bench serve` (one process, as users run it) and `loadtest` (several
processes), their order alternating. Per cell: out tok/s, TTFT and TPOT, the GPU's utilisation
sampled by nvidia-smi, for `rN` how the replicas split the generated tokens, and where the host's
CPU went (each engine core's and API process's share of one core, the machine's busy cores:
benchmarks/lib/host_cpu.py), which says whether the engines or the host as a whole set the limit.

Reported: per (client, way, concurrency) the median over the repeats with the spread, the ratio of
medians to `vllm serve` by the same client, and the goal check (>= 1.5x `vllm serve` at c >= 256 with
TTFT p50 no higher; >= 0.97x at lower concurrency).

    # GPU (vLLM 0.26 on PYTHONPATH): benchmarks/device/replicas.sh start, then wait
    python3 -m benchmarks.replicas --replicas 1,2,3,4 --concurrency 256,512 --repeats 3 --out $OUT/r.jsonl
    # CPU smoke with the embedded model
    .venv/bin/python -m benchmarks.replicas --device cpu --replicas 1,2 --concurrency 2 --repeats 1 \\
        --requests 4 --input-tokens 32 --output-tokens 8 --out /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import engine_side, host_cpu, servers
from benchmarks.lib.clients import CLIENTS, from_vllm_bench, vllm_bench_cmd
from benchmarks.lib.driver import add_run_args, add_workload_args, start_run
from benchmarks.lib.gpu import GpuSampler
from benchmarks.lib.replicas_report import balance, engine_memory, engine_warmup, goal_check, summarize, table
from benchmarks.lib.ways import (client_workers, launch_http_server, loadtest_cmd, requests_for, seed_for,
                                 summary_fields)
from server.replicas.mps import MpsDaemon

def start_front(name: str, upstreams: list[int], workdir: Path, fill_first: int = 0) -> servers.Server:
    """nginx serving the shipped site over some gateway ports (server/replicas/front.py, per-client
    limits off, no failure counting; fill-first when asked), started, not waited for."""
    from server.replicas import front

    binary = front.nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed (Debian: apt-get install nginx)")
    port = servers.free_port()
    prefix = workdir / f"nginx-{name}"
    conf = front.write_front(prefix, upstreams=upstreams, listen=f"127.0.0.1:{port}", client_limits=False,
                             fill_first=fill_first, count_failures=False)
    return servers.start_server(name, [binary, "-c", str(conf), "-p", str(prefix), "-g", "daemon off;"],
                                prefix / "nginx.out", port, servers.clean_env())


def first_requests(urls: dict[str, str], model: str, tokenizer: str, prompt_tokens: int,
                   repeats: int = 4) -> dict[str, list[float]]:
    """TTFT (ms) of the first requests each fresh server gets, one at a time: the first pays for any
    kernel compiled on first use (the gateways warmed up before /ready; `vllm serve` does not)."""
    import httpx
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
    text = " ".join(["The replicas share one GPU and one front door."] * prompt_tokens)
    prompt = tok.decode(tok.encode(text, add_special_tokens=False).ids[:prompt_tokens])
    out: dict[str, list[float]] = {}
    with httpx.Client(timeout=120) as client:
        for name, url in urls.items():
            out[name] = []
            for i in range(repeats):
                body = {"model": model, "prompt": f"{i} {prompt}", "max_tokens": 8, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                t0 = time.monotonic()
                with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            break
                out[name].append(round((time.monotonic() - t0) * 1000, 1))
    return out


def preemptions(base_url: str) -> float | None:
    """vLLM's count of preempted requests on one server (None if it did not answer)."""
    text = engine_side.metrics_text(base_url)
    if text is None:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total"))


def start_engines(a: argparse.Namespace, settings, profile: Path, workdir: Path, k: int,  # noqa: ANN001
                  t_end: float) -> tuple[dict[str, servers.Server], dict[str, float]]:
    """`vllm serve` (unless --no-vllm) and K gateways, all started at once, then waited for."""
    names = ([] if a.no_vllm else ["vllm"]) + [f"gateway{i + 1}" for i in range(k)]
    procs = {name: launch_http_server("vllm" if name == "vllm" else "gateway", settings, profile, workdir, name)
             for name in names}
    start_s: dict[str, float] = {}
    try:
        for name, srv in procs.items():
            start_s[name] = round(srv.wait_ready("/health" if name == "vllm" else "/ready",
                                                 max(1.0, t_end - time.monotonic())), 1)
            print(f"[{name}] ready in {start_s[name]:.1f}s", flush=True)
    except BaseException:
        for srv in procs.values():
            srv.stop(grace_s=30)
        raise
    return procs, start_s


def run_client(client: str, base_url: str, c: int, rep: int, a: argparse.Namespace, model: str, tokenizer: str,
               workdir: Path, t_end: float, tag: str) -> dict[str, Any] | None:
    """One timed run of one client against one way; its fields (from_vllm_bench / from_loadtest)."""
    n = requests_for(c, a.requests)
    seed = seed_for(a.seed + 100 * rep, c)
    raw = workdir / "raw" / f"{tag}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    if client == "vllm-bench":
        cmd = vllm_bench_cmd(base_url, model, tokenizer, c, n, a, seed, raw.parent, raw.name)
        workers = 1
    else:
        workers = client_workers(c, a.loadtest_workers)
        cmd = loadtest_cmd(base_url, model, c, n, min(c, a.warmup), a.input_tokens, a.output_tokens, a.vocab_size, seed, raw,
                           workers=workers, text_tokenizer=tokenizer)
    if not servers.run_logged(cmd, workdir / f"{client}.log", f"{tag}: {' '.join(cmd)}", t_end, tag):
        return None
    doc = json.loads(raw.read_text())
    fields = from_vllm_bench(doc) if client == "vllm-bench" else summary_fields(doc["runs"][0]["summary"])
    return {**fields, "requests": n, "client_processes": workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override (repeatable)")
    ap.add_argument("--replicas", default="1,2,3,4", help="the N of each front door (gateways behind nginx)")
    ap.add_argument("--no-vllm", action="store_true", help="no `vllm serve` anchor")
    ap.add_argument("--fill-first", type=int, default=0, help="also a fill-first front fN for each N > 1: the "
                    "first gateway takes requests up to this many open before the others (server.replicas_fill_first)")
    ap.add_argument("--mps", action="store_true", help="run every engine as a client of a CUDA MPS daemon "
                    "(server/replicas/mps.py), so that their kernels share the GPU at once instead of by turns")
    ap.add_argument("--concurrency", default="256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--requests", type=int, default=None, help="per timed run (default 2 x c, at least 16)")
    add_workload_args(ap)
    ap.add_argument("--warmup", type=int, default=32, help="uncounted full-length requests before each timed "
                    "run (at most c): the engines are warm after the first cells, and a wave of c would "
                    "double a cell's device time")
    ap.add_argument("--loadtest-workers", type=int, default=8)
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="each engine's KV cache (GPU default 8: c = 512 of 512 + 256 tokens fits)")
    add_run_args(ap, out="replicas.jsonl", deadline_s=1500.0)
    a = ap.parse_args()
    run = start_run(a, "replicas")
    t_end, workdir = run.t_end, run.workdir
    gpu = a.device == "gpu"
    counts = sorted({int(x) for x in a.replicas.split(",")})
    clients = [c for c in a.clients.split(",") if c]
    unknown = [c for c in clients if c not in CLIENTS]
    if unknown or not counts or counts[0] < 1:
        raise SystemExit(f"--clients from {CLIENTS}, --replicas positive (got {unknown}, {counts})")
    k = counts[-1]
    engines = k + (0 if a.no_vllm else 1)
    defaults: dict[str, Any] = {}
    if gpu:
        kv = a.kv_cache_gib if a.kv_cache_gib is not None else 8.0
        defaults = {"engine": {"gpu_memory_utilization": round(int(90 / engines) / 100, 2),
                               "kv_cache_memory_bytes": int(kv * 2**30)}}
    elif a.kv_cache_gib is not None:
        defaults = {"engine": {"kv_cache_memory_bytes": int(a.kv_cache_gib * 2**30)}}
    config = a.config or (servers.GPU_CONFIG if gpu else servers.CPU_CONFIG)
    settings, profile, overrides = servers.gateway_profile(a, config, workdir, defaults)
    tokenizer = str(settings.model_path())
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    meta: dict[str, Any] = {"run_id": run_id, "label": a.label or f"{a.device} replicas", "device": a.device,
                            "config": str(Path(config).name), "overrides": overrides.get("engine", {}),
                            "input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
                            "prompts": "text (random tokens decoded by the model's tokenizer)"}
    concurrencies = [int(x) for x in a.concurrency.split(",")]
    procs: dict[str, servers.Server] = {}
    fronts: dict[str, servers.Server] = {}
    sampler = GpuSampler() if gpu else None
    cpu_sampler: host_cpu.CpuSampler | None = None
    recs: list[dict[str, Any]] = []
    daemon = MpsDaemon(workdir / "mps") if a.mps else None
    meta["mps"] = bool(a.mps)
    meta["fill_first"] = a.fill_first
    try:
        if daemon is not None:
            os.environ.update(daemon.start())  # every engine started below inherits it
        procs, start_s = start_engines(a, settings, profile, workdir, k, t_end)
        cpu_sampler = host_cpu.CpuSampler({name: srv.proc.pid for name, srv in procs.items()})
        meta["start_s"] = start_s
        meta["memory"] = {name: engine_memory(srv.log_tail(400_000)) for name, srv in procs.items()}
        gw_ports = [procs[f"gateway{i + 1}"].port for i in range(k)]
        meta["first_requests_ttft_ms"] = first_requests(
            {name: srv.base_url for name, srv in procs.items() if name in ("vllm", "gateway1")},
            settings.served_model_name, tokenizer, a.input_tokens)
        meta["warmup"] = {name: engine_warmup(srv.log_tail(400_000)) for name, srv in procs.items()}
        print(f"[replicas] first requests' TTFT ms (one at a time): {meta['first_requests_ttft_ms']}; "
              f"warm-ups: {meta['warmup']}", flush=True)
        for n in counts:
            fronts[f"r{n}"] = start_front(f"r{n}", gw_ports[:n], workdir)
            if a.fill_first and n > 1:
                fronts[f"f{n}"] = start_front(f"f{n}", gw_ports[:n], workdir, a.fill_first)
        for front in fronts.values():
            front.wait_ready("/ready", 30.0)
        ways = ([] if a.no_vllm else ["vllm"]) + list(fronts)
        urls = {"vllm": procs["vllm"].base_url} if not a.no_vllm else {}
        urls.update({w: f.base_url for w, f in fronts.items()})
        turn = 0
        for rep in range(a.repeats):
            for c in concurrencies:
                order = ways[turn % len(ways):] + ways[:turn % len(ways)]
                turn += 1
                for way in order:
                    for client in (clients if (rep + turn) % 2 == 0 else clients[::-1]):
                        if time.monotonic() > t_end - 30:
                            raise TimeoutError("deadline")
                        fronted = way.startswith(("r", "f"))
                        n_replicas = int(way[1:]) if fronted else 1
                        backends = gw_ports[:n_replicas] if fronted else []
                        before = [engine_side.scrape(f"http://127.0.0.1:{p}") for p in backends]
                        serving = ["vllm"] if way == "vllm" else [f"gateway{i + 1}" for i in range(n_replicas)]
                        t0 = time.time()
                        got = run_client(client, urls[way], c, rep, a, settings.served_model_name, tokenizer,
                                         workdir, t_end, f"{way}-c{c}-r{rep}-{client}")
                        t1 = time.time()
                        if got is None:
                            continue
                        # the timed part of the run: the client's start and warm-up come before it
                        timed = (t1 - float(got.get("duration_s") or (t1 - t0)), t1)
                        time.sleep(1.0)  # a CPU snapshot after t1
                        cpu = cpu_sampler.window(*timed, servers=serving) if cpu_sampler else {}
                        timed_gpu = {f"timed_{k}": v for k, v in sampler.window(*timed).items()} if sampler else {}
                        after = [engine_side.scrape(f"http://127.0.0.1:{p}") for p in backends]
                        rec = {"bench": "replicas", "way": way, "replicas": n_replicas,
                               "engine": "vllm serve" if way == "vllm" else "gateway", "client": client,
                               "concurrency": c, "repeat": rep, **got,
                               **(sampler.window(t0, t1) if sampler else {}),
                               **({"replica_token_share": balance(before, after)} if backends else {}), **cpu, **timed_gpu,
                               "time": servers.now_utc(), **meta}
                        servers.append_jsonl(a.out, rec)
                        recs.append(rec)
                        print(f"[{way} {client}] c={c} rep {rep}: {rec['output_token_throughput']:.0f} out tok/s, "
                              f"TTFT p50 {rec['ttft_p50_ms']} ms, TPOT p50 {rec['tpot_p50_ms']} ms, failed "
                              f"{rec['failed']}, GPU util {rec.get('gpu_util_mean_pct')}%, "
                              f"split {rec.get('replica_token_share')}; timed part: GPU util "
                              f"{rec.get('timed_gpu_util_mean_pct')}%, engine cores "
                              f"{[v['core_pct'] for v in cpu.get('cpu_by_server', {}).values()]}% of a core, API "
                              f"{[v['api_pct'] for v in cpu.get('cpu_by_server', {}).values()]}%, machine "
                              f"{cpu.get('machine_busy_cores')} of {cpu.get('cpu_count')} cores busy", flush=True)
    except (RuntimeError, TimeoutError) as exc:  # MpsError is a RuntimeError
        print(f"[replicas] stopped: {str(exc)[:3000]}", flush=True)
    finally:
        # an engine short of KV cache preempts (vllm:num_preemptions_total), which would favour the replicas
        meta["preemptions"] = {name: preemptions(srv.base_url) for name, srv in procs.items()}
        print(f"[replicas] preemptions per engine: {meta['preemptions']}", flush=True)
        for front in fronts.values():
            front.stop(grace_s=10)
        for srv in procs.values():
            srv.stop(grace_s=30)
        if sampler:
            sampler.stop()
        if cpu_sampler:
            cpu_sampler.stop()
        if daemon is not None:
            daemon.stop()
    rows = summarize(recs)
    checks = goal_check(rows)
    print(table(rows, checks), flush=True)
    if a.doc:
        doc_meta = {**meta, "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                    "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                    "loadavg_at_end": list(os.getloadavg()), "summary": rows, "goals": checks}
        print(f"wrote {servers.write_doc(a.doc, doc_meta, recs)}", flush=True)


if __name__ == "__main__":
    main()
