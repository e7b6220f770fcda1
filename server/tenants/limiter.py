"""The rate limiter: one small Protocol, and the in-memory implementation (one instance's view).

Per tenant:
- `requests_per_minute` and `tokens_per_minute` are buckets the size of the limit, refilled
  continuously (limit / 60 per second) and starting full. A request takes 1 request, and its
  reservation in tokens (`server.tenants.reservation`) when it starts; when it ends it gets back
  the tokens it did not use (or takes the ones it used beyond it).
- `max_concurrent` counts the tenant's requests running now.
- `budget_tokens` is a counter per UTC day or month. A request is admitted while the count is
  below the budget, and adds its whole reservation to it; when it ends that becomes what it
  really used. The count so always covers every admitted request's worst case, so a burst of any
  size spends at most the budget plus one request's reservation (the last one admitted). Its
  share, `budget_held` = min(its reservation, what was left), is where
  `auth.end_streams_over_budget` ends a stream that runs past it.
A refused request takes nothing. `server.tenants.redis_limiter` keeps the same state in Redis.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from server.settings.keys_file import Tenant

# Why a request was refused (Decision.reason).
REQUESTS = "requests"
TOKENS = "tokens"
CONCURRENCY = "concurrency"
BUDGET = "budget"
REASONS = (REQUESTS, TOKENS, CONCURRENCY, BUDGET)
CONCURRENCY_RETRY_S = 1.0  # a slot frees when one of the tenant's requests ends: no better guess


@dataclass(frozen=True)
class Bucket:
    """A per-minute limit's state after a decision, for the x-ratelimit-* headers."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass
class Decision:
    """A limiter's answer; when allowed, also the ticket `settle` takes back."""

    tenant: Tenant
    reserved: int  # tokens taken from tokens_per_minute
    allowed: bool
    reason: str | None = None  # one of REASONS when refused
    retry_after_s: float = 0.0
    never: bool = False  # the request alone exceeds tokens_per_minute: retrying cannot help
    requests: Bucket | None = None
    tokens: Bucket | None = None
    budget_held: int = 0  # its share of the budget: min(reserved, what was left)
    budget_used: int | None = None  # the period's count after this decision (reservations included)
    period: str = ""  # the budget period it counts in: YYYY-MM-DD or YYYY-MM
    slot: str | None = None  # the request's max_concurrent slot (Redis: a member of a sorted set)
    backend: str = "memory"
    degraded: bool = False  # decided in memory because Redis failed
    settled: bool = field(default=False, repr=False)


class RateLimiter(Protocol):
    """What the middleware asks. Implementations: MemoryRateLimiter, RedisRateLimiter."""

    backend: str

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        """Admit one request reserving `tokens`, or refuse it without taking anything."""

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        """An admitted request ended having used `used_tokens`: give back or take the difference,
        free its concurrency slot; the budget's count after it (None without a budget)."""

    async def seed_budget(self, tenant: str, period: str, used: int) -> None:
        """Start a period's budget count from the usage store, unless it is already counting."""

    async def close(self) -> None: ...


def period_of(now: float, per: str) -> str:
    """The budget period `now` falls in: "2026-12-01" (per day) or "2026-12" (per month), UTC."""
    return _period_of_minute(int(now // 60), per)


@functools.lru_cache(maxsize=8)
def _period_of_minute(minute: int, per: str) -> str:
    # Asked on every request; periods start on whole minutes, so one answer serves a minute.
    return datetime.fromtimestamp(minute * 60, timezone.utc).strftime("%Y-%m-%d" if per == "day" else "%Y-%m")


def seconds_to_next_period(now: float, per: str) -> float:
    moment = datetime.fromtimestamp(now, timezone.utc)
    if per == "day":
        start = datetime(moment.year, moment.month, moment.day, tzinfo=timezone.utc).timestamp()
        return start + 86400 - now
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp() - now


def refilled(level: float, since_s: float, limit: int) -> float:
    return min(float(limit), level + max(since_s, 0.0) * limit / 60.0)


def seconds_until(level: float, need: float, limit: int) -> float:
    return max(need - level, 0.0) * 60.0 / limit


def bucket_view(level: float, limit: int) -> Bucket:
    return Bucket(limit, max(math.floor(level), 0), seconds_until(level, limit, limit))


def refusal(tenant: Tenant, tokens: int, *, budget_used: int | None, in_flight: int | None, now: float,
            request_wait: float | None, token_wait: float | None) -> tuple[str, float, bool] | None:
    """(reason, retry after, never) when the request cannot be admitted now, else None.

    The order: a spent budget first (retrying soon cannot help), then the concurrency limit, a
    request larger than tokens_per_minute, and the per-minute buckets."""
    limits = tenant.limits
    if limits.budget_tokens is not None and budget_used is not None and budget_used >= limits.budget_tokens:
        return BUDGET, seconds_to_next_period(now, limits.budget_period), False
    if limits.max_concurrent is not None and in_flight is not None and in_flight >= limits.max_concurrent:
        return CONCURRENCY, CONCURRENCY_RETRY_S, False
    if limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute:
        return TOKENS, 0.0, True
    request_wait, token_wait = request_wait or 0.0, token_wait or 0.0
    if request_wait > 0 or token_wait > 0:
        return (REQUESTS, request_wait, False) if request_wait >= token_wait else (TOKENS, token_wait, False)
    return None


class MemoryRateLimiter:
    """Buckets, counts and budgets in this process (asyncio: each call runs without interruption)."""

    backend = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._levels: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, kind) -> (level, at)
        self._budget: dict[tuple[str, str], int] = {}  # (tenant, period) -> tokens
        self._in_flight: dict[str, int] = {}

    def _level(self, tenant: str, kind: str, limit: int, now: float) -> float:
        level, at = self._levels.get((tenant, kind), (float(limit), now))
        return refilled(level, now - at, limit)

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        now = self.clock()
        limits, name = tenant.limits, tenant.name
        rpm, tpm, budget = limits.requests_per_minute, limits.tokens_per_minute, limits.budget_tokens
        period = period_of(now, limits.budget_period) if budget else ""
        req_level = self._level(name, REQUESTS, rpm, now) if rpm else None
        tok_level = self._level(name, TOKENS, tpm, now) if tpm else None
        used = self._budget.get((name, period), 0) if budget else None
        in_flight = self._in_flight.get(name, 0) if limits.max_concurrent else None
        refused = refusal(
            tenant, tokens, budget_used=used, in_flight=in_flight, now=now,
            request_wait=seconds_until(req_level, 1, rpm) if rpm else None,
            token_wait=seconds_until(tok_level, tokens, tpm) if tpm else None)
        decision = Decision(tenant, tokens, allowed=refused is None, period=period, budget_used=used)
        if refused is None:
            if rpm:
                req_level -= 1
                self._levels[(name, REQUESTS)] = (req_level, now)
            if tpm:
                tok_level -= tokens
                self._levels[(name, TOKENS)] = (tok_level, now)
            if budget and used is not None:
                decision.budget_held = min(tokens, budget - used)
                decision.budget_used = self._budget[(name, period)] = used + tokens
            if in_flight is not None:
                self._in_flight[name] = in_flight + 1
                decision.slot = name
        else:
            decision.reason, decision.retry_after_s, decision.never = refused
        decision.requests = bucket_view(req_level, rpm) if rpm else None
        decision.tokens = bucket_view(tok_level, tpm) if tpm else None
        return decision

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        name, limits = decision.tenant.name, decision.tenant.limits
        if decision.slot is not None:
            self._in_flight[name] = max(self._in_flight.get(name, 0) - 1, 0)
        if limits.tokens_per_minute:
            now = self.clock()
            level = self._level(name, TOKENS, limits.tokens_per_minute, now)
            self._levels[(name, TOKENS)] = (
                min(level + decision.reserved - used_tokens, float(limits.tokens_per_minute)), now)
        if limits.budget_tokens:
            key = (name, decision.period)
            self._budget[key] = self._budget.get(key, 0) + used_tokens - decision.reserved
            return self._budget[key]
        return None

    async def seed_budget(self, tenant: str, period: str, used: int) -> None:
        self._budget.setdefault((tenant, period), used)

    async def close(self) -> None:
        pass
