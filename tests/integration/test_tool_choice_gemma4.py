"""Issue 39 item 2 on the real CPU engine: with `tool_call_parser: gemma4` (what the H200 profiles
run), `tool_choice: "required"`, a named function, and Anthropic's `any` and `tool` return a call
every time, through the real OpenAI and anthropic SDKs.

vLLM leaves gemma4's required/named output free; the gateway constrains it to Gemma 4's own call
syntax (server/engine/tool_grammar.py) and vLLM's gemma4 parser reads the calls. SmolLM2 was never
taught that syntax, and every request samples at temperature 1.0, five at a time: a call in each
answer is the constraint's doing, not the model's habit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import openai
import pytest

from testbed.tool_deltas import check_responses_stream_is_plain, no_mismatch_logged, sdk_chat_calls, sdk_message_uses
from tests.conftest import SERVED_NAME, ServerProcess, start_gateway

TRIES = 5
CITIES = ["Paris", "London", "Tokyo"]
# Arguments the grammar bounds (an enum, an integer, a short string), so a call ends within
# max_tokens whatever the model samples; a free string is checked on its own below.
FORECAST_SCHEMA = {"type": "object", "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": CITIES},
    "days": {"type": "integer"},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "note": {"type": "string", "maxLength": 8},
}}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "description": "Weather forecast for a city",
                                             "parameters": FORECAST_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "enum": CITIES}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris over the next three days?"}]
HOT = {"temperature": 1.0}
T = TypeVar("T")


@pytest.fixture(scope="module")
def gemma4_gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_gateway(tmp_path_factory.mktemp("gemma4-tools"),
                           env={"LLM_GATEWAY_ENGINE__TOOL_CALL_PARSER": "gemma4"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(gemma4_gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gemma4_gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(gemma4_gateway: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gemma4_gateway.base_url, api_key="unused", max_retries=0, timeout=300)


def tries(send: Callable[[], T]) -> list[T]:
    """TRIES answers to the same request, sent together (the engine batches them)."""
    with ThreadPoolExecutor(TRIES) as pool:
        return list(pool.map(lambda _: send(), range(TRIES)))


def check_arguments(name: str, arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    assert isinstance(args, dict), arguments
    assert args.get("city") in CITIES, arguments  # required by both tools
    if name == "get_forecast":
        assert isinstance(args.get("days"), int), arguments
        assert args.get("unit", "celsius") in ("celsius", "fahrenheit"), arguments
    return args


@pytest.mark.parametrize("parallel", [None, False])
def test_required_returns_a_call_every_time(client: openai.OpenAI, parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    answers = tries(lambda: client.chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[FORECAST, TIME], tool_choice="required", max_tokens=160,
        extra_body=HOT, **extra))  # type: ignore[arg-type]
    for answer in answers:
        choice = answer.choices[0]
        calls = choice.message.tool_calls or []
        assert calls, choice
        for call in calls:
            assert call.id.startswith("call_") and call.function.name in ("get_forecast", "get_time"), call
        # Every call but a last one cut off by max_tokens is whole.
        for call in calls[:-1] if choice.finish_reason == "length" else calls:
            check_arguments(call.function.name, call.function.arguments)
        assert choice.message.content in ("", None), choice
        if parallel is False:  # one call, then the grammar lets only the end through
            assert len(calls) == 1 and choice.finish_reason == "tool_calls", choice
        else:
            assert choice.finish_reason in ("tool_calls", "length"), choice


def test_a_named_function_is_called_every_time(client: openai.OpenAI) -> None:
    answers = tries(lambda: client.chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[FORECAST, TIME], max_tokens=120, extra_body=HOT,
        tool_choice={"type": "function", "function": {"name": "get_time"}}))
    for answer in answers:
        choice = answer.choices[0]
        [call] = choice.message.tool_calls or [None]
        assert call is not None and call.function.name == "get_time", choice
        check_arguments("get_time", call.function.arguments)
        assert choice.finish_reason == "stop", choice  # as vllm serve: a named call keeps the engine's reason


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_forecast"}}])
def test_streamed_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=[FORECAST, TIME], tool_choice=tool_choice, max_tokens=120,
        parallel_tool_calls=False, stream=True, extra_body=HOT,
    ):
        for choice in chunk.choices:
            assert not (choice.delta.content or "").strip(), choice  # no call syntax leaks as text
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    [call] = calls.values()
    assert call["name"] in ("get_forecast", "get_time")
    if tool_choice != "required":
        assert call["name"] == "get_forecast"
    check_arguments(call["name"], call["arguments"])
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")


def test_a_free_string_argument_still_gives_a_call(client: openai.OpenAI) -> None:
    """An argument the grammar cannot bound (a string of any length): SmolLM2 may never close it,
    so max_tokens ends the answer inside the call, which vLLM's parser still reads as one."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[weather], tool_choice=choice,
                                                max_tokens=40, extra_body=HOT)  # type: ignore[arg-type]
        [call, *_] = answer.choices[0].message.tool_calls or [None]
        assert call is not None and call.function.name == "get_weather", answer
        assert isinstance(json.loads(call.function.arguments).get("city"), str), call


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in (FORECAST, TIME)]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "any", "disable_parallel_tool_use": True},
                                         {"type": "tool", "name": "get_time"}])
def test_anthropic_any_and_tool_return_a_call_every_time(claude: anthropic.Anthropic, tool_choice: Any) -> None:
    answers = tries(lambda: claude.messages.create(
        model=SERVED_NAME, max_tokens=160, messages=ASK, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
        tool_choice=tool_choice, extra_body=HOT))
    for message in answers:
        uses = [b for b in message.content if b.type == "tool_use"]
        assert uses, message
        if tool_choice["type"] == "tool" or tool_choice.get("disable_parallel_tool_use"):
            assert len(uses) == 1 and message.stop_reason == "tool_use", message
        else:
            assert message.stop_reason in ("tool_use", "max_tokens"), message
        if tool_choice["type"] == "tool":
            assert uses[0].name == "get_time", message
        for use in uses if message.stop_reason == "tool_use" else uses[:-1]:
            assert use.id and use.name in ("get_forecast", "get_time"), use
            check_arguments(use.name, json.dumps(use.input))


def test_streamed_arguments_are_the_plain_arguments_in_every_api(client: openai.OpenAI, claude: anthropic.Anthropic,
                                                                  gemma4_gateway: ServerProcess) -> None:
    """Gemma 4 calls, greedy: chat and /v1/responses (OpenAI SDK) and /v1/messages (anthropic SDK,
    `messages.stream()`) stream argument pieces that make the non-streamed arguments exactly, the
    call in more than one piece."""
    named = {"type": "function", "function": {"name": "get_forecast"}}
    kwargs: dict[str, Any] = dict(model=SERVED_NAME, messages=ASK, tools=[FORECAST, TIME], tool_choice=named,
                                  max_tokens=120, temperature=0)
    [parsed] = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    calls, finish = sdk_chat_calls(client.chat.completions.create(stream=True, **kwargs))
    assert [(c["name"], c["arguments"]) for c in calls] == [(parsed.function.name, parsed.function.arguments)]
    assert calls[0]["pieces"] > 1 and finish == "stop"
    check_arguments(parsed.function.name, parsed.function.arguments)

    tools = [{"type": "function", **t["function"]} for t in (FORECAST, TIME)]
    rkwargs: dict[str, Any] = dict(model=SERVED_NAME, input=ASK, tools=tools, temperature=0, max_output_tokens=120,
                                   tool_choice={"type": "function", "name": "get_forecast"})
    check_responses_stream_is_plain(client, **rkwargs)

    mkwargs: dict[str, Any] = dict(model=SERVED_NAME, max_tokens=160, messages=ASK, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "get_forecast"}, extra_body={"temperature": 0})
    plain_uses = [b for b in claude.messages.create(**mkwargs).content if b.type == "tool_use"]
    with claude.messages.stream(**mkwargs) as mstream:
        uses, message = sdk_message_uses(mstream)
    assert [(u["name"], u["arguments"]) for u in uses] == [
        (b.name, json.dumps(b.input, ensure_ascii=False)) for b in plain_uses]
    assert uses and uses[0]["pieces"] > 1 and message.stop_reason == "tool_use"
    assert no_mismatch_logged(gemma4_gateway)


def test_bad_tool_choices_stay_clean_4xx(client: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SERVED_NAME, messages=ASK, tools=[FORECAST], max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "tool_choice" and error["code"] == 400, error
    assert "get_time" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=SERVED_NAME, messages=ASK, tool_choice="required", max_tokens=8)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "tool_choice"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=SERVED_NAME, max_tokens=8, messages=ASK,  # type: ignore[arg-type]
                               tools=ANTHROPIC_TOOLS[:1], tool_choice={"type": "tool", "name": "get_time"})
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
