"""Streamed chat with tools and with a reasoning parser, on the scripted engine: content goes
out as it comes (a split call opener is held, a look-alike released), logprobs are all
delivered, and the reasoning is split from the content, plain and streamed."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from server.engine import SamplingOptions
from testbed.fakes import FakeEngine, FakeReasoningParser
from testbed.tool_deltas import merged_calls
from tests.unit.test_tools_fake import ASK, WEATHER, started

CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class RecordingEngine(FakeEngine):
    """Remembers the sampling options of each request."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.options: list[SamplingOptions] = []

    def make_sampling(self, options: SamplingOptions) -> SamplingOptions:
        self.options.append(options)
        return super().make_sampling(options)


def scripted(pieces: list[str], *, tools: str | None = "hermes", reasoning: str | None = None) -> RecordingEngine:
    engine = RecordingEngine(reply_pieces=pieces)
    engine.info.tool_call_parser = tools
    engine.info.reasoning_parser = reasoning
    return engine


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The choice-0 entries of each chunk, in order (the role chunk left out)."""
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "stream": True, **body})
    assert r.status_code == 200, r.text
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    return [c["choices"][0] for c in chunks if c["choices"]][1:]


def contents(deltas: list[dict[str, Any]]) -> list[str]:
    return [d["delta"]["content"] for d in deltas if d["delta"].get("content")]


@pytest.mark.anyio
async def test_content_with_tools_streams_in_several_deltas_before_the_end() -> None:
    client = await started(scripted(["The weather ", "is fine ", "today", "."]))
    deltas = await stream(client, {"tools": [WEATHER]})
    assert contents(deltas) == ["The weather ", "is fine ", "today", "."]
    last_content = max(i for i, d in enumerate(deltas) if d["delta"].get("content"))
    assert deltas[last_content]["finish_reason"] is None
    assert deltas[-1]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_a_call_opener_split_across_deltas_is_not_leaked() -> None:
    pieces = ["Sure", ", checking. <to", "ol_c", "all>" + CALL_TEXT[len("<tool_call>"):]]
    client = await started(scripted(pieces))
    deltas = await stream(client, {"tools": [WEATHER]})
    assert contents(deltas) == ["Sure", ", checking. "]
    assert not any("<" in c for c in contents(deltas))
    [call] = merged_calls(deltas)
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    plain = (await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})).json()
    assert plain["choices"][0]["message"]["content"] == "".join(contents(deltas))


@pytest.mark.anyio
async def test_text_that_only_looks_like_an_opener_is_released() -> None:
    client = await started(scripted(["a <tool", "box> is ", "handy <tool_c"]))
    deltas = await stream(client, {"tools": [WEATHER]})
    assert contents(deltas) == ["a ", "<toolbox> is ", "handy ", "<tool_c"]  # the tail: at the end
    assert "".join(contents(deltas)) == "a <toolbox> is handy <tool_c"
    assert not any("tool_calls" in d["delta"] for d in deltas)
    assert deltas[-1]["finish_reason"] == "stop"


@pytest.mark.anyio
async def test_every_token_logprob_is_delivered_when_part_is_held() -> None:
    pieces = ["Sure", " <tool", "_call>" + CALL_TEXT[len("<tool_call>"):]]
    client = await started(scripted(pieces))
    deltas = await stream(client, {"tools": [WEATHER], "logprobs": True})
    tokens = [e["token"] for d in deltas if d.get("logprobs") for e in d["logprobs"]["content"]]
    assert tokens == pieces
    assert deltas[0]["delta"]["content"] == "Sure" and deltas[0]["logprobs"]["content"][0]["token"] == "Sure"


@pytest.mark.anyio
async def test_required_is_still_held_whole() -> None:
    pieces = ['[{"name": "get_weather", ', '"parameters": {"city": "Rome"}}]']
    client = await started(scripted(pieces, tools=None))
    deltas = await stream(client, {"tools": [WEATHER], "tool_choice": "required"})
    assert contents(deltas) == []
    [call] = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}


REASONED = ["<thi", "nk>Paris is ", "in France.</th", "ink>It is ", "sunny."]


@pytest.mark.anyio
async def test_reasoning_plain_and_streamed() -> None:
    engine = scripted(REASONED, tools=None, reasoning="fake")
    client = await started(engine)
    r = await client.post("/v1/chat/completions", json={"messages": ASK})
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == "Paris is in France." and message["content"] == "It is sunny."
    assert engine.options[-1].skip_special_tokens is False  # the parser's markers must stay in the text
    deltas = await stream(client, {})
    reasoning = [d["delta"]["reasoning"] for d in deltas if d["delta"].get("reasoning")]
    assert "".join(reasoning) == "Paris is in France." and len(reasoning) > 1
    assert "".join(contents(deltas)) == "It is sunny." and len(contents(deltas)) > 1
    first_content = next(i for i, d in enumerate(deltas) if d["delta"].get("content"))
    assert not any(d["delta"].get("reasoning") for d in deltas[first_content:])
    assert deltas[-1]["finish_reason"] == "stop"
    # a stop on EOS (stop_reason null): the parser is told, so it leaves the EOS id out
    assert FakeReasoningParser.made[-1].ended_on_stop_token is True


@pytest.mark.anyio
async def test_reasoning_with_tools_reads_calls_from_the_content_only() -> None:
    pieces = ["<think>Look it up; a <tool_call> ", "is needed.</think>", "Checking. ", CALL_TEXT]
    client = await started(scripted(pieces, reasoning="fake"))
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning"] == "Look it up; a <tool_call> is needed."
    assert choice["message"]["content"] == "Checking. " and choice["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in choice["message"]["tool_calls"]] == ["get_weather"]
    deltas = await stream(client, {"tools": [WEATHER]})
    assert "".join(d["delta"].get("reasoning") or "" for d in deltas) == "Look it up; a <tool_call> is needed."
    assert contents(deltas) == ["Checking. "]
    assert [c["name"] for c in merged_calls(deltas)] == ["get_weather"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.anyio
async def test_all_reasoning_has_null_content_and_no_parser_has_null_reasoning() -> None:
    client = await started(scripted(["<think>only ", "thinking"], tools=None, reasoning="fake"))
    message = (await client.post("/v1/chat/completions", json={"messages": ASK})).json()["choices"][0]["message"]
    assert message["reasoning"] == "only thinking" and message["content"] is None
    client = await started(scripted(["<think>not parsed</think>"], tools=None))
    message = (await client.post("/v1/chat/completions", json={"messages": ASK})).json()["choices"][0]["message"]
    assert message["reasoning"] is None and message["content"] == "<think>not parsed</think>"
    deltas = await stream(client, {})
    assert not any("reasoning" in d["delta"] for d in deltas)


TWO_CALLS = ('Checking both. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\"Île\\" 東京", '
             '"days": 3}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


def cut(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.anyio
@pytest.mark.parametrize("size", [1, 3, 10])
async def test_call_arguments_stream_in_pieces_that_make_the_parsed_arguments(size: int) -> None:
    client = await started(scripted(cut(TWO_CALLS, size)))
    plain = (await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})).json()
    parsed = plain["choices"][0]["message"]["tool_calls"]
    deltas = await stream(client, {"tools": [WEATHER]})
    calls = merged_calls(deltas)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (p["function"]["name"], p["function"]["arguments"]) for p in parsed]
    assert calls[0]["pieces"] > 2  # as written, not whole at the end
    later = [t for d in deltas for t in d["delta"].get("tool_calls") or [] if "id" not in t]
    assert later and all(set(t) == {"index", "function"} and set(t["function"]) == {"arguments"} for t in later)
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d["delta"])
    assert first_call < len(deltas) - 3 and deltas[-1]["finish_reason"] == "tool_calls"
    assert "".join(contents(deltas)) == "Checking both. "
