"""Tool calling through the real OpenAI SDK on the real CPU engine: the whole loop, plain and
streamed: a forced call, the client runs the tool, sends the result, gets the final answer."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import openai
import pytest

from testbed.tool_deltas import check_responses_stream_is_plain, no_mismatch_logged, sdk_chat_calls, sdk_message_uses
from tests.conftest import SERVED_NAME, ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 18, "sky": "cloudy"})


@pytest.fixture
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)


def finish_loop(client: openai.OpenAI, messages: list[Any], call_id: str, name: str, arguments: str) -> str:
    args = json.loads(arguments)
    assert name == "get_weather" and isinstance(args.get("city"), str)
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": get_weather(**args)},
    ]
    final = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.tool_calls in (None, [])
    assert final.choices[0].finish_reason in ("stop", "length")
    return final.choices[0].message.content or ""


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_loop_plain(client: openai.OpenAI, tool_choice: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=[WEATHER], tool_choice=tool_choice, max_tokens=60, temperature=0,
        parallel_tool_calls=False)
    choice = result.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert finish_loop(client, messages, call.id, call.function.name, call.function.arguments)


def test_tool_loop_streamed(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    assert finish == "stop" and list(calls) == [0]
    call = calls[0]
    assert call["id"].startswith("call_")
    assert finish_loop(client, messages, call["id"], call["name"], call["arguments"])


def test_streamed_answer_with_tools_present_arrives_piece_by_piece(client: openai.OpenAI) -> None:
    # Agents always send tools: their text answers must still stream (only a call is held).
    arrivals: list[tuple[float, str]] = []  # (time, content) of each content delta
    finished_at = None
    for chunk in client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Write two sentences about the sea."}],
        tools=[WEATHER], tool_choice="auto", max_tokens=40, temperature=0, stream=True,
    ):
        for choice in chunk.choices:
            if choice.delta.content:
                arrivals.append((time.monotonic(), choice.delta.content))
            if choice.finish_reason:
                finished_at = time.monotonic()
                assert choice.finish_reason in ("stop", "length")
                assert not choice.delta.tool_calls
    assert finished_at is not None and len(arrivals) > 1, arrivals
    assert arrivals[0][0] < arrivals[-1][0] <= finished_at, "the first content came with the last token"


def test_tool_result_for_an_unknown_call_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=SERVED_NAME, tools=[WEATHER], max_tokens=5, messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}])
    assert info.value.body["param"] == "messages"  # type: ignore[index]


def test_tool_calls_finish_reason_is_counted(client: openai.OpenAI, gateway: ServerProcess) -> None:
    import httpx

    client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                   tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    metrics = httpx.get(gateway.base_url + "/metrics", timeout=10).text
    assert any(line.startswith("gateway_request_finish_total{") and 'reason="tool_calls"' in line
               for line in metrics.splitlines()), metrics[:2000]


def test_streamed_arguments_are_the_plain_arguments_in_every_api(client: openai.OpenAI, gateway: ServerProcess) -> None:
    """Chat, /v1/responses (OpenAI SDK) and /v1/messages (anthropic SDK, `messages.stream()`), a
    named function (the CPU profile forces it into JSON, streamed as written) and `auto` (hermes
    calls): the streamed argument pieces make the non-streamed arguments exactly, a call in more
    than one piece. (tests/integration/test_vllm_parity_tools.py does it over the parity data.)"""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "auto"):
        kwargs: dict[str, Any] = dict(model=SERVED_NAME, messages=ask, tools=[WEATHER], tool_choice=choice,
                                      temperature=0, max_tokens=60)
        plain = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = sdk_chat_calls(client.chat.completions.create(stream=True, **kwargs))
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (t.function.name, t.function.arguments) for t in plain.message.tool_calls or []]
        assert finish == plain.finish_reason
        assert all(c["pieces"] > 1 for c in calls if len(c["arguments"]) > 12), calls
        assert calls or choice == "auto"  # a named function is always called

    tool = {"type": "function", **WEATHER["function"]}
    rkwargs: dict[str, Any] = dict(model=SERVED_NAME, input=ask, tools=[tool], temperature=0, max_output_tokens=60,
                                   tool_choice={"type": "function", "name": "get_weather"})
    check_responses_stream_is_plain(client, **rkwargs)

    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0)
    mkwargs: dict[str, Any] = dict(model=SERVED_NAME, max_tokens=60, messages=ask, extra_body={"temperature": 0},
                                   tools=[{
                                       "name": "get_weather", "description": WEATHER["function"]["description"],
                                       "input_schema": WEATHER["function"]["parameters"]}],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    plain_uses = [b for b in claude.messages.create(**mkwargs).content if b.type == "tool_use"]
    with claude.messages.stream(**mkwargs) as mstream:
        uses, message = sdk_message_uses(mstream)
    assert [(u["name"], json.loads(u["arguments"])) for u in uses] == [(b.name, b.input) for b in plain_uses]
    assert uses and uses[0]["pieces"] > 1 and message.stop_reason == "tool_use"
    assert no_mismatch_logged(gateway)
