"""How many event-loop turns the gateway's own path costs a streamed request, from the ASGI call to
its first body bytes, with an engine that answers at once (the scripted engine).

Why turns and not time: when the loop is busy (hundreds of streams on the GPU), every turn of the
loop runs every ready callback first, so each turn a new request waits costs it a whole iteration
(milliseconds there). That is what a light tenant waits for at exactly `max_num_seqs`
(docs/performance/fair-share.md, docs/performance/event-loop.md). A change that adds an `await`
that yields on this path (a thread hop, a lock, a queue) adds a turn; this budget says so
deterministically, on any machine, where a latency threshold could not."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from server.app import build_app
from server.lifecycle.holder import EngineHolder
from server.metrics import GatewayMetrics
from server.settings import AuthSettings, EngineProfile, Settings
from server.settings.keys_file import hashed
from server.tenants.service import Tenancy
from testbed.fakes import FakeEngine

# measured with starlette's ASGI path and the scripted engine: the engine is called in the turn the
# request arrives in, and the first chunk goes out one turn later, from the task starlette starts for
# a streamed body (beside the one that watches for a disconnect). Before the generation work ran in
# the request's own task (routes/openai.cancel_on_disconnect), it took four.
TURNS_TO_ENGINE = 0
TURNS_TO_FIRST_BYTES = 1
KEY = "sk-light"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class TurnCounter:
    """A task that counts the loop's turns: it runs once per iteration of the loop."""

    def __init__(self) -> None:
        self.turns = 0
        self.marks: dict[str, int] = {}

    async def run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, self.turns)


def gateway(tmp_path: Path, counter: TurnCounter, *, keys: bool) -> tuple[Any, EngineHolder]:
    auth = {}
    if keys:  # tenancy on: admission with exact reservations, the fair queue, usage
        keys_file = tmp_path / "keys.yaml"
        keys_file.write_text(yaml.safe_dump({"keys": [{"name": "light", "key": hashed(KEY)}]}))
        auth = {"auth": AuthSettings(keys_file=keys_file, usage_db=tmp_path / "usage.sqlite3")}
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"), **auth)
    engine = FakeEngine()
    generate = engine.generate

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.mark("engine")
        return generate(*args, **kwargs)

    engine.generate = counted  # type: ignore[method-assign]

    async def factory(_: Settings) -> FakeEngine:
        return engine

    holder = EngineHolder(settings, factory)
    app = build_app(settings, holder, GatewayMetrics(CollectorRegistry()), Tenancy(settings))

    async def timed(scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                counter.mark("first_bytes")
            await send(message)

        counter.marks.clear()
        counter.mark("arrived")
        await app(scope, receive, sending)

    return timed, holder


@pytest.mark.anyio
@pytest.mark.parametrize("keys", [False, True], ids=["open", "tenants"])
@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": "a b c"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
], ids=["completions", "chat"])
async def test_a_streamed_request_reaches_its_first_bytes_in_few_turns(
        tmp_path: Path, keys: bool, route: str, body: dict[str, Any]) -> None:
    counter = TurnCounter()
    app, holder = gateway(tmp_path, counter, keys=keys)
    await holder.start()
    task = asyncio.create_task(counter.run())
    headers = {"Authorization": f"Bearer {KEY}"} if keys else {}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            for _ in range(3):  # the first request also warms what is made once
                r = await client.post(route, json={"model": "fake", "max_tokens": 3, "stream": True, **body},
                                      headers=headers)
                assert r.status_code == 200, r.text
                assert "data: [DONE]" in r.text
    finally:
        task.cancel()
    turns = {k: v - counter.marks["arrived"] for k, v in counter.marks.items()}
    assert turns["engine"] <= TURNS_TO_ENGINE, turns
    assert turns["first_bytes"] <= TURNS_TO_FIRST_BYTES, turns
