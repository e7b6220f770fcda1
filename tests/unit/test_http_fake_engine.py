"""The HTTP layer with a scripted engine: states, error shapes, SSE errors, lease accounting."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.app import build_app
from server.lifecycle.holder import EngineHolder, EngineState
from server.metrics import GatewayMetrics
from server.settings import EngineProfile, Settings
from server.tenants.service import Tenancy
from testbed.fakes import FakeEngine


def make(engine: FakeEngine) -> tuple[httpx.AsyncClient, EngineHolder]:
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"))

    async def factory(_: Settings) -> FakeEngine:
        return engine

    holder = EngineHolder(settings, factory)
    app = build_app(settings, holder, GatewayMetrics(CollectorRegistry()), Tenancy(settings))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, holder


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_not_ready_while_starting() -> None:
    client, holder = make(FakeEngine())
    assert holder.state is EngineState.STARTING
    assert (await client.get("/ready")).status_code == 503
    assert (await client.get("/health")).status_code == 200
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": "hi"})
    assert r.status_code == 503
    assert r.headers["retry-after"]
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    await holder.start()
    assert (await client.get("/ready")).status_code == 200


@pytest.mark.anyio
async def test_plain_and_stream() -> None:
    engine = FakeEngine()
    client, holder = make(engine)
    await holder.start()
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": "a b c", "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == " w0 w1 w2"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    r = await client.post("/v1/completions", json={
        "prompt": "a b", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 3
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_error_after_stream_started_is_an_sse_event() -> None:
    engine = FakeEngine(fail_after=2)
    client, holder = make(engine)
    await holder.start()
    r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "scripted engine failure" in error["message"]
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_validation_errors_have_openai_shape() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    cases = [
        (b"{", 400), (b'{"prompt": 5}', 400), (b'{"prompt": "x", "model": "other"}', 404),
        (b'{"prompt": "x", "temperature": -1}', 400), (b'{"prompt": "x", "max_tokens": 0}', 400),
        (b'{"prompt": "' + b"x " * 100 + b'"}', 400), (b"\xff", 400),
    ]
    for body, status in cases:
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_dead_engine_turns_health_red() -> None:
    engine = FakeEngine()
    client, holder = make(engine)
    await holder.start()
    engine.dead = True
    assert (await client.get("/health")).status_code == 503
    assert (await client.get("/ready")).status_code == 503
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503


@pytest.mark.anyio
async def test_drain_refuses_new_work_and_waits() -> None:
    engine = FakeEngine(delay_s=0.01)
    client, holder = make(engine)
    await holder.start()
    import asyncio

    slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20}))
    await asyncio.sleep(0.05)
    holder.begin_drain()
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503
    assert (await slow).status_code == 200
    assert await holder.stop(drain_timeout=1)
    assert holder.state is EngineState.STOPPED


@pytest.mark.anyio
async def test_a_reload_applies_the_new_profiles_limits() -> None:
    from server.settings import LimitSettings

    client, holder = make(FakeEngine())
    await holder.start()
    body = {"model": "fake", "prompt": "a b", "max_tokens": 2, "n": 2}
    assert (await client.post("/v1/completions", json=body)).status_code == 200
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    stricter = holder.settings.model_copy(update={"limits": LimitSettings(max_n=1)})
    assert (await holder.reload(stricter)).outcome == "success"
    for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        r = await client.post(path, json=payload)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"
