"""The rate limiter in Redis: the same buckets and quota counters as MemoryRateLimiter, shared by
every gateway instance that uses the same Redis.

Each decision is one Lua script (atomic in Redis) that reads Redis's own clock, so instances with
skewed clocks still agree. Keys: `<prefix>:{<tenant>}:requests` and `...:tokens` (hashes of level
and time, expiring once the bucket would be full again) and `...:quota:<YYYY-MM>` (a counter kept
for 40 days). The `{tenant}` hash tag keeps one tenant's keys in one Redis Cluster slot.

When Redis fails (down, slow beyond `redis_timeout_s`), the request is decided by an in-memory
limiter instead (`on_redis_error: per-instance`) or refused with 503 (`reject`), and Redis is
left alone for `redis_retry_s` before it is tried again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from server.errors import ServiceUnavailableError
from server.tenants.keys import Tenant
from server.tenants.limiter import (
    QUOTA,
    REQUESTS,
    TOKENS,
    Bucket,
    Decision,
    MemoryRateLimiter,
    period_of,
    seconds_to_next_period,
)

logger = logging.getLogger("llm_gateway.tenants")

QUOTA_TTL_S = 40 * 24 * 3600

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
-- KEYS: requests bucket, tokens bucket, quota counter
-- ARGV: requests/min, tokens/min, monthly tokens (0 = no such limit), tokens to reserve, quota ttl
local rpm, tpm, quota, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local req = rpm > 0 and level(KEYS[1], rpm, now) or 0
local tok = tpm > 0 and level(KEYS[2], tpm, now) or 0
local used = quota > 0 and tonumber(redis.call('GET', KEYS[3]) or '0') or -1
-- reason: 0 admitted, 1 requests, 2 tokens, 3 quota; never: the request alone exceeds the limit
local reason, never, wait = 0, 0, 0
if quota > 0 and used + need > quota then
  reason, never = 3, (need > quota) and 1 or 0
elseif tpm > 0 and need > tpm then
  reason, never = 2, 1
else
  local req_wait = rpm > 0 and wait_ms(req, 1, rpm) or 0
  local tok_wait = tpm > 0 and wait_ms(tok, need, tpm) or 0
  if req_wait > 0 or tok_wait > 0 then
    if req_wait >= tok_wait then reason, wait = 1, req_wait else reason, wait = 2, tok_wait end
  end
end
if reason == 0 then
  if rpm > 0 then req = req - 1; store(KEYS[1], req, rpm, now) end
  if tpm > 0 then tok = tok - need; store(KEYS[2], tok, tpm, now) end
  if quota > 0 then used = redis.call('INCRBY', KEYS[3], need); redis.call('EXPIRE', KEYS[3], ARGV[5]) end
end
local function reset_ms(value, limit) return limit > 0 and math.ceil(wait_ms(value, limit, limit)) or 0 end
return {reason, never, math.ceil(wait), math.floor(req), reset_ms(req, rpm), math.floor(tok), reset_ms(tok, tpm), used}
"""

SETTLE_LUA = _BUCKET_LUA + """
-- KEYS: tokens bucket, quota counter; ARGV: tokens/min (0 = none), quota on (0/1), tokens to give back, quota ttl
local tpm, give_back = tonumber(ARGV[1]), tonumber(ARGV[3])
if tpm > 0 then
  local now = now_ms()
  store(KEYS[1], math.min(level(KEYS[1], tpm, now) + give_back, tpm), tpm, now)
end
if tonumber(ARGV[2]) > 0 then
  local used = redis.call('DECRBY', KEYS[2], give_back)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return used
end
return -1
"""

REASON_CODES = {1: REQUESTS, 2: TOKENS, 3: QUOTA}


class RedisRateLimiter:
    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str,
        timeout_s: float,
        retry_s: float,
        on_error: str = "per-instance",
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
        self.on_error = on_error
        self.clock = clock
        self.fallback = MemoryRateLimiter(clock)
        self._acquire = self.client.register_script(ACQUIRE_LUA)
        self._settle = self.client.register_script(SETTLE_LUA)
        self._skip_until = 0.0
        self.errors = 0  # Redis calls that failed (read by the metrics)
        self._errors_exc = (redis.RedisError, OSError)

    def keys(self, tenant: str, period: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}"
        return [f"{base}:requests", f"{base}:tokens", f"{base}:quota:{period}"]

    def _redis_usable(self) -> bool:
        return self.clock() >= self._skip_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        self._skip_until = self.clock() + self.retry_s
        logger.warning("Redis %s failed (%s: %s); deciding %s for %g s", what, type(exc).__name__, exc,
                       "in this instance's memory" if self.on_error == "per-instance" else "nothing (503)",
                       self.retry_s)

    async def _without_redis(self, tenant: Tenant, tokens: int) -> Decision:
        if self.on_error == "reject":
            raise ServiceUnavailableError("the rate limiter's store (Redis) is unavailable; retry shortly",
                                          headers={"Retry-After": str(max(int(self.retry_s), 1))})
        decision = await self.fallback.acquire(tenant, tokens)
        decision.backend, decision.degraded = "memory", True
        return decision

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        if not self._redis_usable():
            return await self._without_redis(tenant, tokens)
        now = self.clock()
        period = period_of(now)
        limits = tenant.limits
        try:
            reply = await self._acquire(
                keys=self.keys(tenant.name, period),
                args=[limits.requests_per_minute or 0, limits.tokens_per_minute or 0,
                      limits.monthly_tokens or 0, tokens, QUOTA_TTL_S])
        except self._errors_exc as exc:
            self._failed("acquire", exc)
            return await self._without_redis(tenant, tokens)
        reason, never, wait_ms, req, req_reset, tok, tok_reset, used = (int(v) for v in reply)
        decision = Decision(tenant, tokens, allowed=reason == 0, period=period, backend=self.backend,
                            quota_used=used if limits.monthly_tokens else None)
        if reason:
            decision.reason = REASON_CODES[reason]
            decision.never = bool(never)
            decision.retry_after_s = seconds_to_next_period(now) if reason == 3 else wait_ms / 1000
        if limits.requests_per_minute:
            decision.requests = Bucket(limits.requests_per_minute, max(req, 0), req_reset / 1000)
        if limits.tokens_per_minute:
            decision.tokens = Bucket(limits.tokens_per_minute, max(tok, 0), tok_reset / 1000)
        return decision

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        if decision.degraded:
            return await self.fallback.settle(decision, used_tokens)
        limits = decision.tenant.limits
        if not limits.counts_tokens:
            return None
        _, tokens_key, quota_key = self.keys(decision.tenant.name, decision.period)
        try:
            used = await self._settle(
                keys=[tokens_key, quota_key],
                args=[limits.tokens_per_minute or 0, 1 if limits.monthly_tokens else 0,
                      decision.reserved - used_tokens, QUOTA_TTL_S])
        except self._errors_exc as exc:
            # The reservation stays taken: the tenant is charged its worst case, never less.
            self._failed("settle", exc)
            return None
        return int(used) if limits.monthly_tokens else None

    async def seed_quota(self, tenant: str, period: str, used: int) -> None:
        try:
            await self.client.set(self.keys(tenant, period)[2], used, nx=True, ex=QUOTA_TTL_S)
        except self._errors_exc as exc:
            self._failed("quota seeding", exc)
        await self.fallback.seed_quota(tenant, period, used)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except self._errors_exc as exc:
            self._failed("ping", exc)
            return False

    async def close(self) -> None:
        await self.client.aclose()
