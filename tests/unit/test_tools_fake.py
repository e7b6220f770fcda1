"""Tool calling on the scripted engine: the 400s (each naming its field) and the output shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from server.app import build_app
from server.lifecycle.holder import EngineHolder
from server.metrics import GatewayMetrics
from server.settings import EngineProfile, Settings
from server.tenants.service import Tenancy
from testbed.fakes import FakeEngine
from testbed.tool_deltas import merged_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


async def started(engine: FakeEngine) -> httpx.AsyncClient:
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake"))

    async def factory(_: Settings) -> FakeEngine:
        return engine

    holder = EngineHolder(settings, factory)
    app = build_app(settings, holder, GatewayMetrics(CollectorRegistry()), Tenancy(settings))
    await holder.start()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def engine_with(reply: str | None = None, parser: str | None = "hermes") -> FakeEngine:
    engine = FakeEngine(reply=reply)
    engine.info.tool_call_parser = parser
    return engine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": ["x"]}, "tools", "tools.0"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0].function"),
    ({"tools": [{"type": "web_search"}]}, "tools", "type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages", "answers no earlier"),
    ({"tools": [WEATHER], "messages": ASK + [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"tools": [WEATHER], "messages": ASK + [
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages", "not valid JSON"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "param", "words"), BAD)
async def test_bad_tool_requests_are_400s_naming_the_field(extra: dict[str, Any], param: str, words: str) -> None:
    client = await started(engine_with())
    r = await client.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.anyio
async def test_auto_without_a_parser_is_refused_but_required_and_named_work() -> None:
    client = await started(engine_with('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', parser=None))
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "tool_call_parser" in r.json()["error"]["message"]
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.anyio
async def test_named_choice_takes_the_output_as_arguments_and_keeps_stop() -> None:
    client = await started(engine_with('{"city": "Oslo"}', parser=None))
    r = await client.post("/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


@pytest.mark.anyio
async def test_auto_parses_calls_plain_and_streamed_and_passes_tools_to_the_template() -> None:
    reply = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    engine = engine_with(reply)
    client = await started(engine)
    body = {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "tools": [WEATHER], "n": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.rendered_tools[-1] == [WEATHER]
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look."
        [call] = merged_calls(deltas)  # index 0, id, type and name in its first piece
        assert call["id"].startswith("call_")
        assert json.loads(call["arguments"]) == {"city": "Rome"}
        assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_tool_choice_none_keeps_text_and_no_tools_renders_none() -> None:
    engine = engine_with("plain words")
    client = await started(engine)
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "plain words" and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"
    await client.post("/v1/chat/completions", json={"messages": ASK})
    assert engine.rendered_tools[-1] is None


def test_profile_chat_template_must_exist_and_the_shipped_one_does() -> None:
    from pydantic import ValidationError

    from server.settings import load_settings
    from server.settings.engine import TEMPLATES_DIR

    with pytest.raises(ValidationError, match="engine.chat_template: no file"):
        EngineProfile(device="cpu", kv_cache_memory_bytes=1, chat_template="missing.jinja")
    profile = load_settings(Path(__file__).parents[2] / "configs" / "embedded-cpu.yaml").engine
    assert profile.tool_call_parser == "hermes"
    assert profile.chat_template_path() == TEMPLATES_DIR / "smollm2-tools.jinja"


@pytest.mark.anyio
async def test_a_parser_of_its_own_syntax_reads_required_and_named_without_a_schema() -> None:
    """gemma4's way (vLLM 0.26, 0.32): no JSON schema for required/named, the parser reads the
    model's own calls, special tokens kept; required ends `tool_calls`, named keeps the reason."""
    reply = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}</tool_call>'
    engine = engine_with(reply, parser="own-syntax")
    client = await started(engine)
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    choice = r.json()["choices"][0]
    assert engine.sampled[-1].structured is None and engine.sampled[-1].skip_special_tokens is False
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Lima"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": named})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    engine.reply = "no call at all"
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": named})
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "no call at all", "tool_calls": []} or (
        choice["message"]["content"] == "no call at all" and not choice["message"].get("tool_calls"))


@pytest.mark.anyio
async def test_tool_choice_none_drops_call_syntax_when_the_parser_strips_it() -> None:
    engine = engine_with('Hi.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                         parser="own-syntax")
    client = await started(engine)
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Hi." and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
