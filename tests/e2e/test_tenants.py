"""Tenants end to end: two real gateway instances (real vLLM CPU engine) sharing one real
redis-server and one usage store, driven by the OpenAI SDK, scraped by a real Prometheus.

Proves: limits and quotas are shared by the instances through Redis; the 429s are OpenAI's
(`rate_limit_exceeded` / `insufficient_quota`, Retry-After, x-ratelimit-*, no SDK retry where a
retry cannot help); a reservation is settled with the tokens really used (also for a stream the
client abandons); the usage store adds up both instances; a changed keys file reaches both; the
dashboard's tenant rows have data; without Redis each instance keeps limiting on its own.
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import SERVED_NAME, ServerProcess, start_gateway, wait_ready
from tests.e2e.test_observability import (
    DASHBOARD,
    alert_rules,
    running_prometheus,
    samples,
    scrape,
    substitute,
    value,
    wait_for,
    without_threshold,
)
from tests.redis_server import RedisServer, start_redis

ADMIN = {"Authorization": "Bearer sk-admin"}
CONTEXT = 128
KEYS = """
tenants:
  shared-rpm: {keys: [sk-rpm], requests_per_minute: 3}
  tokens: {keys: [sk-tokens], tokens_per_minute: 100}
  metered: {keys: [sk-metered], monthly_tokens: 150}
  streamer: {keys: [sk-streamer], monthly_tokens: 100000}
  free: {keys: [sk-free]}
"""


@dataclass
class Fleet:
    a: ServerProcess
    b: ServerProcess
    redis: RedisServer
    keys_path: Path

    @property
    def both(self) -> tuple[ServerProcess, ServerProcess]:
        return self.a, self.b


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("tenants")
    redis = start_redis(tmp / "redis")
    keys_path = tmp / "keys.yaml"
    keys_path.write_text(KEYS)
    env = {
        "LLM_GATEWAY_TENANTS__LIMITER": "redis",
        "LLM_GATEWAY_TENANTS__REDIS_URL": redis.url,
        "LLM_GATEWAY_TENANTS__REDIS_RETRY_S": "1",
        "LLM_GATEWAY_TENANTS__USAGE_DB": str(tmp / "usage.sqlite3"),  # shared, as on one host
        "LLM_GATEWAY_TENANTS__USAGE_FLUSH_INTERVAL_S": "0.5",
        "LLM_GATEWAY_TENANTS__WATCH_INTERVAL_S": "0.5",
    }
    args = ["--keys-file", str(keys_path), "--admin-key", "sk-admin", "--max-model-len", str(CONTEXT)]
    servers: list[ServerProcess] = []
    try:
        for name in ("a", "b"):  # both engines start at once
            (tmp / name).mkdir()
            servers.append(start_gateway(tmp / name, extra_args=args, env=env, wait=False))
        for server in servers:
            wait_ready(server)
        yield Fleet(servers[0], servers[1], redis, keys_path)
        for server in servers:
            assert server.stop() == 0, server.log()[-3000:]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def client(server: ServerProcess, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=retries, timeout=120)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return value(samples(scrape(server.base_url)), name, **labels)


def settled_quota(server: ServerProcess, tenant: str, expected: float) -> float:
    """The instance's quota gauge, once it shows `expected` or 10 s passed (a request is settled
    just after its last byte, so the client may ask before it is)."""
    wait_for(lambda: metric(server, "gateway_tenant_quota_used_tokens", tenant=tenant) == expected, timeout=10)
    return metric(server, "gateway_tenant_quota_used_tokens", tenant=tenant)


def test_requests_per_minute_are_shared_by_both_instances(fleet: Fleet) -> None:
    clients = [client(server, "sk-rpm") for server in fleet.both]
    started, served, refused = time.monotonic(), 0, None
    for i in range(8):
        try:
            clients[i % 2].completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
            served += 1
        except openai.RateLimitError as exc:
            refused = exc
            break
    elapsed = time.monotonic() - started
    assert refused is not None and served == 3 + math.floor(elapsed * 3 / 60), (served, elapsed)
    assert refused.code == "rate_limit_exceeded" and refused.type == "RateLimitError"
    headers = refused.response.headers
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["retry-after"]) <= 20
    # another tenant is not limited by it, on either instance
    for server in fleet.both:
        done = client(server, "sk-free").completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
        assert done.usage.completion_tokens == 1


def test_max_tokens_is_reserved_and_too_large_is_not_retried(fleet: Fleet) -> None:
    a = client(fleet.a, "sk-tokens")
    raw = a.completions.with_raw_response.create(model=SERVED_NAME, prompt=list(range(100, 110)), max_tokens=20,
                                                 extra_body={"ignore_eos": True})
    assert raw.parse().usage.total_tokens == 30
    assert raw.headers["x-ratelimit-limit-tokens"] == "100"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "70"  # 10 prompt + 20 max_tokens reserved
    # on the other instance the same bucket: a chat request sees what the first one took
    chat = client(fleet.b, "sk-tokens").chat.completions.with_raw_response.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5)
    assert chat.parse().choices[0].message.content is not None
    assert int(chat.headers["x-ratelimit-remaining-tokens"]) < 70
    # no max_tokens: the whole context (128) is reserved, more than 100 a minute can ever give
    before = metric(fleet.a, "gateway_tenant_requests_total", tenant="tokens", status="429")
    with pytest.raises(openai.RateLimitError) as caught:
        client(fleet.a, "sk-tokens", retries=2).completions.create(model=SERVED_NAME, prompt=[1, 2, 3])
    assert caught.value.code == "rate_limit_exceeded" and caught.value.param == "max_tokens"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "Request too large" in caught.value.message
    # the SDK (max_retries=2) did not retry: one 429 reached the gateway
    assert metric(fleet.a, "gateway_tenant_requests_total", tenant="tokens", status="429") - before == 1


def test_quota_is_settled_with_real_usage_then_insufficient(fleet: Fleet) -> None:
    a, b = client(fleet.a, "sk-metered"), client(fleet.b, "sk-metered")
    # reserves 6 + 40 tokens; stops at the first "." after a few
    first = a.completions.create(model=SERVED_NAME, prompt="The capital of France is", max_tokens=40,
                                 stop=["."], temperature=0)
    used = first.usage.total_tokens
    assert used < 6 + 40
    assert settled_quota(fleet.a, "metered", used) == used  # the reservation became the real usage
    chunks = list(b.completions.create(model=SERVED_NAME, prompt=list(range(200, 210)), max_tokens=30,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    used += chunks[-1].usage.total_tokens
    assert settled_quota(fleet.b, "metered", used) == used  # one counter in Redis for both instances
    left = 150 - used
    before = metric(fleet.a, "gateway_tenant_requests_total", tenant="metered", status="429")
    with pytest.raises(openai.RateLimitError) as caught:
        client(fleet.a, "sk-metered", retries=2).completions.create(
            model=SERVED_NAME, prompt=list(range(10)), max_tokens=left)
    error = caught.value
    assert error.code == "insufficient_quota" and error.type == "RateLimitError"
    assert f"has used {used} of its 150 tokens" in error.message
    assert error.response.headers["x-should-retry"] == "false" and int(error.response.headers["retry-after"]) > 0
    assert metric(fleet.a, "gateway_tenant_requests_total", tenant="metered", status="429") - before == 1
    assert a.completions.create(model=SERVED_NAME, prompt=[1, 2], max_tokens=1).usage.total_tokens == 3


def test_an_abandoned_stream_is_charged_what_it_generated(fleet: Fleet) -> None:
    body = {"model": SERVED_NAME, "prompt": list(range(300, 308)), "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", fleet.a.base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer sk-streamer"}) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break
    # settled once the gateway saw the client go: far less than the 108 reserved
    assert wait_for(lambda: 0 < metric(fleet.a, "gateway_tenant_quota_used_tokens", tenant="streamer") < 108,
                    timeout=20)
    charged = metric(fleet.a, "gateway_tenant_quota_used_tokens", tenant="streamer")
    generated = metric(fleet.a, "gateway_tenant_tokens_total", tenant="streamer", kind="completion")
    assert charged == 8 + generated and generated >= 5


def test_usage_store_adds_up_both_instances(fleet: Fleet) -> None:
    def report() -> dict:
        return httpx.get(fleet.a.base_url + "/admin/usage", headers=ADMIN, timeout=30).json()

    def expected(tenant: str) -> dict[str, float]:
        snaps = [samples(scrape(server.base_url)) for server in fleet.both]
        served = sum(value(s, "gateway_tenant_requests_total", tenant=tenant) for s in snaps)
        refused = sum(value(s, "gateway_tenant_rate_limited_total", tenant=tenant) for s in snaps)
        return {"requests": served - refused, "rate_limited": refused,
                "prompt_tokens": sum(value(s, "gateway_tenant_tokens_total", tenant=tenant, kind="prompt") for s in snaps),
                "completion_tokens": sum(value(s, "gateway_tenant_tokens_total", tenant=tenant, kind="completion")
                                         for s in snaps)}

    tenants = ("shared-rpm", "tokens", "metered", "streamer", "free")

    def matches() -> bool:  # instance b writes its share every 0.5 s
        totals = report()["tenants"]
        return all({k: totals[t][k] for k in ("requests", "rate_limited", "prompt_tokens", "completion_tokens")}
                   == expected(t) for t in tenants)

    assert wait_for(matches, timeout=15), (report()["tenants"], {t: expected(t) for t in tenants})
    totals = report()["tenants"]
    assert totals["metered"]["month"]["total_tokens"] == totals["metered"]["total_tokens"]
    assert totals["shared-rpm"]["rate_limited"] >= 1 and totals["free"]["limits"]["monthly_tokens"] is None


def test_a_changed_keys_file_reaches_both_instances(fleet: Fleet) -> None:
    fleet.keys_path.write_text(KEYS + "  late: {keys: [sk-late], requests_per_minute: 100}\n")

    def accepted(server: ServerProcess) -> bool:
        r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                       headers={"Authorization": "Bearer sk-late"}, timeout=60)
        return r.status_code == 200 and r.headers.get("x-ratelimit-limit-requests") == "100"

    for server in fleet.both:
        assert wait_for(lambda: accepted(server), timeout=15, interval=0.5), server.log()[-2000:]
        assert metric(server, "gateway_tenant_keys_reloads_total", outcome="success") == 1


def test_dashboard_tenant_rows_and_alerts_have_data(fleet: Fleet, tmp_path: Path) -> None:
    targets = [urllib.parse.urlsplit(server.base_url).netloc for server in fleet.both]
    with running_prometheus(tmp_path, targets) as prom:
        for server in fleet.both:  # after the first scrape, so rates and quantiles see it
            for key in ("sk-metered", "sk-free", "sk-tokens"):
                httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                           headers={"Authorization": f"Bearer {key}"}, timeout=60)
        sent = sum(metric(server, "gateway_tenant_requests_total", tenant="metered") for server in fleet.both)

        def scraped() -> bool:
            got = prom.query('sum(gateway_tenant_requests_total{job="llm-gateway", tenant="metered"})')
            return bool(got) and float(got[0]["value"][1]) >= sent

        assert wait_for(scraped, timeout=60, interval=1.0), "Prometheus never scraped the load"
        time.sleep(4)  # one more scrape (2 s) for the rates
        dash = json.loads(DASHBOARD.read_text())
        variable = next(v for v in dash["templating"]["list"] if v["name"] == "tenant")
        listed = {s["metric"]["tenant"] for s in prom.query(
            variable["query"]["query"].replace("label_values(", "").rsplit(",", 1)[0].replace("$instance", ".*"))}
        assert {"default", "shared-rpm", "tokens", "metered", "streamer", "free", "late"} <= listed
        exprs = [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
                 for t in p["targets"] if "gateway_tenant_" in t["expr"]]
        exprs += [(r["alert"], without_threshold(r["expr"])) for r in alert_rules() if "gateway_tenant_" in r["expr"]]
        assert len(exprs) >= 9
        empty = []
        for where, expr in exprs:
            result = prom.query(substitute(expr, tenant="metered"))
            values = [float(s["value"][1]) for s in result]
            if not values or all(math.isnan(v) for v in values):
                empty.append(f"{where}: {expr}")
        assert not empty, "tenant expressions without data:\n" + "\n".join(empty)
        [quota] = prom.query(substitute(next(e for t, e in exprs if t.startswith("Monthly quota")), "metered"))
        counted = max(metric(server, "gateway_tenant_quota_used_tokens", tenant="metered") for server in fleet.both)
        assert float(quota["value"][1]) == pytest.approx(counted / 150) and counted > 50


def test_without_redis_each_instance_limits_on_its_own(fleet: Fleet) -> None:
    fleet.redis.stop()
    try:
        # 'shared-rpm' is spent in Redis; each instance now counts it afresh in its own memory
        for server in fleet.both:
            before = metric(server, "gateway_tenant_limiter_degraded_total")
            rpm = client(server, "sk-rpm")
            for _ in range(3):
                assert rpm.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
            with pytest.raises(openai.RateLimitError):
                rpm.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
            assert metric(server, "gateway_tenant_limiter_degraded_total") - before == 4
            assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    finally:
        fleet.redis.start()
    # Redis is tried again after tenants.redis_retry_s (1 s)
    before = metric(fleet.a, "gateway_tenant_limiter_duration_seconds_count", backend="redis")

    def back_on_redis() -> bool:
        client(fleet.a, "sk-tokens").completions.create(model=SERVED_NAME, prompt=[1], max_tokens=1)
        return metric(fleet.a, "gateway_tenant_limiter_duration_seconds_count", backend="redis") > before

    assert wait_for(back_on_redis, timeout=15, interval=0.5)
