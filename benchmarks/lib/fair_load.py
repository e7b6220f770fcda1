"""Tenants contending for a full engine, measured from the client side: one tenant floods it with
long streams while another sends short ones one at a time (or several flood at once). Used by
`benchmarks.fair_share` and by tests/integration/test_fair_share.py."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import queue
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Streamed:
    """One streamed completion, timed from the client."""

    tenant: str
    started: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    """Generated tokens, from the stream's final usage chunk."""
    chunks: int = 0
    """Chunks with text: vLLM merges a stream's pending tokens into one chunk when its reader
    lags, so these can be fewer than the tokens."""
    status: int = 0


@dataclass
class Tally:
    """What a load gathered: the finished requests, and the window they are counted in."""

    requests: list[Streamed] = field(default_factory=list)
    window: tuple[float, float] | None = None
    server_tokens_per_s: dict[str, float] = field(default_factory=dict)
    """Each tenant's generated tokens per second over the window, as the gateway counted them."""

    def of(self, tenant: str) -> list[Streamed]:
        return [r for r in self.requests if r.tenant == tenant]

    def finished_per_s(self, tenant: str) -> float:
        """The tenant's requests that ended within the window, per second."""
        assert self.window is not None
        lo, hi = self.window
        ended = [r for r in self.of(tenant) if r.status == 200 and r.e2e_s is not None
                 and lo <= r.started + r.e2e_s <= hi]
        return len(ended) / (hi - lo) if hi > lo else 0.0


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def stream_one(client: httpx.AsyncClient, tally: Tally, tenant: str, key: str, model: str,
                     prompt: str, max_tokens: int, first_token: asyncio.Event | None = None) -> Streamed:
    """One streamed /v1/completions request (ignore_eos: exactly max_tokens tokens); `first_token`
    is set when its first text arrives (the request then holds a place in the engine)."""
    record = Streamed(tenant, time.monotonic())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        record.status = r.status_code
        if r.status_code != 200:
            await r.aread()
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"usage":{' in line.replace(" ", ""):
                    chunk = json.loads(line[6:])
                    record.tokens = (chunk.get("usage") or {}).get("completion_tokens", 0)
                    if not chunk.get("choices"):
                        continue  # the final usage chunk carries no text
                if record.ttft_s is None:
                    record.ttft_s = time.monotonic() - record.started
                    if first_token is not None:
                        first_token.set()
                record.chunks += 1
    record.e2e_s = time.monotonic() - record.started
    tally.requests.append(record)
    return record


async def flood(client: httpx.AsyncClient, tally: Tally, tenant: str, key: str, model: str, *,
                concurrency: int, max_tokens: int, stop: asyncio.Event, prompt: str = "Tell a long story:") -> None:
    """`concurrency` closed loops of long streams until `stop` is set (each finishes its stream)."""
    async def loop(i: int) -> None:
        n = 0
        while not stop.is_set():
            await stream_one(client, tally, tenant, key, model, f"{prompt} {i}-{n}", max_tokens)
            n += 1

    await asyncio.gather(*(loop(i) for i in range(concurrency)))


def _flood_worker(url: str, tenant: str, key: str, model: str, concurrency: int, max_tokens: int, prompt: str,
                  stop: Any, out: Any) -> None:
    """One client process of a flood: its share of the loops until `stop` (a multiprocessing
    Event) is set; then its finished requests go to `out`. Streams still open are abandoned (the
    gateway aborts them), as in the one-process flood."""
    async def main() -> list[Streamed]:
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            tally = Tally()
            task = asyncio.ensure_future(flood(client, tally, tenant, key, model, concurrency=concurrency,
                                               max_tokens=max_tokens, stop=asyncio.Event(), prompt=prompt))
            while not stop.is_set() and not task.done():
                await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return tally.requests

    out.put(asyncio.run(main()))


class FloodProcesses:
    """A flood spread over `workers` client processes: at hundreds of streams one Python event
    loop parsing every chunk becomes the limit, and its lag would also delay the light tenant's
    measurements in the same loop. `time.monotonic()` is the system's monotonic clock, so the
    records' times compare with the caller's window."""

    def __init__(self, url: str, tenant: str, key: str, model: str, *, concurrency: int, max_tokens: int,
                 workers: int, prompt: str = "Tell a long story:") -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork under a running event loop
        self._stop = ctx.Event()
        self._out: Any = ctx.Queue()
        sizes = [concurrency // workers + (1 if i < concurrency % workers else 0) for i in range(workers)]
        self._procs = [ctx.Process(target=_flood_worker, daemon=True,
                                   args=(url, tenant, key, model, n, max_tokens, f"{prompt} w{i}", self._stop, self._out))
                       for i, n in enumerate(sizes) if n]
        for proc in self._procs:
            proc.start()

    def stop(self, timeout_s: float = 60.0) -> list[Streamed]:
        """End every loop; the finished requests of all the processes."""
        self._stop.set()
        records: list[Streamed] = []
        for _ in self._procs:
            try:
                records.extend(self._out.get(timeout=timeout_s))
            except queue.Empty:
                break
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        return records


async def one_at_a_time(client: httpx.AsyncClient, tally: Tally, tenant: str, key: str, model: str, *,
                        requests: int, max_tokens: int, pause_s: tuple[float, float] = (0.2, 2.0),
                        seed: int = 0) -> list[Streamed]:
    """Short streams one after another, a random pause (uniform in `pause_s`) apart: a light
    tenant. The pauses vary so its arrivals do not lock on to the moments a full engine hands
    out places (a fixed pause after each answer would always arrive just after one)."""
    rng = random.Random(seed)
    done = []
    for i in range(requests):
        done.append(await stream_one(client, tally, tenant, key, model, f"Question {i}: what is two plus two?",
                                     max_tokens))
        await asyncio.sleep(rng.uniform(*pause_s))
    return done


async def wait_running(client: httpx.AsyncClient, count: int, timeout_s: float = 60.0) -> None:
    """Until the engine runs `count` requests (vLLM's own gauge, through /metrics)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= count:
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the engine never ran {count} requests")


async def completion_tokens(client: httpx.AsyncClient) -> dict[str, float]:
    """Each tenant's generated tokens so far, as the gateway counts them (`gateway_tenant_tokens`,
    kind completion, added when a request ends): the server's view of a split, free of the
    client's own limits."""
    return {s.labels["tenant"]: s.value
            for f in text_string_to_metric_families((await client.get("/metrics")).text)
            if f.name == "gateway_tenant_tokens" for s in f.samples
            if s.name == "gateway_tenant_tokens_total" and s.labels.get("kind") == "completion"}


def summary(requests: list[Streamed]) -> dict[str, Any]:
    ok = [r for r in requests if r.status == 200]
    return {"requests": len(requests), "failed": len(requests) - len(ok),
            "ttft_p50_s": p50([r.ttft_s for r in ok if r.ttft_s is not None]),
            "ttft_max_s": max((r.ttft_s for r in ok if r.ttft_s is not None), default=None),
            "e2e_p50_s": p50([r.e2e_s for r in ok if r.e2e_s is not None]),
            # From the first token to the last: the request's time in the engine, without its wait.
            "service_p50_s": p50([r.e2e_s - r.ttft_s for r in ok if r.e2e_s is not None and r.ttft_s is not None])}
