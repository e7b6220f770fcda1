"""Long tests, run by `make test-slow` (not in every CI run); results go to benchmarks/results/.

- Soak: mixed load (streaming and not, cancellations, bad requests) for LLM_GATEWAY_SOAK_S
  seconds (default 600): no unexpected errors, stable RSS of the gateway's process tree.
- Reload memory: RSS of the process tree across consecutive reloads stays within a bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from datetime import date
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ROOT, ServerProcess, start_gateway

RESULTS = ROOT / "benchmarks" / "results"
pytestmark = pytest.mark.slow


def tree_rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{date.today().isoformat()}-cpu-{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


@pytest.fixture
def soak_gateway(model_dir: Path, tmp_path: Path) -> ServerProcess:
    server = start_gateway(tmp_path)
    yield server  # type: ignore[misc]
    server.stop()


BAD_BODIES = [
    {"prompt": ""},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "temperature": -1},
    {"model": "nope", "prompt": "x"},
    {"prompt": "x" * 10, "max_tokens": 10**6},
]


def test_soak(soak_gateway: ServerProcess) -> None:
    duration = float(os.environ.get("LLM_GATEWAY_SOAK_S", "600"))
    counts: dict[str, int] = {}
    unexpected: list[str] = []
    rng = random.Random(0)

    def count(kind: str) -> None:
        counts[kind] = counts.get(kind, 0) + 1

    async def worker(i: int, client: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            roll = rng.random()
            try:
                if roll < 0.1:
                    r = await client.post("/v1/completions", json=rng.choice(BAD_BODIES))
                    count(f"bad_request_{r.status_code}")
                    if r.status_code not in (400, 404):
                        unexpected.append(f"bad request got {r.status_code}: {r.text[:200]}")
                elif roll < 0.25:
                    async def cancelled() -> None:
                        async with client.stream("POST", "/v1/completions", json={
                            "prompt": f"Soak {i}", "max_tokens": 64, "stream": True}) as r:
                            async for _ in r.aiter_lines():
                                pass
                    task = asyncio.create_task(cancelled())
                    await asyncio.sleep(rng.uniform(0.05, 0.5))
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    count("cancelled")
                elif roll < 0.6:
                    async with client.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"Soak {i}: say something"}],
                        "max_tokens": 16, "stream": True}) as r:
                        lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                    # An error event is a JSON object with a top-level "error" key (the model's
                    # own text may well contain the word "error").
                    errors = [x for x in lines[:-1] if "error" in json.loads(x)]
                    if r.status_code != 200 or lines[-1] != "[DONE]" or errors:
                        unexpected.append(f"stream {r.status_code}: {errors or lines[-2:]}")
                    count("stream_ok")
                else:
                    r = await client.post("/v1/completions", json={"prompt": f"Soak {i}:", "max_tokens": 16})
                    if r.status_code != 200:
                        unexpected.append(f"plain {r.status_code}: {r.text[:200]}")
                    count("plain_ok")
            except httpx.HTTPError as exc:
                unexpected.append(repr(exc))

    async def run() -> None:
        async with httpx.AsyncClient(base_url=soak_gateway.base_url, timeout=120) as client:
            stop_at = time.monotonic() + duration
            await asyncio.gather(*(worker(i, client, stop_at) for i in range(8)))

    rss_start = tree_rss_mib(soak_gateway.proc.pid)
    t0 = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - t0
    time.sleep(2)
    rss_end = tree_rss_mib(soak_gateway.proc.pid)
    status = httpx.get(soak_gateway.base_url + "/admin/status").json()
    result = {
        "duration_s": round(elapsed, 1),
        "requests": sum(counts.values()),
        "by_class": counts,
        "unexpected_errors": unexpected[:20],
        "unexpected_error_count": len(unexpected),
        "rss_mib_start": round(rss_start, 1),
        "rss_mib_end": round(rss_end, 1),
        "engine_unfinished_after": status["engine_unfinished_requests"],
    }
    print(json.dumps(result, indent=2))
    write_result("soak", result)
    assert unexpected == []
    assert status["engine_unfinished_requests"] == 0 and status["in_flight"] == 0
    assert rss_end < rss_start * 1.10 + 100  # stable: within 10% + 100 MiB of the start


def test_reload_memory_is_bounded(soak_gateway: ServerProcess) -> None:
    reloads = int(os.environ.get("LLM_GATEWAY_RELOADS", "10"))
    samples = [round(tree_rss_mib(soak_gateway.proc.pid), 1)]
    durations = []
    for i in range(reloads):
        strategy = "blue-green" if i % 2 else "drain-swap"
        r = httpx.post(soak_gateway.base_url + "/admin/reload", timeout=900,
                       json={"reload": {"strategy": strategy}, "engine": {"served_model_name": f"r{i}"}})
        assert r.status_code == 200, r.text
        durations.append({"strategy": strategy, "duration_s": round(r.json()["duration_s"], 1)})
        time.sleep(2)
        samples.append(round(tree_rss_mib(soak_gateway.proc.pid), 1))
    result = {"reloads": reloads, "rss_mib_after_each": samples, "reload_durations": durations}
    print(json.dumps(result, indent=2))
    write_result("reload-memory", result)
    # The process tree holds one engine between reloads: RSS must not creep up reload by reload.
    assert max(samples[1:]) < samples[1] * 1.15 + 150
