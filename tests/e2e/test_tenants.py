"""Tenants end to end: two real gateway instances (real vLLM CPU engine) sharing one real
redis-server (`auth.redis_url`) and one usage store, driven by the OpenAI SDK, scraped by a real
Prometheus.

Proves: a tenant over its requests per minute gets OpenAI's 429 with its headers while another is
unaffected, across both instances; `max_tokens` is reserved and a request too large is not retried
by the SDK; the token budget is spent exactly (the usage rows add up to the responses' usage) and
then answers `insufficient_quota`; an abandoned stream is charged what it generated; the model
allow-list holds; a key removed by SIGHUP gets 401 at once while the engine keeps serving; the
dashboard's tenant rows have data; without Redis each instance limits on its own (fail open, with
a metric and a log line); after a restart the budget is still spent; parallel bursts of tool-heavy, CJK and random-script
requests spend at most the budget (or tokens per minute) plus one request, on one instance or two.
"""

from __future__ import annotations

import json
import math
import random
import signal
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from server.settings.keys_file import hashed
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
from testbed.bursts import big_tool, cjk_text, random_request, send_at_once
from testbed.redis_server import RedisServer, start_redis

ADMIN = {"Authorization": "Bearer sk-admin"}
CONTEXT = 1024  # room for the bursts' ~600-token tool and 400 CJK characters (~830 tokens)
BUDGET = 150
BURST_BUDGET, BURST_TPM = 1000, 1500
ENTRIES = [
    {"name": "rpm-limited", "key": hashed("sk-rpm"), "requests_per_minute": 3},
    {"name": "tokens", "key": "sk-tokens", "tokens_per_minute": 100},  # a plain key: allowed, warned about
    {"name": "budgeted", "key": hashed("sk-budget"), "budget_tokens": BUDGET, "budget_period": "day"},
    {"name": "streamer", "key": hashed("sk-streamer"), "budget_tokens": 100000},
    {"name": "other-model", "key": hashed("sk-other"), "models": ["some-other-model"]},
    {"name": "free", "key": hashed("sk-free")},
    {"name": "leaving", "key": hashed("sk-leaving")},
    *({"name": f"burst-{kind}", "key": hashed(f"sk-burst-{kind}"), "budget_tokens": BURST_BUDGET, "budget_period": "day"}
      for kind in ("tools", "cjk", "mixed")),
    {"name": "burst-tpm", "key": hashed("sk-burst-tpm"), "tokens_per_minute": BURST_TPM},
]


@dataclass
class Fleet:
    servers: list[ServerProcess]
    redis: RedisServer
    tmp: Path
    args: list[str]
    env: dict[str, str]

    @property
    def a(self) -> ServerProcess:
        return self.servers[0]

    @property
    def b(self) -> ServerProcess:
        return self.servers[1]

    @property
    def keys_path(self) -> Path:
        return self.tmp / "keys.yaml"


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("tenants")
    redis = start_redis(tmp / "redis")
    (tmp / "keys.yaml").write_text(yaml.safe_dump({"keys": ENTRIES}, sort_keys=False))
    env = {
        "LLM_GATEWAY_AUTH__REDIS_URL": redis.url,
        "LLM_GATEWAY_AUTH__REDIS_RETRY_S": "1",
        "LLM_GATEWAY_AUTH__USAGE_DB": str(tmp / "usage.sqlite3"),  # shared, as on one host
        "LLM_GATEWAY_AUTH__USAGE_FLUSH_INTERVAL_S": "0.5",
    }
    args = ["--keys-file", str(tmp / "keys.yaml"), "--admin-key", "sk-admin", "--max-model-len", str(CONTEXT)]
    fleet = Fleet([], redis, tmp, args, env)
    try:
        for name in ("a", "b"):  # both engines start at once
            (tmp / name).mkdir()
            fleet.servers.append(start_gateway(tmp / name, extra_args=args, env=env, wait=False))
        for server in fleet.servers:
            wait_ready(server)
        yield fleet
        for server in fleet.servers:
            assert server.stop() == 0, server.log()[-3000:]
    finally:
        for server in fleet.servers:
            server.stop()
        redis.stop()


def client(server: ServerProcess, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=retries, timeout=120)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    return value(samples(scrape(server.base_url)), name, **labels)


def status_of(server: ServerProcess, key: str) -> int:
    return httpx.post(server.base_url + "/v1/completions", json={"prompt": [1], "max_tokens": 1},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code


def budget_count(server: ServerProcess, tenant: str, expected: float) -> float:
    """The instance's budget gauge, once it shows `expected` or 10 s passed (a request is settled
    just after its last byte, so the client may ask before it is)."""
    wait_for(lambda: metric(server, "gateway_tenant_budget_used_tokens", tenant=tenant) == expected, timeout=10)
    return metric(server, "gateway_tenant_budget_used_tokens", tenant=tenant)


def test_requests_per_minute_are_shared_by_both_instances(fleet: Fleet) -> None:
    clients = [client(server, "sk-rpm") for server in fleet.servers]
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
    assert headers["x-ratelimit-reset-requests"].endswith("s") and 1 <= int(headers["retry-after"]) <= 20
    # another tenant is not limited by it, on either instance
    for server in fleet.servers:
        done = client(server, "sk-free").completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
        assert done.usage.completion_tokens == 1


def test_max_tokens_is_reserved_and_too_large_is_not_retried(fleet: Fleet) -> None:
    raw = client(fleet.a, "sk-tokens").completions.with_raw_response.create(
        model=SERVED_NAME, prompt=list(range(100, 110)), max_tokens=20, extra_body={"ignore_eos": True})
    assert raw.parse().usage.total_tokens == 30
    assert raw.headers["x-ratelimit-limit-tokens"] == "100"
    assert raw.headers["x-ratelimit-remaining-tokens"] == "70"  # 10 prompt + 20 max_tokens reserved
    # on the other instance the same bucket: a chat request sees what the first one took
    chat = client(fleet.b, "sk-tokens").chat.completions.with_raw_response.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5)
    assert chat.parse().choices[0].message.content is not None
    assert int(chat.headers["x-ratelimit-remaining-tokens"]) < 70
    # chat without max_tokens: the room left in the context (1024) is reserved, more than 100 a
    # minute can ever give
    before = metric(fleet.a, "gateway_tenant_requests_total", tenant="tokens", status="429")
    with pytest.raises(openai.RateLimitError) as caught:
        client(fleet.a, "sk-tokens", retries=2).chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.code == "rate_limit_exceeded" and caught.value.param == "max_tokens"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "Request too large" in caught.value.message
    # the SDK (max_retries=2) did not retry: one 429 reached the gateway
    assert metric(fleet.a, "gateway_tenant_requests_total", tenant="tokens", status="429") - before == 1
    assert "holds plain keys (tenants: tokens)" in fleet.a.log()  # warned at start


def test_the_budget_is_spent_exactly_then_insufficient_quota(fleet: Fleet) -> None:
    a, b = client(fleet.a, "sk-budget"), client(fleet.b, "sk-budget")
    # reserves 6 + 40 tokens; stops at the first "." after a few: the rest goes back
    first = a.completions.create(model=SERVED_NAME, prompt="The capital of France is", max_tokens=40,
                                 stop=["."], temperature=0)
    responses = [first.usage.total_tokens]
    assert responses[0] < 6 + 40
    assert budget_count(fleet.a, "budgeted", responses[0]) == responses[0]
    chunks = list(b.completions.create(model=SERVED_NAME, prompt=list(range(200, 210)), max_tokens=30, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    responses.append(chunks[-1].usage.total_tokens)
    assert budget_count(fleet.b, "budgeted", sum(responses)) == sum(responses)  # one count in Redis for both
    # spend the rest, alternating instances, until the budget answers insufficient_quota
    refused = None
    for i in range(20):
        try:
            done = (a, b)[i % 2].completions.create(model=SERVED_NAME, prompt=[1, 2], max_tokens=20,
                                                    extra_body={"ignore_eos": True})
            responses.append(done.usage.total_tokens)
        except openai.RateLimitError as exc:
            refused = exc
            break
    spent = sum(responses)
    assert refused is not None and spent >= BUDGET and spent - responses[-1] < BUDGET
    assert refused.code == "insufficient_quota" and refused.type == "RateLimitError"
    assert f"has used {spent} of its {BUDGET} tokens" in refused.message
    assert refused.response.headers["x-should-retry"] == "false" and int(refused.response.headers["retry-after"]) > 0
    before = sum(metric(s, "gateway_tenant_requests_total", tenant="budgeted", status="429") for s in fleet.servers)
    with pytest.raises(openai.RateLimitError):
        client(fleet.a, "sk-budget", retries=2).completions.create(model=SERVED_NAME, prompt=[1], max_tokens=1)
    after = sum(metric(s, "gateway_tenant_requests_total", tenant="budgeted", status="429") for s in fleet.servers)
    assert after - before == 1  # x-should-retry: false, the SDK did not retry

    def rows() -> list[dict]:
        return httpx.get(fleet.a.base_url + "/admin/usage", params={"tenant": "budgeted"}, headers=ADMIN,
                         timeout=30).json()["data"]

    def counted() -> tuple[int, int, int]:
        found = rows()
        return (sum(r["total_tokens"] for r in found), sum(r["requests"] for r in found),
                sum(r["errors"] for r in found))

    # exactly: the usage rows (both instances write them) add up to the responses' usage fields;
    # the two refusals are requests and errors there
    assert wait_for(lambda: counted() == (spent, len(responses) + 2, 2), timeout=10), (rows(), responses)
    assert metric(fleet.a, "gateway_tenant_budget_used_tokens", tenant="budgeted") == spent


def tool_request(tool: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Book it."}], "tools": [tool],
                                    "max_tokens": 1}


def assert_within(burst, limit: int, tenant: str, refusal: str) -> None:  # type: ignore[no-untyped-def]
    """At most `limit` plus one request was spent; the rest got OpenAI's 429 (never a 500)."""
    assert set(burst.statuses) <= {200, 429} and burst.served >= 1, burst.statuses
    assert burst.spent <= limit + burst.largest, (tenant, burst.spent, burst.largest, burst.statuses)
    assert all(b["error"]["code"] == refusal for b in burst.bodies), burst.bodies


def test_parallel_tool_requests_stay_within_the_budget(fleet: Fleet) -> None:
    tool = big_tool()
    burst = send_at_once([fleet.a.base_url], "sk-burst-tools", [tool_request(tool)] * 6)
    assert burst.largest > 600  # the tool definition is in the prompt the engine saw
    assert_within(burst, BURST_BUDGET, "burst-tools", "insufficient_quota")
    assert burst.served == 2  # ~690 each: the second is admitted at ~690 of 1,000, the third is not
    assert budget_count(fleet.a, "burst-tools", burst.spent) == burst.spent  # refunds exact


def test_parallel_cjk_completions_stay_within_the_budget(fleet: Fleet) -> None:
    text = cjk_text(400)
    burst = send_at_once([fleet.a.base_url, fleet.b.base_url], "sk-burst-cjk",
                         [("/v1/completions", {"prompt": text, "max_tokens": 1})] * 4)
    assert burst.largest > 700  # ~2 tokens a character, not 0.25
    assert_within(burst, BURST_BUDGET, "burst-cjk", "insufficient_quota")


def test_parallel_tool_requests_stay_within_tokens_per_minute(fleet: Fleet) -> None:
    started = time.monotonic()
    burst = send_at_once([fleet.a.base_url], "sk-burst-tpm", [tool_request(big_tool())] * 6)
    refill = math.ceil((time.monotonic() - started) * BURST_TPM / 60)
    assert_within(burst, BURST_TPM + refill, "burst-tpm", "rate_limit_exceeded")
    assert burst.served < 6


def test_random_tool_schemas_and_scripts_on_two_instances_stay_within_the_budget(fleet: Fleet) -> None:
    rng = random.Random(38)
    burst = send_at_once([fleet.a.base_url, fleet.b.base_url], "sk-burst-mixed",
                         [random_request(rng) for _ in range(20)])
    assert_within(burst, BURST_BUDGET, "burst-mixed", "insufficient_quota")
    assert burst.statuses.count(429) >= 1
    counts = [metric(server, "gateway_tenant_budget_used_tokens", tenant="burst-mixed") for server in fleet.servers]
    assert max(counts) <= BURST_BUDGET + burst.largest


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
    assert wait_for(lambda: 0 < metric(fleet.a, "gateway_tenant_budget_used_tokens", tenant="streamer") < 108,
                    timeout=20)
    charged = metric(fleet.a, "gateway_tenant_budget_used_tokens", tenant="streamer")
    generated = metric(fleet.a, "gateway_tenant_tokens_total", tenant="streamer", kind="completion")
    assert charged == 8 + generated and generated >= 5


def test_the_model_allow_list_holds(fleet: Fleet) -> None:
    other = client(fleet.a, "sk-other")
    with pytest.raises(openai.NotFoundError) as caught:
        other.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
    assert "you do not have access to it" in caught.value.message and caught.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert [m.id for m in other.models.list()] == []
    assert [m.id for m in client(fleet.a, "sk-free").models.list()] == [SERVED_NAME]


def test_usage_store_adds_up_both_instances(fleet: Fleet) -> None:
    def report() -> dict:
        return httpx.get(fleet.a.base_url + "/admin/usage", headers=ADMIN, timeout=30).json()["tenants"]

    def expected(tenant: str) -> dict[str, float]:
        snaps = [samples(scrape(server.base_url)) for server in fleet.servers]
        by_status = [(dict(lbls)["status"], v) for s in snaps for (n, lbls), v in s.items()
                     if n == "gateway_tenant_requests_total" and dict(lbls)["tenant"] == tenant]
        return {"requests": sum(v for _, v in by_status), "errors": sum(v for st, v in by_status if int(st) >= 400),
                "prompt_tokens": sum(value(s, "gateway_tenant_tokens_total", tenant=tenant, kind="prompt") for s in snaps),
                "completion_tokens": sum(value(s, "gateway_tenant_tokens_total", tenant=tenant, kind="completion")
                                         for s in snaps)}

    tenants = ("rpm-limited", "tokens", "budgeted", "streamer", "other-model", "free")

    def matches() -> bool:  # instance b writes its share every 0.5 s
        totals = report()
        return all({k: totals[t][k] for k in ("requests", "errors", "prompt_tokens", "completion_tokens")}
                   == expected(t) for t in tenants)

    assert wait_for(matches, timeout=15), (report(), {t: expected(t) for t in tenants})
    totals = report()
    assert totals["other-model"]["errors"] == totals["other-model"]["requests"] == 2
    assert totals["free"]["limits"]["budget_tokens"] is None and totals["rpm-limited"]["errors"] >= 1


def spend_budget(server: ServerProcess) -> None:
    """Use up tenant `budgeted`'s budget (one refusal when an earlier test spent it already)."""
    for _ in range(BUDGET // 20 + 2):
        r = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": "Bearer sk-budget"}, timeout=60,
                       json={"prompt": [1, 2], "max_tokens": 20, "ignore_eos": True})
        if r.status_code == 429:
            return
        assert r.status_code == 200, r.text
    raise AssertionError(f"{BUDGET} tokens of budget were never spent")


@pytest.mark.timing
def test_a_key_removed_by_sighup_gets_401_at_once(fleet: Fleet) -> None:
    if status_of(fleet.a, "sk-leaving") == 401:  # a round of make test-timing removed it: the first file again
        fleet.keys_path.write_text(yaml.safe_dump({"keys": ENTRIES}, sort_keys=False))
        for server in fleet.servers:
            assert httpx.post(server.base_url + "/admin/reload", headers=ADMIN, timeout=60).status_code == 200
    assert [status_of(server, "sk-leaving") for server in fleet.servers] == [200, 200]
    spend_budget(fleet.a)  # spent before the reload, it must stay spent after it
    engines_before = metric(fleet.a, "gateway_engine_reloads_total")
    keys_reloads = metric(fleet.a, "gateway_tenant_keys_reloads_total", outcome="success")
    fleet.keys_path.write_text(yaml.safe_dump(
        {"keys": [e for e in ENTRIES if e["name"] != "leaving"] + [{"name": "late", "key": hashed("sk-late")}]},
        sort_keys=False))
    fleet.a.proc.send_signal(signal.SIGHUP)
    t0 = time.monotonic()
    assert wait_for(lambda: status_of(fleet.a, "sk-leaving") == 401, timeout=10, interval=0.05)
    assert time.monotonic() - t0 < 5
    assert status_of(fleet.a, "sk-late") == 200 and status_of(fleet.a, "sk-free") == 200
    assert status_of(fleet.b, "sk-leaving") == 200  # b has not re-read its keys yet
    # the keys that stay keep their counts: the budget is still spent
    assert status_of(fleet.a, "sk-budget") == 429
    assert metric(fleet.a, "gateway_tenant_keys_reloads_total", outcome="success") == keys_reloads + 1
    assert metric(fleet.a, "gateway_engine_reloads_total") == engines_before  # the engine was not touched
    assert "engine profile unchanged, the engine keeps serving" in fleet.a.log()
    # /admin/reload does the same on b
    r = httpx.post(fleet.b.base_url + "/admin/reload", headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["engine_reloaded"] is False
    assert status_of(fleet.b, "sk-leaving") == 401 and status_of(fleet.b, "sk-late") == 200


def test_dashboard_tenant_rows_and_alerts_have_data(fleet: Fleet, tmp_path: Path) -> None:
    targets = [urllib.parse.urlsplit(server.base_url).netloc for server in fleet.servers]
    with running_prometheus(tmp_path, targets) as prom:
        for server in fleet.servers:  # after the first scrape, so rates and quantiles see it
            for key in ("sk-budget", "sk-free", "sk-tokens"):
                status_of(server, key)
        sent = sum(metric(server, "gateway_tenant_requests_total", tenant="budgeted") for server in fleet.servers)

        def scraped() -> bool:
            got = prom.query('sum(gateway_tenant_requests_total{job="llm-gateway", tenant="budgeted"})')
            return bool(got) and float(got[0]["value"][1]) >= sent

        assert wait_for(scraped, timeout=60, interval=1.0), "Prometheus never scraped the load"
        time.sleep(4)  # one more scrape (2 s) for the rates
        dash = json.loads(DASHBOARD.read_text())
        variable = next(v for v in dash["templating"]["list"] if v["name"] == "tenant")
        listed = {s["metric"]["tenant"] for s in prom.query(
            variable["query"]["query"].replace("label_values(", "").rsplit(",", 1)[0].replace("$instance", ".*"))}
        assert {"unnamed", "rpm-limited", "tokens", "budgeted", "streamer", "free", "late"} <= listed
        exprs = [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
                 for t in p["targets"] if "gateway_tenant_" in t["expr"]]
        exprs += [(r["alert"], without_threshold(r["expr"])) for r in alert_rules() if "gateway_tenant_" in r["expr"]]
        assert len(exprs) >= 9
        empty = []
        for where, expr in exprs:
            # The queue's times exist only for requests that got past the limits: "budgeted" has
            # spent its budget by now, "free" is served.
            tenant = "free" if "gateway_tenant_queue_seconds" in expr else "budgeted"
            result = prom.query(substitute(expr, tenant=tenant))
            values = [float(s["value"][1]) for s in result]
            if not values or all(math.isnan(v) for v in values):
                empty.append(f"{where}: {expr}")
        assert not empty, "tenant expressions without data:\n" + "\n".join(empty)
        [used] = prom.query(substitute(next(e for t, e in exprs if t.startswith("Token budget used")), "budgeted"))
        counted = max(metric(server, "gateway_tenant_budget_used_tokens", tenant="budgeted") for server in fleet.servers)
        assert float(used["value"][1]) == pytest.approx(counted / BUDGET) and counted >= BUDGET


def test_without_redis_each_instance_limits_on_its_own(fleet: Fleet) -> None:
    fleet.redis.stop()
    try:
        # 'rpm-limited' is spent in Redis; each instance now counts it afresh in its own memory
        for server in fleet.servers:
            before = metric(server, "gateway_tenant_limiter_degraded_total")
            rpm = client(server, "sk-rpm")
            for _ in range(3):
                assert rpm.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
            with pytest.raises(openai.RateLimitError):
                rpm.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=1)
            assert metric(server, "gateway_tenant_limiter_degraded_total") - before == 4
            assert "tenant limits are counted per instance" in server.log()
    finally:
        fleet.redis.start()
    # Redis is tried again after auth.redis_retry_s (1 s)
    before = metric(fleet.a, "gateway_tenant_limiter_duration_seconds_count", backend="redis")

    def back_on_redis() -> bool:
        client(fleet.a, "sk-tokens").completions.create(model=SERVED_NAME, prompt=[1], max_tokens=1)
        return metric(fleet.a, "gateway_tenant_limiter_duration_seconds_count", backend="redis") > before

    assert wait_for(back_on_redis, timeout=15, interval=0.5)


def test_after_a_restart_the_budget_is_still_spent(fleet: Fleet) -> None:
    """Instance a restarts without Redis (which, restarted above, has forgotten every count): its
    budget count starts from the usage store, where the spent budget is."""
    assert fleet.a.stop() == 0
    env = {k: v for k, v in fleet.env.items() if k != "LLM_GATEWAY_AUTH__REDIS_URL"}
    (fleet.tmp / "a2").mkdir()
    fleet.servers[0] = start_gateway(fleet.tmp / "a2", extra_args=fleet.args, env=env)
    with pytest.raises(openai.RateLimitError) as caught:
        client(fleet.a, "sk-budget").completions.create(model=SERVED_NAME, prompt=[1], max_tokens=1)
    assert caught.value.code == "insufficient_quota"
    assert status_of(fleet.a, "sk-free") == 200
