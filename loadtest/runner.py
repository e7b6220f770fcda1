"""Drive a load shape against an endpoint: closed loop (fixed concurrency) or open loop (arrival rate).

One asyncio process, one pooled httpx client. Every record keeps its scheduled and actual send
time, so the client's own lag is measured, not assumed away.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import httpx

from loadtest.arrivals import arrival_offsets
from loadtest.client import Endpoint, send_request
from loadtest.records import RequestRecord, RequestSpec


@dataclass(frozen=True)
class Load:
    kind: Literal["concurrency", "rate"]
    value: float
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ramp_up_s: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency={int(self.value)}"
        return f"rate={'inf' if math.isinf(self.value) else f'{self.value:g}'}/s"


@dataclass(frozen=True)
class Bounds:
    num_requests: int | None = None
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give a request count or a duration")


@dataclass
class RunResult:
    load: Load
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    workers: int = 1  # client processes that shared the load (loadtest/workers.py)
    started_at: float = 0.0  # perf_counter at the run start (times in records are relative to it)


class Observer(Protocol):
    def finished(self, record: RequestRecord) -> None: ...


class _NoObserver:
    def finished(self, record: RequestRecord) -> None:
        pass


def make_client(timeout_s: float) -> httpx.AsyncClient:
    # No connection cap: the load shape decides concurrency, the pool only reuses connections.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


async def run_load(endpoint: Endpoint, load: Load, bounds: Bounds, specs: Sequence[RequestSpec], *,
                   warmup_specs: Sequence[RequestSpec] = (), seed: int = 0,
                   observer: Observer | None = None, timeout_s: float = 600.0,
                   start_gate: Callable[[], None] | None = None) -> RunResult:
    """`start_gate`, if given, is called (in a thread) after the warm-up and before the clock
    starts: worker processes block there until all of them are warm (loadtest/workers.py)."""
    if not specs:
        raise ValueError("empty workload")
    obs = observer or _NoObserver()
    async with make_client(timeout_s) as client:
        if warmup_specs:
            await _warm_up(client, endpoint, warmup_specs, load)
        if start_gate is not None:
            await asyncio.to_thread(start_gate)
        clock_zero = time.perf_counter()
        records: list[RequestRecord] = []
        if load.kind == "concurrency":
            await _closed_loop(client, endpoint, load, bounds, specs, records, obs, clock_zero)
        else:
            await _open_loop(client, endpoint, load, bounds, specs, records, obs, clock_zero, seed)
    records.sort(key=lambda r: r.index)
    ends = [r.sent_s + (r.latency_s or 0.0) for r in records]
    return RunResult(load=load, duration_s=max(ends, default=0.0), records=records, started_at=clock_zero)


async def _warm_up(client: httpx.AsyncClient, endpoint: Endpoint, specs: Sequence[RequestSpec], load: Load) -> None:
    """Not counted: opens pooled connections and lets the server settle (graphs, caches)."""
    width = int(load.value) if load.kind == "concurrency" else (load.max_concurrency or len(specs))
    sem = asyncio.Semaphore(max(1, min(width, len(specs))))
    zero = time.perf_counter()

    async def one(i: int, spec: RequestSpec) -> None:
        async with sem:
            await send_request(client, endpoint, spec, RequestRecord(index=i, scheduled_s=0.0), zero)

    await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))


async def _closed_loop(client: httpx.AsyncClient, endpoint: Endpoint, load: Load, bounds: Bounds,
                       specs: Sequence[RequestSpec], records: list[RequestRecord], obs: Observer,
                       clock_zero: float) -> None:
    width = int(load.value)
    if width < 1:
        raise ValueError("concurrency must be >= 1")
    next_index = iter(range(10**12))

    async def worker(k: int) -> None:
        if load.ramp_up_s > 0:
            # Ramp-up: worker k joins at k/width of the ramp, so concurrency rises linearly.
            await asyncio.sleep(load.ramp_up_s * k / width)
        while True:
            free_at = time.perf_counter() - clock_zero
            if bounds.duration_s is not None and free_at >= bounds.duration_s:
                return
            i = next(next_index)
            if bounds.num_requests is not None and i >= bounds.num_requests:
                return
            record = RequestRecord(index=i, scheduled_s=free_at)
            await send_request(client, endpoint, specs[i % len(specs)], record, clock_zero)
            records.append(record)
            obs.finished(record)

    await asyncio.gather(*(worker(k) for k in range(width)))


async def _open_loop(client: httpx.AsyncClient, endpoint: Endpoint, load: Load, bounds: Bounds,
                     specs: Sequence[RequestSpec], records: list[RequestRecord], obs: Observer,
                     clock_zero: float, seed: int) -> None:
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def one(record: RequestRecord, spec: RequestSpec) -> None:
        if sem is None:
            await send_request(client, endpoint, spec, record, clock_zero)
        else:
            async with sem:  # waiting here shows up as send lag: the cap, not the client, is the limit
                await send_request(client, endpoint, spec, record, clock_zero)
        records.append(record)
        obs.finished(record)

    tasks: list[asyncio.Task[None]] = []
    offsets = arrival_offsets(load.value, burstiness=load.burstiness, seed=seed, ramp_up_s=load.ramp_up_s)
    for i, offset in enumerate(offsets):
        if bounds.num_requests is not None and i >= bounds.num_requests:
            break
        if bounds.duration_s is not None and offset >= bounds.duration_s:
            break
        delay = clock_zero + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(RequestRecord(index=i, scheduled_s=offset), specs[i % len(specs)])))
    await asyncio.gather(*tasks)
