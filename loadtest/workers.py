"""`--workers N`: share one load between N client processes and merge their records into one run.

One Python process (one event loop, one httpx pool) is itself the bottleneck at high
concurrency. Here the parent splits the load (concurrency, rate, request count, warm-up, the
prompt pool) into N parts, starts N processes with the `spawn` context, and each worker runs the
ordinary `run_load` on its part. A barrier after the warm-up makes all timed runs start together.
Workers send back their raw per-request records with the perf_counter value of their own start
(CLOCK_MONOTONIC on Linux: one clock for all processes), and the parent shifts them onto the
earliest start and builds ONE RunResult, summarized by the usual `metrics.summarize`: percentiles
over all requests of all workers, throughput over the merged wall-clock window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing as mp
import queue as queue_mod
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.client import Endpoint
from loadtest.records import RequestRecord, RequestSpec
from loadtest.runner import Bounds, Load, RunResult, run_load


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` integer shares, the remainder to the first ones: 10 over 3 -> [4, 3, 3]."""
    if parts < 1:
        raise ValueError("parts must be >= 1")
    base, extra = divmod(total, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def _chunks(items: Sequence[Any], parts: int) -> list[list[Any]]:
    out, start = [], 0
    for size in split(len(items), parts):
        out.append(list(items[start:start + size]))
        start += size
    return out


def validate(workers: int, *, concurrency: Sequence[float] | None, rate: Sequence[float] | None,
             max_concurrency: int | None, num_requests: int | None, burstiness: float) -> str | None:
    """Why `--workers` cannot be used with these options, or None. Each worker needs >= 1 of everything."""
    if workers < 1:
        return f"--workers must be >= 1, got {workers}"
    if workers == 1:
        return None
    if rate:
        if max_concurrency is not None and max_concurrency < workers:
            return (f"--workers {workers} needs --max-concurrency >= {workers} "
                    f"(it is split between the workers; got {max_concurrency})")
        if burstiness != 1.0:
            # N independent gamma processes do not add up to one with the same shape (the sum
            # tends to Poisson), so the requested burstiness could not be kept.
            return "--burstiness other than 1 cannot be split between --workers (use --workers 1)"
    else:
        values = [int(c) for c in (concurrency or [1.0])]
        if min(values) < workers:
            return (f"--workers {workers} needs --concurrency >= {workers} at every sweep point "
                    f"(each worker runs at least 1 in flight; got {min(values)})")
    if num_requests is not None and num_requests < workers:
        return f"--workers {workers} needs --num-requests >= {workers} (got {num_requests})"
    return None


@dataclass(frozen=True)
class WorkerJob:
    """Everything one worker process needs (picklable: it crosses the spawn boundary)."""

    worker: int
    endpoint: Endpoint
    load: Load
    bounds: Bounds
    specs: list[RequestSpec]
    warmup_specs: list[RequestSpec]
    seed: int
    timeout_s: float


@dataclass
class WorkerResult:
    worker: int
    started_at: float  # perf_counter at the worker's timed start
    records: list[RequestRecord] = field(default_factory=list)
    error: str | None = None


def split_load(load: Load, workers: int) -> list[Load]:
    """Concurrency (and --max-concurrency) in integer shares; a rate in equal parts; ramp-up as is."""
    if load.kind == "concurrency":
        return [dataclasses.replace(load, value=float(c)) for c in split(int(load.value), workers)]
    caps: list[int | None] = (list(split(load.max_concurrency, workers)) if load.max_concurrency
                              else [None] * workers)
    rate = load.value if math.isinf(load.value) else load.value / workers
    return [dataclasses.replace(load, value=rate, max_concurrency=cap) for cap in caps]


def plan(endpoint: Endpoint, load: Load, bounds: Bounds, specs: Sequence[RequestSpec], *, workers: int,
         warmup_specs: Sequence[RequestSpec] = (), seed: int = 0, timeout_s: float = 600.0) -> list[WorkerJob]:
    """The workers' jobs: disjoint slices of the prompt pool and of the warm-up, the count split,
    the duration for each, and distinct arrival seeds (worker 0 keeps `seed`)."""
    counts = split(bounds.num_requests, workers) if bounds.num_requests is not None else [None] * workers
    return [WorkerJob(worker=w, endpoint=endpoint, load=part, bounds=Bounds(counts[w], bounds.duration_s),
                      specs=pool, warmup_specs=warm, seed=seed + w, timeout_s=timeout_s)
            for w, (part, pool, warm) in enumerate(zip(split_load(load, workers), _chunks(specs, workers),
                                                      _chunks(warmup_specs, workers)))]


def merge(load: Load, results: Sequence[WorkerResult]) -> RunResult:
    """One run from the workers' records: times shifted onto the earliest worker start, records in
    order of scheduled time and renumbered. Summaries are then computed over all of them."""
    if not results:
        raise ValueError("no worker results")
    origin = min(r.started_at for r in results)
    merged: list[tuple[float, float, int, int, RequestRecord]] = []
    for res in results:
        shift = res.started_at - origin
        for rec in res.records:
            moved = dataclasses.replace(rec, scheduled_s=rec.scheduled_s + shift, sent_s=rec.sent_s + shift,
                                        itl_s=list(rec.itl_s))
            merged.append((moved.scheduled_s, moved.sent_s, res.worker, rec.index, moved))
    merged.sort(key=lambda t: t[:4])
    records = [t[4] for t in merged]
    for i, rec in enumerate(records):
        rec.index = i
    ends = [r.sent_s + (r.latency_s or 0.0) for r in records]
    return RunResult(load=load, duration_s=max(ends, default=0.0), records=records, workers=len(results),
                     started_at=origin)


def _worker_main(job: WorkerJob, barrier: Any, results: Any) -> None:
    """Entry point of a spawned worker process (module level, so `spawn` can import it)."""
    try:
        run = asyncio.run(run_load(job.endpoint, job.load, job.bounds, job.specs, warmup_specs=job.warmup_specs,
                                   seed=job.seed, timeout_s=job.timeout_s, start_gate=barrier.wait))
        results.put(WorkerResult(job.worker, run.started_at, run.records))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()  # the others must not wait for this one at the start line
        results.put(WorkerResult(job.worker, 0.0, error=f"{type(exc).__name__}: {exc}"))


def _error(results: dict[int, WorkerResult]) -> str | None:
    failed = [r for r in results.values() if r.error]
    if not failed:
        return None
    # A worker that failed by itself explains the others' broken barrier.
    failed.sort(key=lambda r: ("BrokenBarrierError" in (r.error or ""), r.worker))
    return f"worker {failed[0].worker}: {failed[0].error}"


def _drain(queue: Any, results: dict[int, WorkerResult], workers: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while len(results) < workers and (left := deadline - time.monotonic()) > 0:
        try:
            res = queue.get(timeout=left)
        except queue_mod.Empty:
            return
        results[res.worker] = res


def run_workers(endpoint: Endpoint, load: Load, bounds: Bounds, specs: Sequence[RequestSpec], *, workers: int,
                warmup_specs: Sequence[RequestSpec] = (), seed: int = 0, timeout_s: float = 600.0,
                on_done: Callable[[WorkerResult, WorkerJob], None] | None = None) -> RunResult:
    """Run `load` shared by `workers` spawned processes; `on_done` is told of each finished worker."""
    jobs = plan(endpoint, load, bounds, specs, workers=workers, warmup_specs=warmup_specs, seed=seed,
                timeout_s=timeout_s)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(workers)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(job, barrier, queue), name=f"loadtest-worker-{job.worker}",
                         daemon=True) for job in jobs]
    results: dict[int, WorkerResult] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < workers:
            try:
                res = queue.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [w for w, p in enumerate(procs) if w not in results and not p.is_alive()]
                if dead:
                    try:  # its result may have landed just after the timeout
                        res = queue.get(timeout=2.0)
                    except queue_mod.Empty:
                        for w in dead:
                            results[w] = WorkerResult(w, 0.0, error=f"exited with code {procs[w].exitcode}")
                        break
                else:
                    continue
            results[res.worker] = res
            if res.error:
                _drain(queue, results, workers, 2.0)  # the failing worker's own report, not just the others' broken barrier
                break
            if on_done is not None:
                on_done(res, jobs[res.worker])
    finally:
        # After a failure (or ^C) the run is void: stop the others instead of waiting for them.
        wait_s = 10.0 if len(results) == workers and _error(results) is None else 0.5
        for p in procs:
            p.join(timeout=wait_s)
            if p.is_alive():
                p.terminate()
                p.join()
    error = _error(results)
    if error:
        raise RuntimeError(error)
    return merge(load, [results[w] for w in range(workers)])
