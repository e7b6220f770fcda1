"""The rate limiter's contract, run on both backends: in memory and in a real redis-server.

The buckets refill continuously (limit / 60 per second), so counts read a few milliseconds apart
may have grown by a fraction; the limits below refill at most 1 unit per second, and each check
allows that one unit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from server.settings.keys_file import Tenant, TenantLimits
from server.tenants.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    MemoryRateLimiter,
    period_of,
    seconds_to_next_period,
)
from server.tenants.redis_limiter import RedisRateLimiter
from testbed.redis_server import RedisServer, start_redis


def tenant(name: str, **limits: object) -> Tenant:
    return Tenant(name, TenantLimits(**limits))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def redis_limiter(server: RedisServer, prefix: str, **kwargs: object) -> RedisRateLimiter:
    options: dict = {"timeout_s": 0.5, "retry_s": 5.0, "lease_s": 900.0, **kwargs}
    return RedisRateLimiter(server.url, prefix=prefix, **options)


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest, redis_server: RedisServer) -> AsyncIterator:
    if request.param == "memory":
        yield MemoryRateLimiter()
        return
    made = redis_limiter(redis_server, prefix=f"test-{request.node.name}")
    yield made
    await made.close()


@pytest.mark.timing
@pytest.mark.anyio
async def test_requests_per_minute(limiter) -> None:  # type: ignore[no-untyped-def]
    t = tenant("rpm", requests_per_minute=3)
    for left in (2, 1, 0):
        d = await limiter.acquire(t, 0)
        assert d.allowed and d.requests.limit == 3 and d.requests.remaining == left, d
        assert d.tokens is None and d.budget_used is None and d.slot is None
    refused = await limiter.acquire(t, 0)
    assert not refused.allowed and refused.reason == REQUESTS and not refused.never
    assert 19.0 < refused.retry_after_s <= 20.0, refused  # one request refills in 60 / 3 s
    assert refused.requests.remaining == 0 and 59.0 < refused.requests.reset_s <= 60.0
    again = await limiter.acquire(t, 0)  # a refused request took nothing
    assert not again.allowed and again.retry_after_s <= refused.retry_after_s
    other = await limiter.acquire(tenant("rpm-other", requests_per_minute=3), 0)
    assert other.allowed and other.requests.remaining == 2  # tenants count apart


@pytest.mark.timing
@pytest.mark.anyio
async def test_tokens_are_reserved_then_settled(limiter) -> None:  # type: ignore[no-untyped-def]
    t = tenant("tpm", tokens_per_minute=60)
    first = await limiter.acquire(t, 50)
    assert first.allowed and first.tokens.remaining in (10, 11)
    refused = await limiter.acquire(t, 20)
    assert not refused.allowed and refused.reason == TOKENS and not refused.never
    assert 8.0 < refused.retry_after_s <= 10.0  # 10 more tokens at 1 token/s
    await limiter.settle(first, 30)  # used 30 of the 50 reserved: 20 come back
    second = await limiter.acquire(t, 20)
    assert second.allowed and second.tokens.remaining in (10, 11, 12)
    await limiter.settle(second, 45)  # a request may use more than it reserved: the bucket goes below 0
    short = await limiter.acquire(t, 1)
    assert not short.allowed and short.tokens.remaining == 0 and short.retry_after_s > 10


@pytest.mark.anyio
async def test_a_request_larger_than_the_limit_is_refused_for_good(limiter) -> None:  # type: ignore[no-untyped-def]
    d = await limiter.acquire(tenant("big", tokens_per_minute=60, requests_per_minute=5), 61)
    assert not d.allowed and d.reason == TOKENS and d.never
    after = await limiter.acquire(tenant("big", tokens_per_minute=60, requests_per_minute=5), 60)
    assert after.allowed and after.requests.remaining == 4  # the refused one took no request either


@pytest.mark.anyio
async def test_budget_admits_while_not_spent_and_counts_whole_reservations(limiter) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    t = tenant("budget", budget_tokens=100)
    first = await limiter.acquire(t, 60)
    assert first.allowed and first.budget_held == 60 and first.budget_used == 60
    assert first.period == period_of(now, "month") and len(first.period) == 7
    # 40 left: a request reserving 50 is admitted; its share is the 40, the count takes all 50 so
    # that no other request is admitted on tokens this one may still use
    second = await limiter.acquire(t, 50)
    assert second.allowed and second.budget_held == 40 and second.budget_used == 110
    spent = await limiter.acquire(t, 1)
    assert not spent.allowed and spent.reason == BUDGET and not spent.never and spent.budget_used == 110
    assert abs(spent.retry_after_s - seconds_to_next_period(now, "month")) < 5
    assert await limiter.settle(first, 30) == 80  # used 30 of the 60 it reserved
    assert await limiter.settle(second, 45) == 75  # used 45 of its 50
    third = await limiter.acquire(t, 10)
    assert third.allowed and third.budget_held == 10 and third.budget_used == 85
    assert await limiter.settle(third, 10) == 85
    fourth = await limiter.acquire(t, 30)
    assert fourth.allowed and fourth.budget_held == 15
    assert await limiter.settle(fourth, 30) == 115  # past the budget by at most the last reservation
    assert (await limiter.acquire(t, 1)).reason == BUDGET


@pytest.mark.anyio
async def test_daily_budget_counts_per_day(limiter) -> None:  # type: ignore[no-untyped-def]
    d = await limiter.acquire(tenant("daily", budget_tokens=5, budget_period="day"), 5)
    assert d.allowed and d.period == period_of(time.time(), "day") and len(d.period) == 10
    refused = await limiter.acquire(tenant("daily", budget_tokens=5, budget_period="day"), 1)
    assert refused.reason == BUDGET and refused.retry_after_s <= 86400


@pytest.mark.anyio
async def test_budget_seeding_starts_a_period_once(limiter) -> None:  # type: ignore[no-untyped-def]
    t = tenant("seeded", budget_tokens=100)
    period = period_of(time.time(), "month")
    await limiter.seed_budget("seeded", period, 100)
    await limiter.seed_budget("seeded", period, 0)  # already counting: a second seed changes nothing
    refused = await limiter.acquire(t, 10)
    assert not refused.allowed and refused.reason == BUDGET and refused.budget_used == 100


@pytest.mark.anyio
async def test_max_concurrent_counts_running_requests(limiter) -> None:  # type: ignore[no-untyped-def]
    t = tenant("conc", max_concurrent=2, tokens_per_minute=1000)
    a, b = await limiter.acquire(t, 5), await limiter.acquire(t, 5)
    assert a.allowed and b.allowed and a.slot and b.slot
    if isinstance(limiter, RedisRateLimiter):
        assert a.slot != b.slot  # each a member of the tenant's set of running requests
    refused = await limiter.acquire(t, 5)
    assert not refused.allowed and refused.reason == CONCURRENCY and refused.retry_after_s == 1.0
    assert refused.tokens.remaining in (990, 991)  # a refused request took no tokens
    await limiter.settle(a, 5)
    c = await limiter.acquire(t, 5)
    assert c.allowed
    for d in (b, c):
        await limiter.settle(d, 5)
    assert all([(await limiter.acquire(t, 1)).allowed, (await limiter.acquire(t, 1)).allowed])


@pytest.mark.anyio
async def test_instances_sharing_redis_share_the_limits(redis_server: RedisServer) -> None:
    a, b = (redis_limiter(redis_server, prefix="shared") for _ in range(2))
    try:
        t = tenant("shared", requests_per_minute=3, budget_tokens=100, max_concurrent=2)
        first = await a.acquire(t, 30)
        second = await b.acquire(t, 30)
        assert first.allowed and second.allowed and second.budget_used == 60 and second.requests.remaining == 1
        third = await a.acquire(t, 1)
        assert not third.allowed and third.reason == CONCURRENCY  # two running, on two instances
        assert await a.settle(second, 10) == 40  # settled by another instance than the one that admitted
        fourth = await b.acquire(t, 1)
        assert fourth.allowed and fourth.requests.remaining == 0
        assert (await a.acquire(t, 1)).reason in (CONCURRENCY, REQUESTS)
        # the keys carry the tenant as a hash tag, under the prefix, and expire
        keys = sorted(k.decode() for k in await a.client.keys("shared:*"))
        assert keys == [f"shared:{{shared}}:budget:{first.period}", "shared:{shared}:requests",
                        "shared:{shared}:running"]
        assert 0 < await a.client.pttl("shared:{shared}:requests") <= 61_000
        assert 0 < await a.client.pttl("shared:{shared}:running") <= 900_000
    finally:
        await a.close()
        await b.close()


@pytest.mark.anyio
async def test_a_dead_instances_slots_free_when_their_lease_ends(redis_server: RedisServer) -> None:
    dead = redis_limiter(redis_server, prefix="lease", lease_s=0.3)
    alive = redis_limiter(redis_server, prefix="lease", lease_s=0.3)
    try:
        t = tenant("lease", max_concurrent=1)
        assert (await dead.acquire(t, 0)).allowed  # its instance never settles it
        assert (await alive.acquire(t, 0)).reason == CONCURRENCY
        await asyncio.sleep(0.4)
        assert (await alive.acquire(t, 0)).allowed
    finally:
        await dead.close()
        await alive.close()


@pytest.mark.anyio
async def test_without_redis_decisions_fall_back_to_memory_then_return(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = start_redis(tmp_path / "redis")
    limiter = redis_limiter(server, prefix="down", retry_s=0.3, timeout_s=0.2)
    try:
        t = tenant("down", requests_per_minute=2)
        assert (await limiter.acquire(t, 0)).backend == "redis"
        server.stop()
        with caplog.at_level(logging.WARNING, logger="llm_gateway.tenants"):
            degraded = await limiter.acquire(t, 0)
        assert "tenant limits are counted per instance for 0.3 s" in caplog.text  # fail open, and say so
        assert degraded.allowed and degraded.degraded and degraded.backend == "memory"
        assert degraded.requests.remaining == 1  # this instance's own count starts afresh
        assert (await limiter.acquire(t, 0)).degraded  # Redis is left alone for retry_s
        await limiter.settle(degraded, 0)  # settles where it was admitted, without touching Redis
        server.start()
        await asyncio.sleep(0.4)
        back = await limiter.acquire(t, 0)
        assert back.backend == "redis" and not back.degraded
        assert back.allowed and back.requests.remaining == 1  # a Redis restarted without persistence starts afresh
    finally:
        await limiter.close()
        server.stop()


# -- the bucket arithmetic on a controlled clock (memory only) -----------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.anyio
async def test_buckets_refill_continuously_and_periods_roll_over() -> None:
    clock = Clock(1_796_083_200.0 - 30)  # 2026-11-30 23:59:30 UTC
    limiter = MemoryRateLimiter(clock)
    t = tenant("clock", requests_per_minute=6, tokens_per_minute=600, budget_tokens=1000)
    d = await limiter.acquire(t, 600)
    assert d.allowed and d.tokens.remaining == 0 and d.tokens.reset_s == pytest.approx(60)
    assert d.requests.remaining == 5 and d.requests.reset_s == pytest.approx(10)
    clock.now += 3  # 30 tokens and 0.3 requests back
    refused = await limiter.acquire(t, 40)
    assert refused.reason == TOKENS and refused.retry_after_s == pytest.approx(1.0)
    clock.now += 1
    d2 = await limiter.acquire(t, 40)
    assert d2.allowed and d2.tokens.remaining == 0 and d2.requests.remaining == 4
    assert d2.budget_used == 640 and d2.period == "2026-11"
    clock.now += 27  # into December: a new budget period
    d3 = await limiter.acquire(t, 100)
    assert d3.allowed and d3.period == "2026-12" and d3.budget_used == 100
    assert await limiter.settle(d2, 40) == 640  # settles into the period it was admitted in
    clock.now += 600
    full = await limiter.acquire(t, 1)
    assert full.tokens.remaining == 599 and full.requests.remaining == 5  # capped at the limit
    assert seconds_to_next_period(clock.now, "day") == pytest.approx(86400 - 601)  # 00:10:01 UTC
