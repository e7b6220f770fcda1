#!/usr/bin/env python3
"""Reload under load (issue 9 part 3, issue 15): time `in-place`, `drain-swap` and `blue-green`
reloads of the gateway while a steady closed-loop load runs, count failed requests (goal: zero),
the generation pause (in-place) and the longest wait a request saw.

With `in-place` among the strategies the gateway serves real weights from disk, in two versions:
on the GPU two random checkpoints in Gemma 4 E2B's layout (fixtures/random_weights.py, seeds 1 and 2), on
the CPU the embedded model and its `--second-version`. Before the load starts, a correctness check
without load: the greedy answer of the fresh engine on version 1, an in-place swap to version 2
and its answer (must differ), an in-place swap back and its answer (must equal the fresh one).
Under load, an in-place reload swaps to the other version; the other strategies restart the
engine on the version serving (so a later greedy answer on a fresh engine can be compared too).

The gateway starts from one effective profile (--config plus overrides, written to
WORKDIR/profile.yaml; on the GPU `engine.gpu_memory_utilization` 0.45 so two engines fit for
blue-green, the dummy-weight Gemma 4 E2B with the synthetic tokenizer of fixtures/synth_tokenizer.py).
`--concurrency` workers send streaming /v1/completions requests back to back (token-id prompts,
fixed output length, loadtest's own request code: loadtest.client.send_request) from before the
first reload until `--settle-s` after the last. Each reload is `POST /admin/reload` with body
`{"reload": {"strategy": S}, "engine": {"model": M}}` (same profile; M the other version for
in-place, the serving one otherwise); its answer carries the server's duration, queued / aborted
counts, longest queue wait and, for in-place, the pause and the requests kept.

One JSON line per reload (server and client view: duration, requests in flight or sent during
the reload, failed, max TTFT and max E2E among them, against the baseline before the first
reload) plus one line for the whole run, appended as soon as known.

    # GPU (vLLM 0.26 on PYTHONPATH, see benchmarks/device/reload-under-load.sh)
    python3 -m benchmarks.reload_under_load --deadline-s 540 --out $OUT/part3.jsonl --workdir $OUT/work3
    # CPU smoke: one reload of each strategy with the embedded model (two small engines for blue-green)
    .venv/bin/python -m benchmarks.reload_under_load --device cpu --concurrency 2 --output-tokens 16 --out /tmp/r.jsonl
    python3 -m benchmarks.reload_under_load --table benchmarks/results/2026-11-29-cpu-reload-smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.fixtures import random_weights, synth_tokenizer
from benchmarks.lib import servers
from benchmarks.lib.driver import add_workload_args, start_run
from benchmarks.lib.reload_report import baseline_stats, error_counts, max_ms, table, window_stats
from benchmarks.lib.servers import ROOT

STRATEGIES = ("drain-swap", "blue-green")
NO_PREFETCH = "in-place-no-prefetch"  # in-place with reload.in_place_prefetch off, for comparison
PROBE = {"prompt": [(i * 7919) % 4093 + 10 for i in range(64)], "max_tokens": 32, "temperature": 0,
         "ignore_eos": True}


# ------------------------------------------------------------------------------------- run
async def post_reload(admin: Any, base_url: str, strategy: str, model_path: str | None,
                      timeout: float) -> tuple[int | None, dict[str, Any]]:
    import httpx

    body: dict[str, Any] = {"reload": {"strategy": strategy}}
    if strategy == NO_PREFETCH:  # vLLM's own order: the files are read while generation is paused
        body["reload"] = {"strategy": "in-place", "in_place_prefetch": False}
    if model_path:
        body["engine"] = {"model": model_path}
    try:
        resp = await admin.post(base_url + "/admin/reload", json=body, timeout=timeout)
        return resp.status_code, resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        return None, {"error": repr(exc)}


async def greedy(admin: Any, base_url: str, model: str) -> str:
    resp = await admin.post(base_url + "/v1/completions", json={"model": model, **PROBE}, timeout=120)
    resp.raise_for_status()
    return str(resp.json()["choices"][0]["text"])


def correctness(check: str, equal: bool, detail: str, common: dict[str, Any]) -> dict[str, Any]:
    print(f"[check] {check}: {'equal' if equal else 'DIFFERENT'} ({detail})", flush=True)
    return {"bench": "gpu_reload", "kind": "correctness", "check": check, "equal": equal, "detail": detail,
            "time": servers.now_utc(), **common}


async def check_in_place(admin: Any, base_url: str, model: str, versions: list[str], out: Path,
                         a: argparse.Namespace, common: dict[str, Any]) -> str:
    """Without load: fresh v1 answer, in-place to v2 (must differ), back to v1 (must be equal).
    Returns the answer on version 2 after the in-place swap."""
    fresh_v1 = await greedy(admin, base_url, model)
    answers, pauses = [], []
    for target, strategy in ((versions[1], "in-place"), (versions[0], NO_PREFETCH)):
        status, body = await post_reload(admin, base_url, strategy, target, a.reload_timeout_s)
        if status != 200:
            raise RuntimeError(f"in-place reload to {target} failed: HTTP {status} {json.dumps(body)[:600]}")
        pauses.append(body.get("pause_s"))
        answers.append(await greedy(admin, base_url, model))
    servers.append_jsonl(out, correctness(
        "fresh engine on v1 vs in-place v1 -> v2 -> v1", answers[1] == fresh_v1,
        f"v2 answer differs from v1: {answers[0] != fresh_v1}; pauses without load {pauses} s "
        "(prefetched, then not)", common))
    return answers[0]


async def drive(a: argparse.Namespace, base_url: str, model: str, out: Path, t_end: float,
                common: dict[str, Any], versions: list[str] | None = None) -> None:
    import httpx

    from loadtest.client import Endpoint, send_request
    from loadtest.records import RequestRecord
    from loadtest.runner import make_client
    from loadtest.workloads import RandomWorkload, random_specs

    endpoint = Endpoint(base_url=base_url, model=model, ignore_eos=True, temperature=0.0)
    specs = random_specs(RandomWorkload(input_len=a.input_tokens, output_len=a.output_tokens,
                                        vocab_size=a.vocab_size), 4096, a.seed)
    records: list[RequestRecord] = []
    stop = asyncio.Event()
    clock_zero = time.perf_counter()
    counter = iter(range(10**9))

    def now() -> float:
        return time.perf_counter() - clock_zero

    async def worker(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            i = next(counter)
            rec = RequestRecord(index=i, scheduled_s=now())
            await send_request(client, endpoint, specs[i % len(specs)], rec, clock_zero)
            records.append(rec)
            if not rec.ok:
                await asyncio.sleep(0.05)  # no busy loop on a refusing server; the failure is counted

    def as_dicts() -> list[dict[str, Any]]:
        return [{"sent_s": r.sent_s, "latency_s": r.latency_s, "ttft_s": r.ttft_s, "ok": r.ok,
                 "error": r.error, "status": r.status} for r in records]

    async with make_client(a.request_timeout_s) as client, \
            httpx.AsyncClient(timeout=httpx.Timeout(a.reload_timeout_s, connect=10)) as admin:
        in_place_v2 = None
        if versions:
            in_place_v2 = await check_in_place(admin, base_url, model, versions, out, a, common)
        current = versions[0] if versions else None
        restarted_on_v2 = False
        workers = [asyncio.create_task(worker(client)) for _ in range(a.concurrency)]
        await asyncio.sleep(a.baseline_s)
        first_reload_at = now()
        for strategy in a.strategies.split(","):
            left = t_end - time.monotonic()
            if left < a.min_left_s:
                print(f"[reload] {strategy} skipped: {left:.0f}s left", flush=True)
                continue
            t0 = now()
            print(f"[reload] {strategy} at t={t0:.1f}s, {len(records)} requests done so far", flush=True)
            target = current
            if strategy.startswith("in-place") and versions:
                target = versions[1] if current == versions[0] else versions[0]
            status, body = await post_reload(admin, base_url, strategy, target,
                                             max(5.0, min(a.reload_timeout_s, t_end - time.monotonic())))
            t1 = now()
            if status == 200:
                current = target
                restarted_on_v2 = bool(versions) and not strategy.startswith("in-place") and current == versions[1]
            server = body if status == 200 else (body.get("reload") or {"error": body.get("error", body)})
            print(f"[reload] {strategy}: HTTP {status} after {t1 - t0:.1f}s: {json.dumps(server)[:400]}", flush=True)
            await asyncio.sleep(min(a.settle_s, max(0.0, t_end - time.monotonic() - 5)))
            reqs = as_dicts()
            rec = {"bench": "gpu_reload", "kind": "reload", "strategy": strategy, "http_status": status,
                   "server": server, "client_duration_s": round(t1 - t0, 3),
                   "reload_start_s": round(t0, 3), "reload_end_s": round(t1, 3),
                   "window": window_stats(reqs, t0, t1), "baseline": baseline_stats(reqs, first_reload_at),
                   "time": servers.now_utc(), **common}
            servers.append_jsonl(out, rec)
            print(f"[reload] {strategy}: window {rec['window']}", flush=True)
        stop.set()
        done, pending = await asyncio.wait(workers, timeout=max(5.0, t_end - time.monotonic()))
        for task in pending:
            task.cancel()
        if versions and restarted_on_v2 and in_place_v2 is not None:
            fresh_v2 = await greedy(admin, base_url, model)
            servers.append_jsonl(out, correctness("in-place swap to v2 vs an engine restarted on v2",
                                                   fresh_v2 == in_place_v2, "no load during either answer", common))
    reqs = as_dicts()
    ok = [r for r in reqs if r["ok"]]
    errors = error_counts(reqs)
    run = {"bench": "gpu_reload", "kind": "run", "requests": len(reqs), "failed": len(reqs) - len(ok),
           "errors": errors, "max_ttft_ms": max_ms([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
           "max_e2e_ms": max_ms([r["latency_s"] for r in reqs if r["latency_s"] is not None]),
           "duration_s": round(now(), 1), "time": servers.now_utc(), **common}
    servers.append_jsonl(out, run)
    if a.requests_out:
        a.requests_out.write_text(json.dumps(reqs) + "\n")


def weight_versions(gpu: bool, workdir: Path, synth: Path | None) -> list[str]:
    """Two versions of one model on disk: random E2B checkpoints (GPU) or the embedded model's two."""
    if gpu:
        assert synth is not None
        # Version 1 goes into the synthetic model directory itself: the engine then starts from the
        # path the other GPU tools use with dummy weights, and finds their compile cache.
        return [str(random_weights.write(synth, synth, 1)), str(random_weights.write(workdir / "weights-v2", synth, 2))]
    from server.model_prep import write_second_version
    from server.settings.schema import embedded_model_dir

    state = ROOT / ".state"
    return [str(embedded_model_dir(state).resolve()), str(write_second_version(state).resolve())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    servers.add_profile_args(ap, "profile override (repeatable); defaults: engine.gpu_memory_utilization=0.45 "
                              "on gpu, engine.kv_cache_memory_bytes=268435456 on cpu")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help=f"in order, comma-separated: drain-swap, blue-green, in-place, {NO_PREFETCH}")
    ap.add_argument("--concurrency", type=int, default=None, help="closed-loop workers (default 32 gpu, 2 cpu)")
    add_workload_args(ap, input_tokens=None, output_tokens=None, input_help="default 512 gpu, 64 cpu",
                      output_help="default 256 gpu, 16 cpu")
    ap.add_argument("--baseline-s", type=float, default=None, help="load before the first reload (10 gpu, 8 cpu)")
    ap.add_argument("--settle-s", type=float, default=None, help="load after each reload (10 gpu, 6 cpu)")
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--reload-timeout-s", type=float, default=400.0)
    ap.add_argument("--out", type=Path, default=Path("reload_under_load.jsonl"))
    ap.add_argument("--requests-out", type=Path, default=None, help="every request's timings (JSON)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--min-left-s", type=float, default=None, help="do not start a reload with less left "
                    "(default 150 gpu, 40 cpu)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--doc", type=Path, default=None, help="also write {meta, results} of this run here")
    ap.add_argument("--table", nargs="*", type=Path, help="print the table from result files and exit")
    a = ap.parse_args()
    if a.table is not None:
        print(table(servers.load_jsonl(a.table)))
        return
    gpu = a.device == "gpu"
    for name, g, c in (("concurrency", 32, 2), ("input_tokens", 512, 64), ("output_tokens", 256, 16),
                       ("baseline_s", 10.0, 8.0), ("settle_s", 10.0, 6.0), ("min_left_s", 150.0, 40.0)):
        if getattr(a, name) is None:
            setattr(a, name, g if gpu else c)

    run = start_run(a, "reload-under-load")

    t_end, workdir = run.t_end, run.workdir
    config = a.config or (servers.GPU_CONFIG if gpu else servers.CPU_CONFIG)
    synth = None
    if gpu:
        synth = synth_tokenizer.build(servers.gpu_model_dir(workdir / "gemma-4-e2b-synth"))
    defaults = ({"engine": {"gpu_memory_utilization": 0.45}} if gpu
                else {"engine": {"kv_cache_memory_bytes": 268435456}})
    overrides = servers.deep_merge(servers.deep_merge(servers.device_overrides(a.device, workdir, synth), defaults),
                                    servers.parse_set(a.set))
    versions = None
    if any(s.startswith("in-place") for s in a.strategies.split(",")):
        versions = weight_versions(gpu, workdir, synth)
        overrides = servers.deep_merge(overrides, {"engine": {"model": versions[0], "load_format": "auto"}})
    settings = servers.effective_settings(config, overrides)
    profile = servers.write_settings(settings, workdir / "profile.yaml")
    if a.vocab_size is None:
        a.vocab_size = int(json.loads((Path(settings.model_path()) / "config.json").read_text())["vocab_size"])
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    common = {"run_id": run_id, "label": a.label or f"{a.device} run", "device": a.device,
              "config": str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config),
              "overrides": overrides.get("engine", {}), "concurrency": a.concurrency,
              "input_tokens": a.input_tokens, "output_tokens": a.output_tokens,
              "reload_settings": settings.reload.model_dump(mode="json")}

    port = servers.free_port()
    dirs = {"VLLM_RPC_BASE_PATH": workdir / "run", "TMPDIR": workdir / "tmp"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env = servers.clean_env({k: str(v) for k, v in dirs.items()})
    env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
    cmd = [sys.executable, "-m", "server", "serve", "--config", str(profile), "--port", str(port)]
    print(f"profile {profile}; starting: {' '.join(cmd)}", flush=True)
    server = servers.start_server("gateway", cmd, workdir / "gateway.log", port, env)
    try:
        start_s = server.wait_ready("/ready", max(1.0, t_end - time.monotonic() - a.min_left_s / 2))
        print(f"[gateway] ready in {start_s:.1f}s", flush=True)
        common["gateway_start_s"] = round(start_s, 1)
        asyncio.run(drive(a, server.base_url, settings.served_model_name, a.out, t_end, common, versions))
    except (RuntimeError, TimeoutError) as exc:
        print(f"[gateway] failed: {str(exc)[:3000]}", flush=True)
    finally:
        server.stop(grace_s=30)
    recs = [r for r in servers.load_jsonl([a.out]) if r.get("run_id") == run_id]
    print(table(recs), flush=True)
    if a.doc:
        meta = {"label": common["label"], "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                "python": sys.version.split()[0], "cpu_count": os.cpu_count(),
                "loadavg_at_end": list(os.getloadavg())}
        print(f"wrote {servers.write_doc(a.doc, meta, recs)}", flush=True)


if __name__ == "__main__":
    main()
