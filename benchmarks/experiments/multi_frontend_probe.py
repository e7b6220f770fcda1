#!/usr/bin/env python3
"""Several `AsyncLLM` clients, each in its own process, on one engine core: the experiments C1-C4 and C6 of
docs/design/multi-frontend.md (section 5), before any of that design is built.

This process plays the design's manager. It launches the engine core the way `vllm serve
--api-server-count N` does (`launch_core_engines`, one ZMQ input/output pair per client) and spawns
the N client processes inside the launch, as vLLM does. Once the core is ready it connects a control
client of its own (index N): a client that connects only after the core is up, which is what a
reload that starts a new core would need (C2). Then:
- C1: every client runs `--streams` token-id generations at once, and each must end with exactly
  `--max-tokens` tokens;
- C3: mid-run, the control client alone pauses the core (`pause_generation(mode="keep")`, as the
  gateway's in-place reload does). No client may receive a token while it is paused. One
  `collective_rpc` reloads the weights (the gateway's worker method, same checkpoint) and must run
  once per model worker. After `resume_generation()` every stream goes on to its end.
- C6: vLLM's counters (generated tokens, finished requests), written by every process into one
  `PROMETHEUS_MULTIPROC_DIR` as `vllm serve` arranges for N > 1, sum to what the clients received;
- C4 (`--kill-watch-s`): during a second round of long generations the core is SIGKILLed. The
  manager's process sentinel must fire; what the clients and the control client see is reported.

Prints one PASS/FAIL line per check and writes the measurements as JSON (--out). It drives vLLM's
private launch API directly, so it is a probe, not a gateway component (server/engine is the only
place the gateway itself imports vLLM). Runs on vLLM 0.26 and 0.32:

    .venv/bin/python -m benchmarks.experiments.multi_frontend_probe --clients 2 --out /tmp/probe-032.json
    .venv-vllm026/bin/python -m benchmarks.experiments.multi_frontend_probe --clients 2 --out /tmp/probe-026.json
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def client_main(index: int, count: int, addresses: dict[str, str], engine_kwargs: dict[str, Any],
                streams: int, max_tokens: int, go: Any, progress: Any, results: Any,
                go_kill: Any, kill_watch_s: float) -> None:
    """One frontend: an AsyncLLM client of the shared core, `streams` generations at once."""
    t0 = time.monotonic()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    report: dict[str, Any] = {"index": index, "pid": os.getpid(), "tokens": [], "errors": []}
    try:
        # As vLLM's API-server workers do: the config is rebuilt from the same arguments here.
        vllm_config = AsyncEngineArgs(**engine_kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)
        llm = AsyncLLM.from_vllm_config(vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
                                        client_addresses=addresses, client_count=count, client_index=index)
        report["connected_after_s"] = round(time.monotonic() - t0, 2)
    except Exception as exc:  # reported, not raised: the manager decides
        report["errors"].append(f"connect: {exc!r}"[:300])
        results.put(report)
        return
    rng = random.Random(index)
    vocab = 4000

    async def one(n: int, limit: int) -> int:
        prompt = [rng.randrange(100, vocab) for _ in range(24)]
        params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        got = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, f"c{index}-s{n}"):
            k = len(out.outputs[0].token_ids) if out.outputs else 0
            got += k
            with progress.get_lock():
                progress[index] += k
        return got

    async def run() -> None:
        # One event loop for both phases: AsyncLLM's output handler lives on the first loop it sees.
        await asyncio.to_thread(go.wait)
        start = time.monotonic()
        done = await asyncio.gather(*(one(n, max_tokens) for n in range(streams)), return_exceptions=True)
        report["elapsed_s"] = round(time.monotonic() - start, 2)
        for d in done:
            if isinstance(d, BaseException):
                report["errors"].append(repr(d)[:300])
            else:
                report["tokens"].append(d)
        results.put(report)
        if kill_watch_s > 0:
            await asyncio.to_thread(go_kill.wait)
            results.put(await watch_the_core_die())

    async def watch_the_core_die() -> dict[str, Any]:
        # C4: long generations while the manager SIGKILLs the core. What does this client see?
        tasks = [asyncio.ensure_future(one(streams + n, 100 * max_tokens)) for n in range(streams)]
        t_end = time.monotonic() + kill_watch_s
        done, pending = await asyncio.wait(tasks, timeout=kill_watch_s, return_when=asyncio.FIRST_COMPLETED)
        first_end = time.time() if done else None
        if pending:
            more, pending = await asyncio.wait(pending, timeout=max(0.0, t_end - time.monotonic()))
            done |= more
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return {"index": index, "phase": "core killed", "first_stream_end_at": first_end,
                "errors": sorted({type(t.exception()).__name__ for t in done if t.exception()}),
                "finished": sum(1 for t in done if not t.exception()), "still_waiting": len(pending)}

    try:
        asyncio.run(run())
    finally:
        if "elapsed_s" not in report:
            results.put(report)  # it failed before its report went
        llm.shutdown()
        llm = None  # dropped while the modules are alive: its __del__ shuts down again, noisily at exit


def summed_counters(want: dict[str, float], wait_s: float = 10.0) -> dict[str, float]:
    """These counters summed over every process's metric files, as one scrape of a multi-process
    `/metrics` would show them; waits up to `wait_s` for them to reach `want` (a client records a
    step's stats just after it hands on the step's outputs)."""
    from prometheus_client import CollectorRegistry, multiprocess

    give_up = time.monotonic() + wait_s
    while True:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        totals = dict.fromkeys(want, 0.0)
        for family in registry.collect():
            for sample in family.samples:
                if sample.name in totals:
                    totals[sample.name] += sample.value
        if totals == want or time.monotonic() > give_up:
            return totals
        time.sleep(0.2)


def launch_core(vllm_config: Any, addresses: Any, clients: int) -> Any:
    """vLLM's `launch_core_engines` context manager, called as each release takes it."""
    from vllm.v1.engine.utils import launch_core_engines
    from vllm.v1.executor import Executor

    executor_class = Executor.get_class(vllm_config)
    if "num_api_servers" in inspect.signature(launch_core_engines).parameters:
        # vLLM 0.26: takes the number of API servers (unused at dp=1); yields a 4-tuple.
        return launch_core_engines(vllm_config, executor_class, True, addresses, clients)
    # vLLM 0.32: yields a CoreEngineLaunch.
    return launch_core_engines(vllm_config, executor_class, True, addresses)


def engine_manager_of(launched: Any) -> Any:
    # vLLM 0.26 yields (engine_manager, coordinator, addresses, tensor_queue); 0.32 a dataclass.
    return launched[0] if isinstance(launched, tuple) else launched.engine_manager


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=str(ROOT / "configs" / "embedded-cpu.yaml"))
    p.add_argument("--state-dir", default=None, help="the gateway's state dir (the embedded model lives there)")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--streams", type=int, default=4, help="generations per client, at once")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--pause-s", type=float, default=2.0)
    p.add_argument("--kill-watch-s", type=float, default=10.0,
                   help="C4: how long the clients watch after the core is SIGKILLed (0: skip C4)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    # C6: vLLM's metrics from every process in one directory, as `vllm serve` sets it up for N > 1;
    # prometheus_client reads this when it is first imported (by vLLM, below).
    metrics_dir = tempfile.mkdtemp(prefix="probe-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from server.engine import engine_args_kwargs, prepare_engine_environment
    from server.engine.worker_extension import QUALNAME
    from server.settings import load_settings

    overrides = {"server": {"state_dir": a.state_dir}} if a.state_dir else {}
    settings = load_settings(a.profile, **overrides)
    rpc_dir = prepare_engine_environment(settings)
    kwargs = engine_args_kwargs(settings)
    kwargs["worker_extension_cls"] = QUALNAME
    t0 = time.monotonic()

    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_open_zmq_ipc_path
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.utils import EngineZmqAddresses

    n = a.clients
    vllm_config = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.OPENAI_API_SERVER)
    # One input/output pair per worker, plus one for the control client (index n).
    pairs = [{"input_address": get_open_zmq_ipc_path(), "output_address": get_open_zmq_ipc_path()}
             for _ in range(n + 1)]
    addresses = EngineZmqAddresses(inputs=[q["input_address"] for q in pairs],
                                   outputs=[q["output_address"] for q in pairs])
    ctx = mp.get_context("spawn")
    go, go_kill, results = ctx.Event(), ctx.Event(), ctx.Queue()
    progress = ctx.Array("q", n)
    procs = [ctx.Process(target=client_main, name=f"frontend-{i}",
                         args=(i, n + 1, pairs[i], kwargs, a.streams, a.max_tokens, go, progress, results,
                               go_kill, a.kill_watch_s))
             for i in range(n)]
    record: dict[str, Any] = {"vllm": vllm.__version__, "clients": n, "streams": a.streams,
                              "max_tokens": a.max_tokens, "checks": {}}
    checks = record["checks"]
    with launch_core(vllm_config, addresses, n + 1) as launched:
        for proc in procs:
            proc.start()
    engine_manager = engine_manager_of(launched)
    record["core_ready_s"] = round(time.monotonic() - t0, 2)
    t1 = time.monotonic()
    control = AsyncLLM.from_vllm_config(vllm_config, usage_context=UsageContext.OPENAI_API_SERVER,
                                        client_addresses=pairs[n], client_count=n + 1, client_index=n)
    record["control_connected_after_ready_s"] = round(time.monotonic() - t1, 2)
    checks["C2 a client connects after the core is ready"] = True

    async def settled(quiet_s: float = 0.5, limit_s: float = 10.0) -> list[int]:
        last, since, give_up = list(progress[:]), time.monotonic(), time.monotonic() + limit_s
        while time.monotonic() - since < quiet_s and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
            now = list(progress[:])
            if now != last:
                last, since = now, time.monotonic()
        return last

    async def drive() -> None:
        go.set()
        deadline = time.monotonic() + 300
        while min(progress[:]) < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        record["progress_before_pause"] = list(progress[:])
        await control.pause_generation(mode="keep", clear_cache=True)
        record["control_is_paused"] = await control.is_paused()
        frozen = await settled()  # the outputs of the step that was running when the pause landed
        t = time.monotonic()
        reloaded = await control.collective_rpc("gateway_reload_weights",
                                                kwargs={"weights_path": settings.model_path()})
        record["reload_s"] = round(time.monotonic() - t, 2)
        record["reload_results"] = reloaded
        await asyncio.sleep(a.pause_s)
        after = list(progress[:])
        record["progress_paused"] = [frozen, after]
        checks["C3 a pause from the control client stops every client"] = frozen == after and all(
            x < a.streams * a.max_tokens for x in frozen)
        checks["C3 one collective_rpc runs once per model worker"] = (
            len(reloaded) == vllm_config.parallel_config.world_size)
        await control.resume_generation()
        reports = [await asyncio.to_thread(results.get, timeout=600) for _ in procs]
        record["reports"] = sorted(reports, key=lambda r: r["index"])
        expected = [a.max_tokens] * a.streams
        # One check for two claims: every stream ran through the pause, so its full count also shows
        # that it went on after resume_generation().
        checks["C1, C3 every client's streams end with every token, after the resume"] = all(
            r["tokens"] == expected and not r["errors"] for r in reports)
        want = {"vllm:generation_tokens_total": n * a.streams * a.max_tokens,
                "vllm:request_success_total": n * a.streams}
        record["metrics_summed"] = await asyncio.to_thread(summed_counters, want)
        checks["C6 vLLM's counters sum over the client processes"] = record["metrics_summed"] == want
        if a.kill_watch_s > 0 and "elapsed_s" in reports[0]:
            await kill_the_core(sum(progress[:]))

    async def kill_the_core(before: int) -> None:
        go_kill.set()
        deadline = time.monotonic() + 120
        while sum(progress[:]) < before + 8 * n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        killed_at = time.time()
        for proc in engine_manager.processes:
            os.kill(proc.pid, signal.SIGKILL)
        fired = await asyncio.to_thread(wait_for_sentinels, engine_manager.sentinels(), 10)
        seen: dict[str, Any] = {"manager_sentinel_after_s": round(time.time() - killed_at, 2) if fired else None}
        checks["C4 the manager's process sentinel shows a killed core"] = bool(fired)
        try:
            await asyncio.wait_for(control.check_health(), 2)
            seen["control_check_health"] = "passed"
        except Exception as exc:  # what a dead core looks like to a client is the finding
            seen["control_check_health"] = type(exc).__name__
        try:
            await asyncio.wait_for(control.is_paused(), 3)
            seen["control_utility_call"] = "answered"
        except Exception as exc:
            seen["control_utility_call"] = type(exc).__name__
        watched = [await asyncio.to_thread(results.get, timeout=a.kill_watch_s + 120) for _ in procs]
        for w in watched:
            if w.get("first_stream_end_at") is not None:
                w["first_stream_end_after_kill_s"] = round(w.pop("first_stream_end_at") - killed_at, 2)
        seen["clients"] = sorted(watched, key=lambda r: r["index"])
        record["core_killed"] = seen

    asyncio.run(drive())
    for proc in procs:
        proc.join(timeout=60)
    control.shutdown()
    control = None  # as in client_main
    engine_manager.shutdown(timeout=10)
    record["exit_codes"] = [proc.exitcode for proc in procs]
    checks["clients exit cleanly"] = all(proc.exitcode == 0 for proc in procs)
    shutil.rmtree(rpc_dir, ignore_errors=True)
    shutil.rmtree(metrics_dir, ignore_errors=True)
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)
    if "core_killed" in record:  # not pass/fail: what the design has to live with
        print(f"FOUND C4 after SIGKILL of the core: {json.dumps(record['core_killed'])}", flush=True)
    print(json.dumps({k: v for k, v in record.items() if k != "checks"}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
