"""server/metrics.py and its wiring, on fresh registries and a scripted engine (no vLLM)."""

from __future__ import annotations

import re
import shutil
import subprocess

import httpx
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from server.app import build_app
from server.lifecycle.holder import EngineHolder
from server.metrics import (
    DURATION_BUCKETS,
    ENGINE_STATES,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    GatewayMetrics,
    exposition,
)
from server.settings import EngineProfile, Settings
from server.settings.keys_file import Tenant, TenantLimits
from server.tenants.service import Tenancy
from testbed.fakes import FakeEngine


def snapshot(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    body, _ = exposition(metrics, openmetrics=False, include_vllm=False)
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(snap: dict, name: str, **labels: str) -> float:
    return snap.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_app(engine: FakeEngine) -> tuple[httpx.AsyncClient, EngineHolder, GatewayMetrics]:
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"))

    async def factory(_: Settings) -> FakeEngine:
        return engine

    holder = EngineHolder(settings, factory)
    metrics = GatewayMetrics(CollectorRegistry())
    app = build_app(settings, holder, metrics, Tenancy(settings))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, holder, metrics


def test_registries_are_independent_and_not_global() -> None:
    a, b = GatewayMetrics(), GatewayMetrics()
    a.requests.labels(route="/v1/completions", status="200").inc(3)
    assert get(snapshot(a), "gateway_requests_total", route="/v1/completions", status="200") == 3
    assert get(snapshot(b), "gateway_requests_total", route="/v1/completions", status="200") == 0
    assert REGISTRY.get_sample_value("gateway_requests_total", {"route": "/v1/completions", "status": "200"}) is None


def test_families_names_units_and_buckets() -> None:
    m = GatewayMetrics(CollectorRegistry())
    families = {f.name: f for f in m.registry.collect()}
    assert all(name.startswith("gateway_") and ":" not in name for name in families)
    expected = {
        "gateway_requests": "counter", "gateway_requests_in_flight": "gauge",
        "gateway_request_duration_seconds": "histogram", "gateway_time_to_first_token_seconds": "histogram",
        "gateway_time_per_output_token_seconds": "histogram", "gateway_prompt_tokens": "counter",
        "gateway_completion_tokens": "counter", "gateway_request_finish": "counter",
        "gateway_client_disconnects": "counter", "gateway_rejections": "counter",
        "gateway_engine_state": "gauge", "gateway_engine_reloads": "counter",
        "gateway_engine_stalls": "counter", "gateway_engine_quiet_seconds": "gauge",
        "gateway_engine_reload_duration_seconds": "histogram", "gateway_engine_reload_queued_requests": "counter",
        "gateway_engine_reload_aborted_requests": "counter", "gateway_engine_reload_pause_seconds": "histogram",
        "gateway_engine_reload_kept_requests": "counter", "gateway_profile": "info", "gateway_build": "info",
        "gateway_tenant_requests": "counter", "gateway_tenant_tokens": "counter",
        "gateway_tenant_rate_limited": "counter", "gateway_tenant_budget_tokens": "gauge",
        "gateway_tenant_budget_used_tokens": "gauge", "gateway_tenant_limiter_duration_seconds": "histogram",
        "gateway_tenant_limiter_degraded": "counter", "gateway_tenant_keys_reloads": "counter",
        "gateway_tenant_queue_seconds": "histogram", "gateway_tenant_queued_requests": "gauge",
        "gateway_tenant_share": "gauge",
        "gateway_gc_full_collection_seconds": "histogram",
    }
    assert {n: f.type for n, f in families.items()} == expected
    for name, family in families.items():
        if family.type == "histogram":
            assert name.endswith("_seconds")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        if family.type != "info":
            assert len(labels) <= 2, (name, labels)
    m.ttft.labels(route="/v1/completions").observe(0.07)
    buckets = [dict(lbls)["le"] for (n, lbls) in snapshot(m) if n == "gateway_time_to_first_token_seconds_bucket"]
    assert [float(b) for b in buckets if b != "+Inf"] == list(TTFT_BUCKETS)
    assert list(TPOT_BUCKETS) == sorted(TPOT_BUCKETS) and list(DURATION_BUCKETS) == sorted(DURATION_BUCKETS)
    snap = snapshot(m)
    assert get(snap, "gateway_time_to_first_token_seconds_bucket", route="/v1/completions", le="0.06") == 0
    assert get(snap, "gateway_time_to_first_token_seconds_bucket", route="/v1/completions", le="0.08") == 1


def test_engine_state_is_one_hot_and_rejections_map_to_reasons() -> None:
    m = GatewayMetrics()
    for state in ENGINE_STATES:
        m.set_engine_state(state)
        snap = snapshot(m)
        assert [s for s in ENGINE_STATES if get(snap, "gateway_engine_state", state=s) == 1] == [state]
    for status, reason in ((401, "auth"), (403, "auth"), (429, "overload"), (400, "validation"),
                           (404, "validation"), (413, "validation"), (503, "unavailable")):
        before = get(snapshot(m), "gateway_rejections_total", reason=reason)
        m.observe_rejection(status)
        assert get(snapshot(m), "gateway_rejections_total", reason=reason) == before + 1
    for reason in ("rate_limit", "budget"):  # a tenant's 429s, named by the middleware that refused them
        m.observe_rejection(429, reason)
        assert get(snapshot(m), "gateway_rejections_total", reason=reason) == 1
    total = sum(v for (n, _), v in snapshot(m).items() if n == "gateway_rejections_total")
    m.observe_rejection(500)
    m.observe_rejection(200)
    assert sum(v for (n, _), v in snapshot(m).items() if n == "gateway_rejections_total") == total


def test_exposition_appends_only_vllm_families_and_one_eof() -> None:
    m = GatewayMetrics()
    probe = Gauge("vllm:unit_test_probe", "A stand-in for a vLLM family.", ["model_name"], registry=REGISTRY)
    try:
        probe.labels(model_name="m").set(2)
        text, ctype = exposition(m, openmetrics=False)
        assert ctype.startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(text.decode())}
        assert "vllm:unit_test_probe" in names and "gateway_requests" in names
        # the global registry's process/python collectors are not vLLM's and stay out
        assert not any(n.startswith(("python_", "process_")) for n in names)
        om, octype = exposition(m, openmetrics=True)
        assert octype.startswith("application/openmetrics-text")
        assert om.decode().count("# EOF") == 1 and om.endswith(b"# EOF\n")
        assert b'vllm:unit_test_probe{model_name="m"} 2.0' in om
        without, _ = exposition(m, openmetrics=False, include_vllm=False)
        assert b"vllm:" not in without
    finally:
        REGISTRY.unregister(probe)


def test_exposition_passes_promtool_check_metrics() -> None:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: .ci/run installs the Debian package `prometheus`"
    m = GatewayMetrics()
    m.set_profile({"model": "m", "vllm_version": "0", "kv_sharing_fast_prefill": "false"})
    m.requests.labels(route="/v1/completions", status="200").inc()
    m.ttft.labels(route="/v1/completions").observe(0.1)
    m.reload_duration.observe(12)
    m.add_tenants([Tenant("acme", TenantLimits(budget_tokens=1000))])
    m.tenant_requests.labels(tenant="acme", status="429").inc()
    m.tenant_budget_used.labels(tenant="acme").set(10)
    m.limiter_duration.labels(backend="redis").observe(0.0004)
    body, _ = exposition(m, openmetrics=False, include_vllm=False)
    assert b'gateway_tenant_budget_tokens{tenant="acme"} 1000.0' in body
    r = subprocess.run([exe, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), (r.stdout + r.stderr).decode()
    assert re.search(rb"^gateway_requests_total\{", body, re.M)


@pytest.mark.anyio
async def test_middleware_counts_traffic_not_probes() -> None:
    client, holder, m = make_app(FakeEngine())
    await holder.start()
    for path in ("/metrics", "/health", "/ready", "/metrics", "/nope"):
        await client.get(path)
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": "a b c", "max_tokens": 3})
    assert r.status_code == 200
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": "a", "max_tokens": -1})
    assert r.status_code == 400
    r = await client.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 404
    snap = snapshot(m)
    requests = {lbls: v for (n, lbls), v in snap.items() if n == "gateway_requests_total"}
    assert requests == {
        (("route", "other"), ("status", "404")): 1,
        (("route", "/v1/completions"), ("status", "200")): 1,
        (("route", "/v1/completions"), ("status", "400")): 1,
        (("route", "/v1/completions"), ("status", "404")): 1,
    }
    # the unknown path is not a rejection; the bad request and the unknown model are
    assert get(snap, "gateway_rejections_total", reason="validation") == 2
    assert get(snap, "gateway_requests_in_flight", route="/v1/completions") == 0
    assert get(snap, "gateway_prompt_tokens_total", route="/v1/completions") == 3
    assert get(snap, "gateway_completion_tokens_total", route="/v1/completions") == 3
    assert get(snap, "gateway_request_duration_seconds_count", route="/v1/completions") == 3
    # a plain response has no client-side TTFT (its first token arrives with its last byte)
    assert get(snap, "gateway_time_to_first_token_seconds_count", route="/v1/completions") == 0
    assert get(snap, "gateway_engine_state", state="serving") == 1


@pytest.mark.anyio
async def test_streams_observe_ttft_and_tpot() -> None:
    client, holder, m = make_app(FakeEngine())
    await holder.start()
    r = await client.post("/v1/completions", json={
        "model": "fake", "prompt": "a b", "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    snap = snapshot(m)
    assert get(snap, "gateway_time_to_first_token_seconds_count", route="/v1/completions") == 1
    assert get(snap, "gateway_time_per_output_token_seconds_count", route="/v1/completions") == 1
    assert get(snap, "gateway_completion_tokens_total", route="/v1/completions") == 4
    assert get(snap, "gateway_client_disconnects_total", route="/v1/completions") == 0
    reasons = {dict(lbls)["reason"]: v for (n, lbls), v in snap.items() if n == "gateway_request_finish_total"}
    assert sum(reasons.values()) == 1
