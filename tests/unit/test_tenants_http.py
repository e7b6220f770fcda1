"""Tenants through the HTTP layer with a scripted engine: 429 shapes and headers, settlement with
the real usage, the usage store, keys-file reloads, quotas across a restart."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.app import build_app
from server.holder import EngineHolder
from server.settings import EngineProfile, Settings
from server.tenants.limiter import seconds_to_next_period
from server.tenants.service import Tenancy
from tests.fakes import FakeEngine
from tests.unit.test_metrics import get, snapshot

ADMIN = {"Authorization": "Bearer sk-admin"}
KEYS = """
tenants:
  rpm: {keys: [sk-rpm], requests_per_minute: 2}
  tpm: {keys: [sk-tpm], tokens_per_minute: 60}
  quota: {keys: [sk-quota], monthly_tokens: 40}
  free: {keys: [sk-free]}
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Gateway:
    """build_app on a scripted engine (context 64 tokens), with a keys file and a usage store."""

    def __init__(self, tmp_path: Path, keys: str | None = KEYS, **tenants: object) -> None:
        self.keys_path = tmp_path / "keys.yaml"
        if keys is not None:
            self.keys_path.write_text(keys)
            tenants = {"keys_file": self.keys_path, "usage_db": tmp_path / "usage.sqlite3", **tenants}
        self.settings = Settings(
            engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"),
            auth={"admin_keys": ["sk-admin"]}, tenants=tenants, server={"state_dir": tmp_path / "state"})
        self.engine = FakeEngine()

        async def factory(_: Settings) -> FakeEngine:
            return self.engine

        self.holder = EngineHolder(self.settings, factory)
        self.app = build_app(self.settings, self.holder, registry=CollectorRegistry())
        self.tenancy: Tenancy = self.app.state.tenancy
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test")

    async def __aenter__(self) -> Gateway:
        await self.holder.start()
        await self.tenancy.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tenancy.stop()
        await self.client.aclose()

    async def complete(self, key: str, **body: object) -> httpx.Response:
        return await self.client.post("/v1/completions", json={"model": "fake", **body}, headers=bearer(key))

    def metrics(self) -> dict:
        return snapshot(self.app.state.metrics)


def assert_429(r: httpx.Response, code: str) -> dict:
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "RateLimitError" and error["code"] == code
    return error


@pytest.mark.anyio
async def test_requests_per_minute_headers_and_429(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        for left in ("1", "0"):
            r = await gw.complete("sk-rpm", prompt=[1, 2], max_tokens=2)
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests"] == "2"
            assert r.headers["x-ratelimit-remaining-requests"] == left
            assert "x-ratelimit-limit-tokens" not in r.headers  # the tenant has no token limit
        r = await gw.complete("sk-rpm", prompt=[1, 2], max_tokens=2)
        error = assert_429(r, "rate_limit_exceeded")
        assert error["message"].startswith("Rate limit reached for tenant rpm on requests per min (RPM): Limit 2")
        assert int(r.headers["retry-after"]) in (29, 30) and 29_000 < int(r.headers["retry-after-ms"]) <= 30_000
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-should-retry" not in r.headers  # retrying later helps
        # another tenant is not affected; one without limits gets no x-ratelimit headers
        free = await gw.complete("sk-free", prompt=[1, 2], max_tokens=2)
        assert free.status_code == 200 and not any(h.startswith("x-ratelimit") for h in free.headers)
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_rate_limited_total", tenant="rpm", reason="requests") == 1
        assert get(snap, "gateway_tenant_requests_total", tenant="rpm", status="200") == 2
        assert get(snap, "gateway_tenant_requests_total", tenant="rpm", status="429") == 1
        assert get(snap, "gateway_rejections_total", reason="rate_limit") == 1
        assert get(snap, "gateway_rejections_total", reason="overload") == 0


@pytest.mark.anyio
async def test_tokens_reserve_max_tokens_and_settle_with_real_usage(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        # reserves 10 + 30; the fake engine really generates max_tokens, so it uses all of it
        r = await gw.complete("sk-tpm", prompt=list(range(10)), max_tokens=30)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 40
        assert r.headers["x-ratelimit-remaining-tokens"] in ("20", "21")
        # 10 + 30 more is more than is left: 429 naming the tokens
        r = await gw.complete("sk-tpm", prompt=list(range(10)), max_tokens=30)
        error = assert_429(r, "rate_limit_exceeded")
        assert "on tokens per min (TPM): Limit 60" in error["message"] and "Requested 40" in error["message"]
        assert 15 <= int(r.headers["retry-after"]) <= 20  # 20 more tokens at 1 token/s
        # without max_tokens the whole context (64) is reserved: more than the limit, refused for good
        r = await gw.complete("sk-tpm", prompt=[1, 2])
        error = assert_429(r, "rate_limit_exceeded")
        assert error["param"] == "max_tokens" and error["message"].startswith("Request too large")
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
        # a stream that stops early gives back what it did not use: reserve 2 + 15, use 2 + 3
        gw.engine.fail_after = 3
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=15, stream=True)
        assert r.status_code == 200 and '"error"' in r.text
        gw.engine.fail_after = None
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=1)
        assert int(r.headers["x-ratelimit-remaining-tokens"]) in range(12, 16)  # 20 - 5 - 3, plus refill
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_tokens_total", tenant="tpm", kind="prompt") == 10 + 2 + 2
        assert get(snap, "gateway_tenant_tokens_total", tenant="tpm", kind="completion") == 30 + 3 + 1


@pytest.mark.anyio
async def test_quota_is_insufficient_quota_and_not_retried(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        for _ in range(2):  # 2 x (5 + 10) of 40
            assert (await gw.complete("sk-quota", prompt=[1] * 5, max_tokens=10)).status_code == 200
        r = await gw.complete("sk-quota", prompt=[1] * 5, max_tokens=10)
        error = assert_429(r, "insufficient_quota")
        assert error["message"].startswith("You exceeded your current quota: tenant quota has used 30 of its 40 tokens")
        assert r.headers["x-should-retry"] == "false"
        assert abs(int(r.headers["retry-after"]) - math.ceil(seconds_to_next_period(time.time()))) <= 5
        # a smaller request still fits in what is left
        assert (await gw.complete("sk-quota", prompt=[1] * 5, max_tokens=5)).status_code == 200
        r = await gw.complete("sk-quota", prompt=[1], max_tokens=1)
        assert_429(r, "insufficient_quota")
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_quota_tokens", tenant="quota") == 40
        assert get(snap, "gateway_tenant_quota_used_tokens", tenant="quota") == 40
        assert get(snap, "gateway_tenant_rate_limited_total", tenant="quota", reason="quota") == 2
        assert get(snap, "gateway_rejections_total", reason="quota") == 2


@pytest.mark.anyio
async def test_usage_store_and_admin_report(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        for _ in range(3):
            await gw.complete("sk-rpm", prompt=[1, 2, 3], max_tokens=4)
        await gw.client.post("/v1/chat/completions", headers=bearer("sk-free"),
                             json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2})
        r = await gw.client.get("/admin/usage", headers=ADMIN)
        assert r.status_code == 200
        report = r.json()
        today = time.strftime("%Y-%m-%d", time.gmtime())
        rows = {row["tenant"]: row for row in report["data"]}
        assert rows["rpm"] == {"tenant": "rpm", "day": today, "requests": 2, "rate_limited": 1,
                               "prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
        assert rows["free"]["requests"] == 1 and rows["free"]["completion_tokens"] == 2
        assert report["tenants"]["rpm"]["limits"]["requests_per_minute"] == 2
        assert report["tenants"]["rpm"]["month"]["total_tokens"] == 14
        assert report["tenants"]["quota"]["requests"] == 0  # listed with zeros
        only = (await gw.client.get("/admin/usage", params={"tenant": "free", "since": today},
                                    headers=ADMIN)).json()
        assert [row["tenant"] for row in only["data"]] == ["free"] and list(only["tenants"]) == ["free"]
        assert (await gw.client.get("/admin/usage", params={"until": "2000-01-01"}, headers=ADMIN)).json()["data"] == []
        bad = await gw.client.get("/admin/usage", params={"since": "yesterday"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
        assert (await gw.client.get("/admin/usage", headers=bearer("sk-free"))).status_code == 401


@pytest.mark.anyio
async def test_quota_survives_a_restart_through_the_usage_store(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        assert (await gw.complete("sk-quota", prompt=[1] * 5, max_tokens=30)).status_code == 200
    async with Gateway(tmp_path) as again:  # same usage store: the month's 35 tokens are counted
        assert_429(await again.complete("sk-quota", prompt=[1] * 5, max_tokens=5), "insufficient_quota")
        assert (await again.complete("sk-quota", prompt=[1] * 2, max_tokens=3)).status_code == 200


@pytest.mark.anyio
async def test_keys_file_reload_and_a_refused_one(tmp_path: Path) -> None:
    async with Gateway(tmp_path, watch_interval_s=0.05) as gw:
        assert (await gw.complete("sk-new", prompt=[1], max_tokens=1)).status_code == 401
        gw.keys_path.write_text(KEYS.replace("sk-free", "sk-new") + "  extra: {keys: [sk-extra], monthly_tokens: 3}\n")

        async def status(key: str) -> int:
            return (await gw.complete(key, prompt=[1], max_tokens=1)).status_code

        for _ in range(100):  # the watcher polls every 50 ms
            if await status("sk-new") == 200:
                break
            await asyncio.sleep(0.05)
        assert await status("sk-new") == 200 and await status("sk-free") == 401
        assert await status("sk-extra") == 200
        assert get(gw.metrics(), "gateway_tenant_quota_tokens", tenant="extra") == 3
        gw.keys_path.write_text("tenants: {broken: {keys: [sk-broken], requests_per_minute: -1}}\n")
        for _ in range(100):
            if get(gw.metrics(), "gateway_tenant_keys_reloads_total", outcome="failure"):
                break
            await asyncio.sleep(0.05)
        assert get(gw.metrics(), "gateway_tenant_keys_reloads_total", outcome="failure") == 1
        assert await status("sk-new") == 200 and await status("sk-broken") == 401  # the previous keys stay
        assert get(gw.metrics(), "gateway_tenant_keys_reloads_total", outcome="success") == 1


@pytest.mark.anyio
async def test_open_api_is_the_default_tenant_and_stores_nothing(tmp_path: Path) -> None:
    async with Gateway(tmp_path, keys=None) as gw:
        r = await gw.client.post("/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and not any(h.startswith("x-ratelimit") for h in r.headers)
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_requests_total", tenant="default", status="200") == 1
        assert get(snap, "gateway_tenant_tokens_total", tenant="default", kind="completion") == 3
        assert not gw.tenancy.enabled and not list(tmp_path.rglob("*.sqlite3"))
        assert (await gw.client.get("/admin/usage", headers=ADMIN)).json() == {
            "object": "list", "data": [], "tenants": {}}


@pytest.mark.anyio
async def test_bodies_the_limiter_reads_still_get_their_4xx(tmp_path: Path) -> None:
    async with Gateway(tmp_path) as gw:
        r = await gw.client.post("/v1/completions", content=b'{"prompt": [1, 2',
                                 headers={**bearer("sk-tpm"), "content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        big = json.dumps({"prompt": "x" * (9 * 2**20)}).encode()
        r = await gw.client.post("/v1/completions", content=big, headers=bearer("sk-tpm"))
        assert r.status_code == 413
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=-1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert r.headers["x-ratelimit-remaining-tokens"] in ("57", "58", "59", "60")  # only the prompt reserved, then given back


@pytest.mark.anyio
async def test_redis_unreachable_with_reject_is_503(tmp_path: Path) -> None:
    from tests.conftest import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with Gateway(tmp_path, limiter="redis", redis_url=url, on_redis_error="reject",
                       redis_timeout_s=0.2) as gw:
        r = await gw.complete("sk-rpm", prompt=[1], max_tokens=1)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert (await gw.complete("sk-free", prompt=[1], max_tokens=1)).status_code == 200  # no limits: no Redis
        assert get(gw.metrics(), "gateway_tenant_limiter_degraded_total") == 1
