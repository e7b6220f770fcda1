"""/v1/responses, /tokenize and /detokenize through the HTTP layer with a scripted engine: shapes,
the stream's event order, errors (before and after the stream started), leases, metrics, access
log, API keys and tenants' token budgets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from server.lifecycle.holder import EngineState
from testbed.fakes import FakeEngine
from tests.unit.test_http_fake_engine import make
from tests.unit.test_metrics import get, make_app, snapshot
from tests.unit.test_tenants_http import Gateway_, assert_error, bearer

STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                "response.content_part.done", "response.output_item.done", "response.completed"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def events_of(text: str) -> list[tuple[str, dict]]:
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


@pytest.mark.anyio
async def test_response_plain_shape_usage_and_incomplete() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/v1/responses", json={
        "model": "fake", "input": "a b", "instructions": "be brief", "max_output_tokens": 3,
        "metadata": {"k": "v"}, "store": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["instructions"] == "be brief" and body["metadata"] == {"k": "v"}
    assert body["max_output_tokens"] == 3 and body["temperature"] == 0 and body["tools"] == []
    [message] = body["output"]
    assert message["id"].startswith("msg_") and message["role"] == "assistant" and message["type"] == "message"
    assert message["content"] == [{"type": "output_text", "text": " w0 w1 w2", "annotations": [], "logprobs": None}]
    # "system: be brief user: a b assistant:" in the scripted tokenizer is 7 words
    assert body["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 10}
    assert "store" not in body  # as `vllm serve`: nothing is stored, and the field is not echoed
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_response_input_items() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/v1/responses", json={"input": [
        {"role": "developer", "content": "x"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
        {"role": "user", "content": "d"}], "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    # developer: x user: a \n b assistant: c user: d assistant:
    assert r.json()["usage"]["input_tokens"] == 10


@pytest.mark.anyio
async def test_response_stream_events_in_order() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/v1/responses", json={"input": "a", "max_output_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = events_of(r.text)
    types = [t for t, _ in events]
    assert types == STREAM_ORDER[:5] + ["response.output_text.delta"] * 2 + STREAM_ORDER[5:]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for t, e in events if t == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas == " w0 w1 w2"
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 3
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["usage"] is None
    item_ids = {e["item_id"] for t, e in events if "item_id" in e}
    assert item_ids == {final["output"][0]["id"]}
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_response_stream_error_is_an_error_event() -> None:
    client, holder = make(FakeEngine(fail_after=1))
    await holder.start()
    r = await client.post("/v1/responses", json={"input": "a", "max_output_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = events_of(r.text)
    kind, error = events[-1]
    assert kind == "error" and "scripted engine failure" in error["message"]
    assert error["sequence_number"] == len(events) - 1
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert "response.completed" not in [t for t, _ in events]
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_response_bad_input_is_a_4xx_naming_the_field() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    cases = [
        ({"input": "a", "tools": [{"type": "function"}]}, 400, "tools"),
        ({"input": "a", "tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice"),  # auto, no parser
        ({"input": "a", "previous_response_id": "resp_1"}, 404, "previous_response_id"),
        ({"input": "a", "model": "other"}, 404, "model"),
        ({"input": []}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({}, 400, "input"),
        ({"input": "a", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "a", "max_output_tokens": 65}, 400, "max_output_tokens"),
        ({"input": "a " * 70}, 400, "input"),
        ({"input": "a", "temperature": -1}, 400, "temperature"),
        ({"input": "a", "metadata": {"k": 1}}, 400, "metadata"),
    ]
    for body, status, param in cases:
        for stream in (False, True):
            r = await client.post("/v1/responses", json={**body, "stream": stream})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    assert (await client.post("/v1/responses", json={"input": "a", "tools": []})).status_code == 200
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_response_refused_while_draining_and_counted_by_route(caplog: pytest.LogCaptureFixture) -> None:
    client, holder, metrics = make_app(FakeEngine())
    await holder.start()
    with caplog.at_level(logging.INFO, logger="llm_gateway.access"):
        assert (await client.post("/v1/responses", json={"input": "a b", "max_output_tokens": 2})).status_code == 200
    line = next(r.getMessage() for r in caplog.records if "route=/v1/responses" in r.getMessage())
    assert "completion_id=resp_" in line and "prompt_tokens=4 completion_tokens=2" in line and "finish=length" in line
    snap = snapshot(metrics)
    assert get(snap, "gateway_requests_total", route="/v1/responses", status="200") == 1
    assert get(snap, "gateway_completion_tokens_total", route="/v1/responses") == 2
    holder._set_state(EngineState.DRAINING)
    r = await client.post("/v1/responses", json={"input": "a"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    r = await client.post("/tokenize", json={"prompt": "a"})
    assert r.status_code == 503


@pytest.mark.anyio
async def test_tokenize_and_detokenize() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    r = await client.post("/tokenize", json={"model": "fake", "prompt": "ab c"})
    assert r.json() == {"count": 2, "max_model_len": 64, "tokens": [2, 1], "token_strs": None}
    r = await client.post("/tokenize", json={"prompt": ""})
    assert r.json()["count"] == 0  # as `vllm serve`: no text, no tokens
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == [5, 2, 10]  # "user: hi assistant:"
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                             "add_generation_prompt": False, "continue_final_message": True})
    assert r.json()["tokens"] == [5, 2]
    r = await client.post("/detokenize", json={"model": "fake", "tokens": [1, 2]})
    assert r.json() == {"prompt": "t1 t2"}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_tokenize_bad_input_is_a_4xx_naming_the_field() -> None:
    client, holder = make(FakeEngine())
    await holder.start()
    chat = [{"role": "user", "content": "hi"}]
    cases = [
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "messages": chat}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": chat, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
        ("/detokenize", {"tokens": [1000]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model"),
    ]
    for path, body, status, param in cases:
        r = await client.post(path, json=body)
        assert r.status_code == status, (path, body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_keys_and_budgets_cover_the_new_routes(tmp_path: Path) -> None:
    async with Gateway_(tmp_path) as gw:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]}),
                           ("/v1/responses", {"input": "a", "max_output_tokens": 1})):
            assert (await gw.client.post(path, json=body)).status_code == 401
            assert (await gw.client.post(path, json=body, headers=bearer("sk-free"))).status_code == 200
        # tpm 60: a response reserves its estimated prompt plus max_output_tokens, then pays what it used
        r = await gw.client.post("/v1/responses", json={"input": "a", "max_output_tokens": 60},
                                 headers=bearer("sk-tpm"))
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert error["param"] == "max_output_tokens" and "Lower max_output_tokens" in error["message"]
        r = await gw.client.post("/v1/responses", json={"input": "a", "max_output_tokens": 10},
                                 headers=bearer("sk-tpm"))
        assert r.status_code == 200
        assert int(r.headers["x-ratelimit-remaining-tokens"]) in range(60 - 3 - 3 - 1 - 10, 60 - 3 - 10 + 1)
        snap = gw.metrics()
        assert get(snap, "gateway_tenant_tokens_total", tenant="tpm", kind="prompt") == r.json()["usage"]["input_tokens"]
        assert get(snap, "gateway_tenant_tokens_total", tenant="tpm", kind="completion") == 10


@pytest.mark.anyio
async def test_the_openai_sdk_reads_the_stream_and_its_error_event() -> None:
    import openai

    engine = FakeEngine()
    client, holder = make(engine)
    await holder.start()
    sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=client._transport, base_url="http://test"))
    async with sdk.responses.stream(model="fake", input="a", max_output_tokens=3) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds.count("response.output_text.delta") == 3 and final.output_text == " w0 w1 w2"
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    engine.fail_after = 1
    kinds = []
    with pytest.raises(openai.APIError) as failure:  # the error event's `error` body, as for chat
        async with sdk.responses.stream(model="fake", input="a", max_output_tokens=3) as stream:
            kinds = [event.type async for event in stream]
    assert "scripted engine failure" in failure.value.message and failure.value.body["type"] == "ServiceUnavailableError"
    assert kinds == []
    assert holder.in_flight == 0


@pytest.mark.anyio
async def test_a_response_stream_over_budget_ends_with_an_error_event(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, end_streams_over_budget=True) as gw:
        # budget 40: reserves about 8 + 30, holds the 40 left, is ended once it passes them
        r = await gw.client.post("/v1/responses", json={"input": "a", "max_output_tokens": 30, "stream": True,
                                                        "instructions": "x " * 10}, headers=bearer("sk-budget"))
        events = events_of(r.text)
        assert r.status_code == 200 and "[DONE]" not in r.text
        kind, error = events[-1]
        assert kind == "error" and error["code"] == "insufficient_quota" and error["error"]["code"] == "insufficient_quota"
        assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
        assert "response.completed" not in [t for t, _ in events]
