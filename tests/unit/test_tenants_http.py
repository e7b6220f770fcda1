"""Tenants through the HTTP layer with a scripted engine: 429/404 shapes and headers, settlement
with the real usage, budgets (also across a restart), concurrency, ending streams over budget,
the usage store, and keys-file reloads that leave the engine alone."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from server.app import build_app
from server.errors import InvalidRequestError
from server.lifecycle.holder import EngineHolder
from server.metrics import GatewayMetrics
from server.runner.gateway import Gateway
from server.settings import EngineProfile, Settings
from server.settings.schema import deep_merge
from server.tenants.limiter import period_of, seconds_to_next_period
from server.tenants.service import Tenancy
from testbed.fakes import FakeEngine
from tests.unit.test_metrics import get, snapshot

ADMIN = {"Authorization": "Bearer sk-admin"}
KEYS = """
keys:
  - {name: rpm, key: sk-rpm, requests_per_minute: 2}
  - {name: tpm, key: sk-tpm, tokens_per_minute: 60}
  - {name: budget, key: sk-budget, budget_tokens: 40}
  - {name: few, key: sk-few, max_concurrent: 2}
  - {name: other-model, key: sk-other, models: [not-served]}
  - {name: fake-only, key: sk-fake, models: [fake]}
  - {name: free, key: sk-free}
"""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settings_for(tmp_path: Path, keys: str | None, **auth: Any) -> Settings:
    keys_path = tmp_path / "keys.yaml"
    if keys is not None:
        if not keys_path.exists():
            keys_path.write_text(keys)
        auth = {"keys_file": keys_path, "usage_db": tmp_path / "usage.sqlite3", **auth}
    # load_format dummy: reloads do not look for the model's files (the scripted engine has none)
    return Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake",
                                         load_format="dummy"),
                    auth={"admin_keys": ["sk-admin"], **auth}, server={"state_dir": tmp_path / "state"})


class Gateway_:
    """build_app on a scripted engine (context 64 tokens), with a keys file and a usage store; a
    test may bring its own settings and engine."""

    def __init__(self, tmp_path: Path, keys: str | None = KEYS, *, settings: Settings | None = None,
                 engine: FakeEngine | None = None, **auth: Any) -> None:
        self.keys_path = tmp_path / "keys.yaml"
        self.settings = settings if settings is not None else settings_for(tmp_path, keys, **auth)
        self.engine = engine if engine is not None else FakeEngine()

        async def factory(_: Settings) -> FakeEngine:
            return self.engine

        self.holder = EngineHolder(self.settings, factory)
        self.gateway_metrics = GatewayMetrics(CollectorRegistry())
        self.tenancy = Tenancy(self.settings)
        self.app = build_app(self.settings, self.holder, self.gateway_metrics, self.tenancy)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test",
                                        timeout=30)

    async def __aenter__(self) -> Gateway_:
        await self.holder.start()
        await self.tenancy.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.tenancy.stop()
        await self.client.aclose()

    async def complete(self, key: str, **body: object) -> httpx.Response:
        return await self.client.post("/v1/completions", json={"model": "fake", **body}, headers=bearer(key))

    def metrics(self) -> dict:
        return snapshot(self.gateway_metrics)


def assert_error(r: httpx.Response, status: int, code: str | int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return error


@pytest.mark.anyio
async def test_requests_per_minute_headers_and_429(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        for left in ("1", "0"):
            r = await gw.complete("sk-rpm", prompt=[1, 2], max_tokens=2)
            assert r.status_code == 200
            assert r.headers["x-ratelimit-limit-requests"] == "2"
            assert r.headers["x-ratelimit-remaining-requests"] == left
            assert r.headers["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in r.headers  # the tenant has no token limit
        r = await gw.complete("sk-rpm", prompt=[1, 2], max_tokens=2)
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert error["type"] == "RateLimitError"
        assert error["message"].startswith("Rate limit reached for tenant rpm on requests per min (RPM): Limit 2")
        assert int(r.headers["retry-after"]) in (29, 30) and 29_000 < int(r.headers["retry-after-ms"]) <= 30_000
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
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
    async with Gateway_(tmp_path) as gw:
        # reserves 10 + 30; the fake engine generates max_tokens, so it uses all of it
        r = await gw.complete("sk-tpm", prompt=list(range(10)), max_tokens=30)
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 40
        assert r.headers["x-ratelimit-remaining-tokens"] in ("20", "21")
        r = await gw.complete("sk-tpm", prompt=list(range(10)), max_tokens=30)
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert "on tokens per min (TPM): Limit 60" in error["message"] and "Requested 40" in error["message"]
        assert 15 <= int(r.headers["retry-after"]) <= 20  # 20 more tokens at 1 token/s
        # max_tokens null: the whole context (64) is reserved: more than the limit, refused for good
        # (left out, completions' default of 16 is what is reserved)
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=None)
        error = assert_error(r, 429, "rate_limit_exceeded")
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
async def test_budget_is_spent_exactly_then_insufficient_quota(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        served = []
        for _ in range(2):  # 2 x (5 + 10) of 40
            r = await gw.complete("sk-budget", prompt=[1] * 5, max_tokens=10)
            served.append(r.json()["usage"]["total_tokens"])
        # 10 left: admitted (it may run past them: the rule is "while the budget is not spent")
        r = await gw.complete("sk-budget", prompt=[1] * 5, max_tokens=10)
        assert r.status_code == 200
        served.append(r.json()["usage"]["total_tokens"])
        r = await gw.complete("sk-budget", prompt=[1], max_tokens=1)
        error = assert_error(r, 429, "insufficient_quota")
        assert error["type"] == "RateLimitError"
        assert error["message"].startswith("You exceeded your current quota: tenant budget has used 45 of its 40 tokens")
        now = time.time()
        assert error["message"].endswith(f"The budget renews with {period_of(now + seconds_to_next_period(now, 'month') + 1, 'month')} (UTC).")
        assert r.headers["x-should-retry"] == "false"
        assert abs(int(r.headers["retry-after"]) - math.ceil(seconds_to_next_period(now, "month"))) <= 5
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_budget_tokens", tenant="budget") == 40
        assert get(snap, "gateway_tenant_budget_used_tokens", tenant="budget") == 45 == sum(served)
        assert get(snap, "gateway_tenant_rate_limited_total", tenant="budget", reason="budget") == 1
        assert get(snap, "gateway_rejections_total", reason="budget") == 1
        rows = (await gw.client.get("/admin/usage", params={"tenant": "budget"}, headers=ADMIN)).json()["data"]
        assert sum(row["total_tokens"] for row in rows) == sum(served)  # the usage rows add up to the responses
        assert [(row["requests"], row["errors"]) for row in rows] == [(4, 1)]


@pytest.mark.anyio
async def test_a_stream_over_budget_ends_only_if_the_operator_chose_so(tmp_path: Path) -> None:
    for end_streams, expected in ((False, 40), (True, 20)):
        (tmp_path / str(end_streams)).mkdir()
        async with Gateway_(tmp_path / str(end_streams), end_streams_over_budget=end_streams) as gw:
            assert (await gw.complete("sk-budget", prompt=[1] * 10, max_tokens=10)).status_code == 200
            # 20 left; this stream reserves 10 + 30, holds 20, runs to 40 unless ended
            r = await gw.complete("sk-budget", prompt=[1] * 10, max_tokens=30, stream=True,
                                  stream_options={"include_usage": True})
            events = [line for line in r.text.split("\n\n") if line]
            assert r.status_code == 200 and events[-1] == "data: [DONE]"
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            generated = sum(1 for c in chunks if c.get("choices"))
            if end_streams:
                error = chunks[-1]["error"]
                assert error["code"] == "insufficient_quota" and "has used" in error["message"]
                assert generated == expected - 10 + 1  # the chunk that crossed the budget still went out
                assert any(rid.startswith("cmpl-") for rid in gw.engine.aborted)  # its engine request stopped
                assert get(gw.metrics(), "gateway_tenant_rate_limited_total", tenant="budget", reason="budget") == 1
            else:
                assert chunks[-1]["usage"]["total_tokens"] == expected and generated == 30
            used = get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="budget")
            # charged what the engine generated, past the budget: when the stream is ended, that
            # includes the token it had ready next
            assert used == 20 + 10 + generated + (1 if end_streams else 0)
            rows = (await gw.client.get("/admin/usage", headers=ADMIN)).json()["tenants"]["budget"]
            assert rows["errors"] == (1 if end_streams else 0) and rows["total_tokens"] == used


@pytest.mark.anyio
async def test_max_concurrent(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        gw.engine.delay_s = 0.05
        running = [asyncio.ensure_future(gw.complete("sk-few", prompt=[1], max_tokens=6)) for _ in range(2)]
        while gw.engine.running < 2:
            await asyncio.sleep(0.01)
        r = await gw.complete("sk-few", prompt=[1], max_tokens=1)
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert error["message"].startswith("Too many concurrent requests for tenant few: Limit 2")
        assert r.headers["retry-after"] == "1"
        assert (await gw.complete("sk-free", prompt=[1], max_tokens=1)).status_code == 200  # others are not held up
        assert [(await task).status_code for task in running] == [200, 200]
        assert (await gw.complete("sk-few", prompt=[1], max_tokens=1)).status_code == 200  # slots were given back
        assert get(gw.metrics(), "gateway_tenant_rate_limited_total", tenant="few", reason="concurrency") == 1


@pytest.mark.anyio
async def test_model_allow_list(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        for body in ({"model": "fake"}, {}):  # no model: the served one
            r = await gw.client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1, **body},
                                     headers=bearer("sk-other"))
            error = assert_error(r, 404, 404)
            assert error["param"] == "model" and "you do not have access to it" in error["message"]
        r = await gw.client.post("/v1/chat/completions", headers=bearer("sk-other"),
                                 json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert_error(r, 404, 404)
        assert (await gw.client.get("/v1/models", headers=bearer("sk-other"))).json() == {"object": "list", "data": []}
        assert [m["id"] for m in (await gw.client.get("/v1/models", headers=bearer("sk-fake"))).json()["data"]] == ["fake"]
        assert (await gw.complete("sk-fake", prompt=[1], max_tokens=1)).status_code == 200
        assert get(gw.metrics(), "gateway_tenant_requests_total", tenant="other-model", status="404") == 3


@pytest.mark.anyio
async def test_usage_store_and_admin_report(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        for _ in range(3):
            await gw.complete("sk-rpm", prompt=[1, 2, 3], max_tokens=4)
        await gw.client.post("/v1/chat/completions", headers=bearer("sk-free"),
                             json={"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2})
        await gw.complete("sk-free", prompt=[1], max_tokens=-1)  # a 400 is an error too
        r = await gw.client.get("/admin/usage", headers=ADMIN)
        assert r.status_code == 200
        report = r.json()
        today = time.strftime("%Y-%m-%d", time.gmtime())
        rows = {row["tenant"]: row for row in report["data"]}
        assert rows["rpm"] == {"tenant": "rpm", "day": today, "requests": 3, "errors": 1,
                               "prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14,
                               "queued": 0, "queue_ms": 0}
        assert rows["free"]["requests"] == 2 and rows["free"]["errors"] == 1 and rows["free"]["completion_tokens"] == 2
        assert report["tenants"]["rpm"]["limits"]["requests_per_minute"] == 2
        assert report["tenants"]["budget"]["requests"] == 0  # listed with zeros
        only = (await gw.client.get("/admin/usage", params={"tenant": "free", "from": today, "to": today},
                                    headers=ADMIN)).json()
        assert [row["tenant"] for row in only["data"]] == ["free"] and list(only["tenants"]) == ["free"]
        assert (await gw.client.get("/admin/usage", params={"to": "2000-01-01"}, headers=ADMIN)).json()["data"] == []
        bad = await gw.client.get("/admin/usage", params={"from": "yesterday"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
        assert (await gw.client.get("/admin/usage", headers=bearer("sk-free"))).status_code == 401


@pytest.mark.anyio
async def test_budget_stays_spent_across_a_restart(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        assert (await gw.complete("sk-budget", prompt=[1] * 5, max_tokens=35)).status_code == 200
    async with Gateway_(tmp_path) as again:  # same usage store: the period's 40 tokens are counted
        assert_error(await again.complete("sk-budget", prompt=[1], max_tokens=1), 429, "insufficient_quota")


@pytest.mark.anyio
async def test_open_api_is_the_unnamed_tenant_and_stores_nothing(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, keys=None) as gw:
        r = await gw.client.post("/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and not any(h.startswith("x-ratelimit") for h in r.headers)
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_requests_total", tenant="unnamed", status="200") == 1
        assert get(snap, "gateway_tenant_tokens_total", tenant="unnamed", kind="completion") == 3
        assert not gw.tenancy.enabled and not list(tmp_path.rglob("*.sqlite3"))
        assert (await gw.client.get("/admin/usage", headers=ADMIN)).json() == {
            "object": "list", "data": [], "tenants": {}}


@pytest.mark.anyio
async def test_bodies_the_middleware_reads_still_get_their_4xx(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        r = await gw.client.post("/v1/completions", content=b'{"prompt": [1, 2',
                                 headers={**bearer("sk-tpm"), "content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        big = json.dumps({"prompt": "x" * (9 * 2**20)}).encode()
        assert (await gw.client.post("/v1/completions", content=big, headers=bearer("sk-tpm"))).status_code == 413
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=-1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        # refused before its prompt was tokenized: it reserved nothing, so it took nothing
        assert "x-ratelimit-remaining-tokens" not in r.headers
        r = await gw.complete("sk-tpm", prompt=[1, 2], max_tokens=1)
        assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "57"


@pytest.mark.anyio
async def test_redis_unreachable_fails_open_per_instance(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="llm_gateway.tenants"):
        async with Gateway_(tmp_path, redis_url=url, redis_timeout_s=0.2) as gw:
            statuses = [(await gw.complete("sk-rpm", prompt=[1], max_tokens=1)).status_code for _ in range(3)]
            assert statuses == [200, 200, 429]  # still limited, by this instance alone
            assert get(gw.metrics(), "gateway_tenant_limiter_degraded_total") == 3
    assert "tenant limits are counted per instance" in caplog.text


@pytest.mark.anyio
@pytest.mark.parametrize("empty", ["", "keys: []\n"])
async def test_a_keys_file_without_keys_refuses_every_request(tmp_path: Path, empty: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A configured keys file that lists no key (emptied by mistake) closes the API: 401 for any
    key or none, never an open API that serves everyone as `unnamed`; the start log says why."""
    with caplog.at_level(logging.WARNING, logger="llm_gateway"):
        async with Gateway_(tmp_path, keys=empty) as gw:
            assert not gw.tenancy.directory.open
            for headers in ({}, bearer("sk-anything")):
                r = await gw.client.post("/v1/completions", json={"model": "fake", "prompt": [1], "max_tokens": 1},
                                         headers=headers)
                assert_error(r, 401, 401)  # the gateway's 401 everywhere (server/middleware/auth.py)
            assert get(gw.metrics(), "gateway_tenant_requests_total", tenant="unnamed", status="200") == 0
    assert any("lists no key" in rec.getMessage() for rec in caplog.records), caplog.text


# -- reload: the keys file again, the engine left alone -------------------------------------------


def reloadable(tmp_path: Path) -> tuple[Gateway, FakeEngine, httpx.AsyncClient]:
    base = settings_for(tmp_path, KEYS)
    engine = FakeEngine()

    async def factory(_: Settings) -> FakeEngine:
        return engine

    def loader(_: str | None, overrides: dict[str, Any]) -> Settings:
        return Settings.model_validate(deep_merge(base.model_dump(), overrides))

    gateway = Gateway(base, engine_factory=factory, loader=loader)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://test")
    return gateway, engine, client


@pytest.mark.anyio
async def test_reload_rereads_the_keys_file_without_touching_the_engine(tmp_path: Path) -> None:
    gateway, engine, client = reloadable(tmp_path)
    await gateway.holder.start()
    tenancy = gateway.tenancy
    await tenancy.start()
    try:
        async def status(key: str) -> int:
            return (await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1},
                                      headers=bearer(key))).status_code

        assert [await status("sk-rpm") for _ in range(3)] == [200, 200, 429]
        keys = yaml.safe_load((tmp_path / "keys.yaml").read_text())
        keys["keys"] = [k for k in keys["keys"] if k["name"] != "free"] + [{"name": "late", "key": "sk-late"}]
        (tmp_path / "keys.yaml").write_text(yaml.safe_dump(keys))
        result = await gateway.reload()
        assert result.outcome == "success" and not result.engine_reloaded
        assert gateway.holder.engine is engine and not engine.closed  # the same engine serves on
        assert await status("sk-free") == 401 and await status("sk-late") == 200
        assert await status("sk-rpm") == 429  # the counts of the keys that stay are kept
        # an invalid file is refused, the previous keys stay
        (tmp_path / "keys.yaml").write_text("keys:\n  - {name: broken, key: sk-broken, max_concurrent: 0}\n")
        with pytest.raises(InvalidRequestError, match="auth.keys_file"):
            await gateway.reload()
        assert await status("sk-late") == 200 and await status("sk-broken") == 401
        snap = snapshot(gateway.metrics)
        assert get(snap, "gateway_tenant_keys_reloads_total", outcome="success") == 1
        assert get(snap, "gateway_tenant_keys_reloads_total", outcome="failure") == 1
        assert get(snap, "gateway_engine_reloads_total", outcome="success") == 0
        # a reload that changes the engine profile still swaps the engine
        (tmp_path / "keys.yaml").write_text(KEYS)
        swapped = await gateway.reload(overrides={"engine": {"max_num_seqs": 8}})
        assert swapped.outcome == "success" and swapped.engine_reloaded
    finally:
        await tenancy.stop()
        await gateway.holder.stop(drain_timeout=0)
        await client.aclose()
