"""Tenants contending for a full engine, measured from the client side: one tenant floods it with
long streams while another sends short ones one at a time (or several flood at once). Used by
`benchmarks.fair_share` and by tests/integration/test_fair_share.py."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Streamed:
    """One streamed completion, timed from the client."""

    tenant: str
    started: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    status: int = 0


@dataclass
class Tally:
    """What a load gathered: finished requests, and each tenant's tokens within the window."""

    requests: list[Streamed] = field(default_factory=list)
    window: tuple[float, float] | None = None
    token_times: dict[str, list[float]] = field(default_factory=dict)

    def of(self, tenant: str) -> list[Streamed]:
        return [r for r in self.requests if r.tenant == tenant]

    def tokens_per_s(self, tenant: str) -> float:
        """The tenant's generated tokens per second within the window (all of its tokens, when no
        window was set)."""
        times = self.token_times.get(tenant, [])
        if self.window is None:
            if not times:
                return 0.0
            lo, hi = min(times), max(times)
        else:
            lo, hi = self.window
        inside = [t for t in times if lo <= t <= hi]
        return len(inside) / (hi - lo) if hi > lo else 0.0


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def stream_one(client: httpx.AsyncClient, tally: Tally, tenant: str, key: str, model: str,
                     prompt: str, max_tokens: int) -> Streamed:
    """One streamed /v1/completions request (ignore_eos: exactly max_tokens tokens)."""
    record = Streamed(tenant, time.monotonic())
    times = tally.token_times.setdefault(tenant, [])
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with client.stream("POST", "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        record.status = r.status_code
        if r.status_code != 200:
            await r.aread()
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if record.ttft_s is None:
                    record.ttft_s = now - record.started
                record.tokens += 1
                times.append(now)
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


def summary(requests: list[Streamed]) -> dict[str, Any]:
    ok = [r for r in requests if r.status == 200]
    return {"requests": len(requests), "failed": len(requests) - len(ok),
            "ttft_p50_s": p50([r.ttft_s for r in ok if r.ttft_s is not None]),
            "ttft_max_s": max((r.ttft_s for r in ok if r.ttft_s is not None), default=None),
            "e2e_p50_s": p50([r.e2e_s for r in ok if r.e2e_s is not None])}
