"""/v1/messages and /v1/messages/count_tokens through the HTTP layer with the scripted engine: the
conversion to chat, the message shape and stop reasons, the stream's event order, tools, errors in
Anthropic's shape (validation, middleware and mid-stream), x-api-key, tenants, metrics and the
access log."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from server.protocol.anthropic import MessagesRequest
from server.serving.messages_items import chat_request, stop_reason
from testbed.fakes import FakeEngine
from tests.unit.test_http_fake_engine import make
from tests.unit.test_metrics import get, make_app, snapshot
from tests.unit.test_tenants_http import Gateway_
from tests.unit.test_tools_fake import engine_with, started

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 3, "messages": [{"role": "user", "content": "a b"}], **fields}


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == event_line[len("event: "):]
        out.append((data["type"], data))
    return out


def assert_anthropic_error(r: Any, status: int, kind: str, words: str = "") -> str:
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    assert payload["error"]["type"] == kind and words in payload["error"]["message"], payload
    return payload["error"]["message"]


def test_conversion_to_chat() -> None:
    req = MessagesRequest.model_validate(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        messages=[*ASK,
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "hmm", "signature": "s"},
                      {"type": "text", "text": "Looking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                      {"type": "text", "text": "Thanks"}]}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=5, metadata={"user_id": "u1"}))
    chat = chat_request(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nUse tools."
    assistant = chat.messages[2]
    assert [p.text for p in assistant.content] == ["Looking."]  # type: ignore[union-attr]
    assert assistant.tool_calls == [{"id": "toolu_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert chat.messages[3].tool_call_id == "toolu_1" and chat.messages[3].content == "sunny"
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["input_schema"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert (chat.stop, chat.temperature, chat.top_p, chat.top_k, chat.max_tokens) == (["END"], 0.5, 0.9, 5, 3)
    assert chat.add_generation_prompt and not chat.continue_final_message
    for anthropic, openai in (("auto", "auto"), ("any", "required"), ("none", "none")):
        req = MessagesRequest.model_validate(body(tools=[WEATHER], tool_choice={"type": anthropic}))
        assert chat_request(req).tool_choice == openai
    # a final assistant turn of text is a prefill: continued, not answered
    turns = [*ASK, {"role": "assistant", "content": "It is"}]
    prefill = chat_request(MessagesRequest.model_validate(body(messages=turns)))
    assert prefill.continue_final_message and not prefill.add_generation_prompt


def test_stop_reasons() -> None:
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # a stop token id is an ordinary end
    assert stop_reason("stop", None, False) == ("end_turn", None)


@pytest.mark.anyio
async def test_message_shape_usage_and_max_tokens() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/v1/messages", json=body(system="be brief", metadata={"user_id": "x"}))
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "text", "text": " w0 w1 w2"}]
    assert message["model"] == "fake" and message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    # "system: be brief user: a b assistant:" in the scripted tokenizer is 7 words
    assert message["usage"] == {"input_tokens": 7, "output_tokens": 3}


@pytest.mark.anyio
async def test_stream_event_order_and_text() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/v1/messages", json=body(stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    assert [kind for kind, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                            "content_block_delta", "content_block_delta", "content_block_stop",
                                            "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 4, "output_tokens": 0}  # "user: a b assistant:"
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta") == " w0 w1 w2"
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"input_tokens": 4, "output_tokens": 3}


@pytest.mark.anyio
async def test_tool_use_plain_and_streamed() -> None:
    for stream in (False, True):
        client = await started(engine_with("Let me check. " + CALL_TEXT))
        r = await client.post("/v1/messages", json=body(messages=ASK, tools=[WEATHER], stream=stream, max_tokens=20))
        assert r.status_code == 200, r.text
        if not stream:
            message = r.json()
            assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
            assert message["content"][0]["text"] == "Let me check. "
            call = message["content"][1]
            assert call["name"] == "get_weather" and call["input"] == {"city": "Paris"} and call["id"]
            assert message["stop_reason"] == "tool_use"
            continue
        events = events_of(r.text)
        starts = [e["content_block"] for k, e in events if k == "content_block_start"]
        assert [b["type"] for b in starts] == ["text", "tool_use"]
        assert starts[1]["name"] == "get_weather" and starts[1]["input"] == {}
        json_deltas = [e["delta"]["partial_json"] for k, e in events
                       if k == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
        assert json.loads("".join(json_deltas)) == {"city": "Paris"}
        assert [e["index"] for k, e in events if k == "content_block_stop"] == [0, 1]
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-1][0] == "message_stop"


@pytest.mark.anyio
async def test_tool_result_turn_reaches_the_template_and_choice_any_is_required() -> None:
    engine = engine_with("It is sunny.")
    client = await started(engine)
    messages = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    r = await client.post("/v1/messages", json=body(messages=messages, tools=[WEATHER], max_tokens=20))
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": "It is sunny."}] and r.json()["stop_reason"] == "end_turn"
    assert engine.rendered_tools[-1][0]["function"]["name"] == "get_weather"
    # count_tokens renders the same prompt, tools included
    r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


BAD: list[tuple[dict[str, Any], int, str, str]] = [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": []}, 400, "invalid_request_error", "at least one message"),
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 1000}, 400, "invalid_request_error", "max_model_len"),
    ({"temperature": -1}, 400, "invalid_request_error", "temperature"),
    ({"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "invalid_request_error", "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     400, "invalid_request_error", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({"messages": [*ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     400, "invalid_request_error", "answers no earlier"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "assistant turns"),
    ({"system": 5}, 400, "invalid_request_error", "system"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "status", "kind", "words"), BAD)
async def test_bad_requests_are_anthropic_errors(extra: dict[str, Any], status: int, kind: str, words: str) -> None:
    client = await started(engine_with())
    fields = body(**extra)
    fields = {k: v for k, v in fields.items() if v is not None}
    assert_anthropic_error(await client.post("/v1/messages", json=fields), status, kind, words)
    r = await client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error", "JSON")
    # the OpenAI routes keep OpenAI's shape
    r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


@pytest.mark.anyio
async def test_a_stream_that_fails_ends_with_an_error_event() -> None:
    client, holder = make(FakeEngine(fail_after=1))
    await holder.start()
    r = await client.post("/v1/messages", json=body(stream=True))
    events = events_of(r.text)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "overloaded_error"  # the engine died: 503
    assert "message_stop" not in [k for k, _ in events]


@pytest.mark.anyio
async def test_503_while_no_engine_serves_is_an_anthropic_error() -> None:
    client, _ = make(FakeEngine())  # never started
    assert_anthropic_error(await client.post("/v1/messages", json=body()), 503, "overloaded_error")
    r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": ASK})
    assert_anthropic_error(r, 503, "overloaded_error")


@pytest.mark.anyio
async def test_x_api_key_tenants_budget_and_auth_errors(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, end_streams_over_budget=True) as gw:
        r = await gw.client.post("/v1/messages", json=body())
        assert_anthropic_error(r, 401, "authentication_error", "x-api-key")
        r = await gw.client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-wrong"})
        assert_anthropic_error(r, 401, "authentication_error", "Incorrect API key")
        r = await gw.client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-free"})
        assert r.status_code == 200, r.text
        r = await gw.client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-other"})
        assert_anthropic_error(r, 404, "not_found_error", "fake")
        # the budget (40) is charged with the real usage, through x-api-key as through Bearer
        r = await gw.client.post("/v1/messages", json=body(max_tokens=10), headers={"x-api-key": "sk-budget"})
        assert r.status_code == 200 and r.json()["usage"] == {"input_tokens": 4, "output_tokens": 10}
        assert get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="budget") == 14
        # a stream past the budget ends with Anthropic's error event
        r = await gw.client.post("/v1/messages", json=body(max_tokens=40, stream=True),
                                 headers={"Authorization": "Bearer sk-budget"})
        events = events_of(r.text)
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "rate_limit_error"
        assert "quota" in events[-1][1]["error"]["message"]
        r = await gw.client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-budget"})
        assert_anthropic_error(r, 429, "rate_limit_error", "quota")
        assert r.headers["x-should-retry"] == "false"
        r = await gw.client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": ASK},
                                 headers={"x-api-key": "sk-free"})
        assert r.status_code == 200 and r.json() == {"input_tokens": 5}  # "user: Weather in Paris? assistant:"


@pytest.mark.anyio
async def test_metrics_route_label_and_access_log(caplog: pytest.LogCaptureFixture) -> None:
    client, holder, metrics = make_app(FakeEngine())
    await holder.start()
    with caplog.at_level(logging.INFO, logger="llm_gateway.access"):
        assert (await client.post("/v1/messages", json=body(stream=True))).status_code == 200
        assert (await client.post("/v1/messages", json=body(model="nope"))).status_code == 404
        r = await client.post("/v1/messages/count_tokens", json={"model": "fake", "messages": ASK})
        assert r.status_code == 200
    snap = snapshot(metrics)
    assert get(snap, "gateway_requests_total", route="/v1/messages", status="200") == 1
    assert get(snap, "gateway_requests_total", route="/v1/messages", status="404") == 1
    assert get(snap, "gateway_requests_total", route="/v1/messages/count_tokens", status="200") == 1
    assert get(snap, "gateway_completion_tokens_total", route="/v1/messages") == 3
    assert get(snap, "gateway_request_finish_total", route="/v1/messages", reason="length") == 1
    lines = [r.getMessage() for r in caplog.records if "route=/v1/messages " in r.getMessage()]
    assert any("status=200" in line and "msg_" in line and "completion_tokens=3" in line for line in lines), lines


@pytest.mark.anyio
async def test_reasoning_comes_back_as_thinking_blocks() -> None:
    engine = FakeEngine(reply_pieces=["<think>", "step one", "</think>", "Paris", "."])
    engine.info.reasoning_parser = "fake"
    client, holder = make(engine)
    await holder.start()
    r = await client.post("/v1/messages", json=body(max_tokens=10))
    content = r.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"]
    assert content[0]["thinking"] == "step one" and content[0]["signature"] and content[1]["text"] == "Paris."
    events = events_of((await client.post("/v1/messages", json=body(max_tokens=10, stream=True))).text)
    deltas = [e["delta"]["type"] for k, e in events if k == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "text_delta"]
    starts = [e["content_block"] for k, e in events if k == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    assert [e["index"] for k, e in events if k == "content_block_stop"] == [0, 1]
    # a thinking block sent back is accepted and left out of the prompt
    turn = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": content},
            {"role": "user", "content": "And?"}]
    r = await client.post("/v1/messages", json=body(messages=turn))
    assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_a_call_cut_off_by_max_tokens_comes_back_as_text() -> None:
    client = await started(engine_with('{"city": "Pa'))  # a named call forced into JSON, cut short
    r = await client.post("/v1/messages", json=body(messages=ASK, tools=[WEATHER],
                                                    tool_choice={"type": "tool", "name": "get_weather"}))
    message = r.json()
    assert message["content"] == [{"type": "text", "text": '{"city": "Pa'}], message
    assert message["stop_reason"] == "end_turn"  # the fake engine says "stop"; a real cut says max_tokens


@pytest.mark.anyio
async def test_tool_use_input_streams_in_pieces_that_make_the_input() -> None:
    from tests.unit.test_chat_stream_fake import TWO_CALLS, cut, scripted

    client = await started(scripted(cut(TWO_CALLS, 3)))
    plain = (await client.post("/v1/messages", json=body(messages=ASK, tools=[WEATHER], max_tokens=50))).json()
    r = await client.post("/v1/messages", json=body(messages=ASK, tools=[WEATHER], max_tokens=50, stream=True))
    events = events_of(r.text)
    starts = {e["index"]: e["content_block"] for k, e in events if k == "content_block_start"}
    inputs: dict[int, list[str]] = {}
    for k, e in events:
        if k == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            inputs.setdefault(e["index"], []).append(e["delta"]["partial_json"])
    uses = [(starts[i]["name"], json.loads("".join(parts))) for i, parts in sorted(inputs.items())]
    assert uses == [(b["name"], b["input"]) for b in plain["content"] if b["type"] == "tool_use"]
    assert len(uses) == 2 and all(len(parts) > 2 for parts in inputs.values())
    assert [s["type"] for s in starts.values()] == ["text", "tool_use", "tool_use"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
