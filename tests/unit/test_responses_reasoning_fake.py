"""Reasoning on /v1/responses with the scripted engine and the fake `<think>` parser: a `reasoning`
output item before the message, plain and streamed (OpenAI's event types, as the SDK's
`responses.stream()` consumes them), reasoning items sent back in `input`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from testbed.fakes import FakeReasoningParser
from tests.unit.test_chat_stream_fake import REASONED, scripted
from tests.unit.test_responses_tools_fake import WEATHER
from tests.unit.test_tools_fake import started

ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post("/v1/responses", json={"input": ASK, "stream": True, **body})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.anyio
async def test_plain_reasoning_item_comes_before_the_message() -> None:
    engine = scripted(REASONED, tools=None, reasoning="fake")
    client = await started(engine)
    r = await client.post("/v1/responses", json={"input": ASK})
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"]
    assert output[0]["id"].startswith("rs_") and output[0]["summary"] == []
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "Paris is in France."}]
    assert output[1]["content"][0]["text"] == "It is sunny."
    assert engine.options[-1].skip_special_tokens is False  # the parser's markers must stay in the text


@pytest.mark.anyio
async def test_streamed_reasoning_then_text_in_openai_event_order() -> None:
    client = await started(scripted(REASONED, tools=None, reasoning="fake"))
    got = await events(client, {})
    kinds = [e["type"] for e in got]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert got[2]["item"]["type"] == "reasoning" and got[3]["part"]["type"] == "reasoning_text"
    deltas = [e["delta"] for e in got if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "Paris is in France." and len(deltas) > 1
    # the reasoning item is done before the message opens at output index 1
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 5] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done", "response.output_item.added",
                                    "response.content_part.added"]
    assert done < first_text and got[done + 3]["item"]["type"] == "message" and got[done + 3]["output_index"] == 1
    text = [e for e in got if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in text) == "It is sunny." and {e["output_index"] for e in text} == {1}
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    final = got[-1]["response"]
    assert kinds[-1] == "response.completed" and [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["id"] == got[2]["item"]["id"]
    assert FakeReasoningParser.made[-1].ended_on_stop_token is True


@pytest.mark.anyio
async def test_reasoning_with_tools_reads_the_call_from_the_content() -> None:
    pieces = ["<think>Look it up.</think>", CALL_TEXT]
    for stream in (False, True):
        client = await started(scripted(pieces, reasoning="fake"))
        body = {"input": ASK, "tools": [WEATHER], "stream": stream}
        if stream:
            output = (await events(client, body))[-1]["response"]["output"]
        else:
            output = (await client.post("/v1/responses", json=body)).json()["output"]
        assert [o["type"] for o in output] == ["reasoning", "function_call"], output
        assert json.loads(output[1]["arguments"]) == {"city": "Paris"}


@pytest.mark.anyio
async def test_only_reasoning_gives_no_message() -> None:
    client = await started(scripted(["<think>cut off mid-thought"], tools=None, reasoning="fake"))
    output = (await client.post("/v1/responses", json={"input": ASK})).json()["output"]
    assert [o["type"] for o in output] == ["reasoning"]
    final = (await events(client, {}))[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning"]


@pytest.mark.anyio
async def test_reasoning_items_sent_back_open_the_assistant_turn() -> None:
    engine = scripted(["Fine."], tools=None, reasoning="fake")
    client = await started(engine)
    back = [*ASK, {"type": "reasoning", "id": "rs_1", "summary": [],
                   "content": [{"type": "reasoning_text", "text": "Paris is in France."}]},
            {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "Thanks"}]
    r = await client.post("/v1/responses", json={"input": back})
    assert r.status_code == 200, r.text
    encrypted = [*ASK, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]
    r = await client.post("/v1/responses", json={"input": encrypted})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "encrypted_content" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_the_sdk_stream_accumulates_reasoning_and_text() -> None:
    client = await started(scripted(REASONED, tools=None, reasoning="fake"))
    sdk = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=client)
    async with sdk.responses.stream(model="fake", input=ASK) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "It is sunny."
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is in France."
    # the loop an agent runs: the whole output goes back as input
    again = await sdk.responses.create(model="fake", input=[*ASK, *[o.model_dump() for o in final.output],
                                                            {"role": "user", "content": "Thanks"}])
    assert again.output_text
