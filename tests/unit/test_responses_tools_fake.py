"""Function tools on /v1/responses with the scripted engine: item and tool conversions to the
chat shapes, the 400s (each naming its field), and the output items, plain and streamed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseUsage

from server.protocol.responses import ResponsesRequest
from server.serving.responses_items import chat_tool_choice, chat_tools, input_messages
from tests.unit.test_tools_fake import engine_with, started

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": ASK, **fields})


def test_tools_and_tool_choice_become_chat_shapes() -> None:
    req = request(tools=[{**WEATHER, "strict": True}], tool_choice={"type": "function", "name": "get_weather"})
    assert chat_tools(req) == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER["parameters"], "strict": True}}]
    assert chat_tool_choice(req) == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_tool_choice(request(tools=[WEATHER], tool_choice="required")) == "required"
    assert chat_tool_choice(request(tool_choice="auto")) is None  # the default, without tools: none
    assert chat_tools(request()) is None


def test_call_items_join_the_assistant_turn_and_outputs_are_tool_messages() -> None:
    second = {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    req = request(instructions="Be brief.", input=[
        *ASK, {"role": "assistant", "content": "Looking."}, CALL, second, RESULT,
        {**RESULT, "call_id": "call_2", "output": "rain"}, {"role": "user", "content": "Thanks"}])
    messages = input_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = messages[2]
    assert assistant["content"] == "Looking."
    assert [(c["id"], c["function"]) for c in assistant["tool_calls"]] == [
        ("call_1", {"name": "get_weather", "arguments": {"city": "Paris"}}),
        ("call_2", {"name": "get_weather", "arguments": {"city": "Rome"}})]
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    # a call with no assistant text before it starts its own assistant turn; text after joins it
    messages = input_messages(request(input=[*ASK, CALL, {"role": "assistant", "content": "Done."}]))
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"] == "Done." and messages[1]["tool_calls"][0]["id"] == "call_1"


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools", "name"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools", "name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools", "parameters"),
    ({"tools": [{"type": "web_search"}]}, "tools", "type"),
    ({"tools": ["x"]}, "tools", "tools.0"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "input": [*ASK, RESULT]}, "input", "answers no earlier function_call"),
    ({"tools": [WEATHER], "input": [*ASK, {**CALL, "arguments": "{bad"}]}, "input", "not valid JSON"),
    ({"tools": [WEATHER], "input": [*ASK, {**CALL, "arguments": "[1]"}]}, "input", "JSON object"),
    ({"tools": [WEATHER], "input": [*ASK, {"type": "function_call", "call_id": "c"}]}, "input", "name"),
    ({"tools": [WEATHER], "input": [*ASK, {"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
    ({"tools": [WEATHER], "input": [*ASK, {"type": "web_search_call", "id": "x"}]}, "input", "web_search_call"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "param", "words"), BAD)
async def test_bad_tool_requests_are_400s_naming_the_field(extra: dict[str, Any], param: str, words: str) -> None:
    client = await started(engine_with())
    r = await client.post("/v1/responses", json={"model": "fake", "input": ASK, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


@pytest.mark.anyio
async def test_auto_gives_text_and_function_call_items_plain_and_streamed() -> None:
    reply = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    engine = engine_with(reply)
    client = await started(engine)
    body = {"input": [*ASK, CALL, RESULT], "tools": [WEATHER], "parallel_tool_calls": True}
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    response = r.json()
    assert engine.rendered_tools[-1] == [{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}]
    message, call = response["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Rome"}, "completed")
    assert response["status"] == "completed" and response["tool_choice"] == "auto"
    assert response["tools"][0]["name"] == "get_weather" and response["parallel_tool_calls"] is True

    r = await client.post("/v1/responses", json={**body, "stream": True})
    streamed = events(r.text)
    types = [e["type"] for e in streamed]
    # The text and the arguments stream in pieces (the scripted engine writes a few characters
    # a delta): one event type per run of them here.
    assert [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added = streamed[types.index("response.function_call_arguments.delta") - 1]
    deltas = [e for e in streamed if e["type"] == "response.function_call_arguments.delta"]
    done, item_done = streamed[-3:-1]
    assert added["item"]["arguments"] == "" and added["item"]["status"] == "in_progress"
    assert {d["output_index"] for d in deltas} == {added["output_index"]} == {1}
    assert {d["item_id"] for d in deltas} == {added["item"]["id"]}
    assert "".join(d["delta"] for d in deltas) == done["arguments"] == item_done["item"]["arguments"]
    assert json.loads(done["arguments"]) == {"city": "Rome"}
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "Let me look."
    assert done["name"] == "get_weather" and item_done["item"]["status"] == "completed"
    final = streamed[-1]["response"]["output"]
    assert final[0]["id"] == streamed[2]["item"]["id"] and final[1] == item_done["item"]
    # the OpenAI SDK's strict models read both whole responses, usage details included
    for whole in (response, streamed[-1]["response"], streamed[0]["response"]):
        sdk = Response.model_validate(whole, strict=True)
        assert sdk.id == whole["id"]
    assert sdk_usage_ok(response["usage"])


def sdk_usage_ok(usage: dict[str, Any]) -> bool:
    """Every usage detail the SDK declares required is there, with the types it declares."""
    parsed = ResponseUsage.model_validate(usage, strict=True)
    return (parsed.input_tokens_details.cache_write_tokens == 0 and parsed.input_tokens_details.cached_tokens == 0
            and parsed.output_tokens_details.reasoning_tokens == 0
            and parsed.total_tokens == parsed.input_tokens + parsed.output_tokens)


@pytest.mark.anyio
async def test_required_named_and_none() -> None:
    client = await started(engine_with('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                                       '{"name": "get_weather", "parameters": {"city": "Rome"}}]', parser=None))
    r = await client.post("/v1/responses", json={"input": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert [(i["type"], json.loads(i["arguments"])) for i in r.json()["output"]] == [
        ("function_call", {"city": "Paris"}), ("function_call", {"city": "Rome"})]
    r = await client.post("/v1/responses", json={"input": ASK, "tools": [WEATHER], "tool_choice": "required",
                                                 "parallel_tool_calls": False})
    assert len(r.json()["output"]) == 1 and r.json()["parallel_tool_calls"] is False

    client = await started(engine_with('{"city": "Oslo"}', parser=None))
    named = {"type": "function", "name": "get_weather"}
    r = await client.post("/v1/responses", json={"input": ASK, "tools": [WEATHER], "tool_choice": named})
    [call] = r.json()["output"]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Oslo"}')
    assert r.json()["tool_choice"] == named
    r = await client.post("/v1/responses", json={"input": ASK, "tools": [WEATHER], "tool_choice": "none"})
    [message] = r.json()["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == '{"city": "Oslo"}'
    r = await client.post("/v1/responses", json={"input": ASK, "tool_choice": "auto"})
    assert r.status_code == 200 and r.json()["tool_choice"] == "none"


@pytest.mark.anyio
async def test_function_call_arguments_stream_in_pieces_that_make_the_arguments() -> None:
    from tests.unit.test_chat_stream_fake import TWO_CALLS, cut, scripted

    client = await started(scripted(cut(TWO_CALLS, 3)))
    body = {"input": ASK, "tools": [WEATHER]}
    plain = (await client.post("/v1/responses", json=body)).json()["output"]
    streamed = events((await client.post("/v1/responses", json={**body, "stream": True})).text)
    final = streamed[-1]["response"]["output"]
    assert [(o["type"], o.get("name"), o.get("arguments")) for o in final] == [
        (o["type"], o.get("name"), o.get("arguments")) for o in plain]
    assert [o["type"] for o in final] == ["message", "function_call", "function_call"]
    for index in (1, 2):
        deltas = [e["delta"] for e in streamed
                  if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == index]
        assert len(deltas) > 2 and "".join(deltas) == final[index]["arguments"]
    added = [e for e in streamed if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"), (1, "function_call"), (2, "function_call")]
    # The first call is added before the second is written: streamed, not whole at the end.
    assert streamed.index(added[1]) < streamed.index(added[2]) - 3
    Response.model_validate(streamed[-1]["response"], strict=True)
