"""The rate limiter in Redis: the same buckets, counts and budgets as MemoryRateLimiter, shared by
every gateway instance that uses the same Redis (`auth.redis_url`).

Each decision is one Lua script (atomic in Redis) that reads Redis's own clock, so instances with
skewed clocks still agree. Keys, under `auth.redis_key_prefix`, with the tenant as a Redis
Cluster hash tag: `{tenant}:requests` and `{tenant}:tokens` (hashes of level and time, expiring
once the bucket would be full again), `{tenant}:running` (a sorted set of the requests running
now, each expiring after `auth.concurrency_lease_s` in case its instance dies), and
`{tenant}:budget:<period>` (a counter kept 40 days).

Fail open: when Redis fails (down, or slower than `auth.redis_timeout_s`), the request is decided
by an in-memory limiter instead (limits then hold per instance), a warning is logged and
`Decision.degraded` lets the middleware count it; Redis is left alone for `auth.redis_retry_s`
before it is tried again.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable

from server.settings.keys_file import Tenant
from server.tenants.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    Bucket,
    Decision,
    MemoryRateLimiter,
    period_of,
    seconds_to_next_period,
)

logger = logging.getLogger("llm_gateway.tenants")

BUDGET_TTL_S = 40 * 24 * 3600
CONCURRENCY_RETRY_MS = 1000

# Levels are kept as floats; replies are integers (milli-units), as Redis truncates Lua numbers.
_BUCKET_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function level(key, limit, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  if not v[1] then return limit end
  return math.min(limit, tonumber(v[1]) + math.max(now - tonumber(v[2]), 0) * limit / 60000)
end
local function store(key, value, limit, now)
  redis.call('HSET', key, 'level', tostring(value), 'at', now)
  redis.call('PEXPIRE', key, math.ceil((limit - value) * 60000 / limit) + 1000)
end
local function wait_ms(value, need, limit)
  return math.max(need - value, 0) * 60000 / limit
end
"""

ACQUIRE_LUA = _BUCKET_LUA + """
-- KEYS: requests bucket, tokens bucket, budget counter, running set
-- ARGV: requests/min, tokens/min, budget, max concurrent (0 = no such limit), tokens to reserve,
--       slot name, concurrency lease (ms), budget ttl (s)
local rpm, tpm, budget, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need = tonumber(ARGV[5])
local now = now_ms()
local req = rpm > 0 and level(KEYS[1], rpm, now) or 0
local tok = tpm > 0 and level(KEYS[2], tpm, now) or 0
local used = budget > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') or -1
local running = 0
if most > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)  -- slots of instances that died
  running = redis.call('ZCARD', KEYS[4])
end
-- reason: 0 admitted, 1 requests, 2 tokens, 3 concurrency, 4 budget; never: larger than tokens/min
local reason, never, wait = 0, 0, 0
if budget > 0 and used >= budget then
  reason = 4
elseif most > 0 and running >= most then
  reason, wait = 3, tonumber(ARGV[9])
elseif tpm > 0 and need > tpm then
  reason, never = 2, 1
else
  local req_wait = rpm > 0 and wait_ms(req, 1, rpm) or 0
  local tok_wait = tpm > 0 and wait_ms(tok, need, tpm) or 0
  if req_wait > 0 or tok_wait > 0 then
    if req_wait >= tok_wait then reason, wait = 1, req_wait else reason, wait = 2, tok_wait end
  end
end
local held = 0
if reason == 0 then
  if rpm > 0 then req = req - 1; store(KEYS[1], req, rpm, now) end
  if tpm > 0 then tok = tok - need; store(KEYS[2], tok, tpm, now) end
  if budget > 0 then
    held = math.min(need, budget - used)
    used = redis.call('INCRBY', KEYS[3], need)
    redis.call('EXPIRE', KEYS[3], ARGV[8])
  end
  if most > 0 then
    local lease = tonumber(ARGV[7])
    redis.call('ZADD', KEYS[4], now + lease, ARGV[6])
    redis.call('PEXPIRE', KEYS[4], lease)
  end
end
local function reset_ms(value, limit) return limit > 0 and math.ceil(wait_ms(value, limit, limit)) or 0 end
return {reason, never, math.ceil(wait), math.floor(req), reset_ms(req, rpm), math.floor(tok), reset_ms(tok, tpm),
        used, held}
"""

SETTLE_LUA = _BUCKET_LUA + """
-- KEYS: tokens bucket, budget counter, running set
-- ARGV: tokens/min (0 = none), tokens to give back to it, budget on (0/1), tokens to add to the
--       budget (used - reserved), slot name ('' = none), budget ttl (s)
local tpm = tonumber(ARGV[1])
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[3], ARGV[5]) end
if tpm > 0 then
  local now = now_ms()
  store(KEYS[1], math.min(level(KEYS[1], tpm, now) + tonumber(ARGV[2]), tpm), tpm, now)
end
if tonumber(ARGV[3]) > 0 then
  local used = redis.call('INCRBY', KEYS[2], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[6])
  return used
end
return -1
"""

REASON_CODES = {1: REQUESTS, 2: TOKENS, 3: CONCURRENCY, 4: BUDGET}


class RedisRateLimiter:
    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        timeout_s: float,
        retry_s: float,
        lease_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: a request waits at most one timeout before it is decided without Redis.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 0))
        self.prefix = prefix
        self.retry_s = retry_s
        self.lease_ms = int(lease_s * 1000)
        self.clock = clock
        self.fallback = MemoryRateLimiter(clock)
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._settle = self.client.register_script(SETTLE_LUA)
        self._skip_until = 0.0
        self._errors = (redis.RedisError, OSError)
        self._instance = uuid.uuid4().hex[:12]
        self._slots = itertools.count()

    def keys(self, tenant: str, period: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}"
        return [f"{base}:requests", f"{base}:tokens", f"{base}:budget:{period}", f"{base}:running"]

    def _failed(self, what: str, exc: BaseException) -> None:
        self._skip_until = self.clock() + self.retry_s
        logger.warning("Redis %s failed (%s: %s): tenant limits are counted per instance for %g s",
                       what, type(exc).__name__, exc, self.retry_s)

    async def _in_memory(self, tenant: Tenant, tokens: int) -> Decision:
        decision = await self.fallback.acquire(tenant, tokens)
        decision.degraded = True
        return decision

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        if self.clock() < self._skip_until:
            return await self._in_memory(tenant, tokens)
        now = self.clock()
        limits = tenant.limits
        period = period_of(now, limits.budget_period) if limits.budget_tokens else ""
        slot = f"{self._instance}:{next(self._slots)}" if limits.max_concurrent else None
        try:
            reply = await self._acquire(
                keys=self.keys(tenant.name, period),
                args=[limits.requests_per_minute or 0, limits.tokens_per_minute or 0, limits.budget_tokens or 0,
                      limits.max_concurrent or 0, tokens, slot or "", self.lease_ms, BUDGET_TTL_S,
                      CONCURRENCY_RETRY_MS])
        except self._errors as exc:
            self._failed("acquire", exc)
            return await self._in_memory(tenant, tokens)
        reason, never, wait_ms, req, req_reset, tok, tok_reset, used, held = (int(v) for v in reply)
        decision = Decision(tenant, tokens, allowed=reason == 0, period=period, backend=self.backend,
                            budget_used=used if limits.budget_tokens else None, budget_held=held,
                            slot=slot if reason == 0 else None)
        if reason:
            decision.reason = REASON_CODES[reason]
            decision.never = bool(never)
            decision.retry_after_s = (seconds_to_next_period(now, limits.budget_period) if reason == 4
                                      else wait_ms / 1000)
        if limits.requests_per_minute:
            decision.requests = Bucket(limits.requests_per_minute, max(req, 0), req_reset / 1000)
        if limits.tokens_per_minute:
            decision.tokens = Bucket(limits.tokens_per_minute, max(tok, 0), tok_reset / 1000)
        return decision

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        if decision.degraded:
            return await self.fallback.settle(decision, used_tokens)
        limits = decision.tenant.limits
        _, tokens_key, budget_key, running_key = self.keys(decision.tenant.name, decision.period)
        try:
            used = await self._settle(
                keys=[tokens_key, budget_key, running_key],
                args=[limits.tokens_per_minute or 0, decision.reserved - used_tokens,
                      1 if limits.budget_tokens else 0, used_tokens - decision.reserved,
                      decision.slot or "", BUDGET_TTL_S])
        except self._errors as exc:
            # The reservation stays taken (the tenant is charged its worst case, never less) and
            # the slot frees itself when its lease ends.
            self._failed("settle", exc)
            return None
        return int(used) if limits.budget_tokens else None

    async def seed_budget(self, tenant: str, period: str, used: int) -> None:
        try:
            await self.client.set(self.keys(tenant, period)[2], used, nx=True, ex=BUDGET_TTL_S)
        except self._errors as exc:
            self._failed("budget seeding", exc)
        await self.fallback.seed_budget(tenant, period, used)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except self._errors as exc:
            self._failed("ping", exc)
            return False

    async def close(self) -> None:
        await self.client.aclose()
