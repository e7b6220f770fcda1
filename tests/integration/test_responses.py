"""/v1/responses on the real engine and model, through the OpenAI SDK (plain and `responses.stream`)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import SERVED_NAME, ServerProcess


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


QUESTION = "What is the capital of France?"


def test_response_plain(client: openai.OpenAI) -> None:
    result = client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=24, temperature=0)
    assert result.object == "response" and result.id.startswith("resp_")
    assert result.status == "completed" and result.incomplete_details is None
    assert "Paris" in result.output_text
    [message] = result.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert result.usage.output_tokens <= 24
    assert result.usage.total_tokens == result.usage.input_tokens + result.usage.output_tokens
    assert result.usage.input_tokens_details.cached_tokens == 0
    assert result.usage.input_tokens_details.cache_write_tokens == 0
    # the SDK's own model, strictly: every field it requires is there (usage details included)
    assert openai.types.responses.Response.model_validate(result.model_dump(), strict=True).id == result.id


def test_response_counts_the_template_and_instructions(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    result = client.responses.create(model=SERVED_NAME, input=QUESTION, instructions="Answer in one word.",
                                      max_output_tokens=2, temperature=0)
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert result.usage.input_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    assert result.status == "incomplete" and result.incomplete_details.reason == "max_output_tokens"
    assert result.usage.output_tokens == 2 and result.max_output_tokens == 2


def test_response_same_as_chat(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Another one?"}]
    result = client.responses.create(model=SERVED_NAME, input=items, max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=SERVED_NAME, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"}])
    assert result.output_text == chat.choices[0].message.content
    assert result.usage.input_tokens == chat.usage.prompt_tokens


def test_response_stream_matches_plain(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, input=QUESTION, max_output_tokens=24, temperature=0)
    plain = client.responses.create(**kwargs)
    types: list[str] = []
    deltas: list[str] = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.status == plain.status


def test_response_seed_repeats(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, input="Name an animal.", max_output_tokens=8, temperature=1.0, extra_body={"seed": 7})
    assert client.responses.create(**kwargs).output_text == client.responses.create(**kwargs).output_text


def test_response_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=SERVED_NAME, input="hi", tools=[{"type": "function", "name": "f",
                                                                         "parameters": [], "strict": False}])
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=SERVED_NAME, input="hi", previous_response_id="resp_123")
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=SERVED_NAME, input="hi " * 5000)
    assert err.value.body["param"] == "input"
    # store is accepted (nothing is stored), metadata comes back
    result = client.responses.create(model=SERVED_NAME, input="hi", max_output_tokens=2, store=True,
                                     metadata={"trace": "t1"})
    assert result.metadata == {"trace": "t1"}


WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": False}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_loop(client: openai.OpenAI) -> None:
    """The model calls a tool (forced, for a deterministic test), the client runs it and sends the
    call and its output back, the model answers in text."""
    first = client.responses.create(model=SERVED_NAME, input=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    assert first.status == "completed" and first.tool_choice.name == "get_weather"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] == "Paris"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 22, "sky": "sunny"}'}
    second = client.responses.create(model=SERVED_NAME, input=[*ASK_WEATHER, *first.output, result],
                                     tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=40)
    [message] = second.output
    assert message.type == "message" and second.output_text.strip()
    assert second.usage.input_tokens > first.usage.input_tokens
    # the same conversation through chat completions renders the same prompt
    chat = client.chat.completions.create(
        model=SERVED_NAME, temperature=0, max_tokens=40, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        messages=[*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}])
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    assert chat.choices[0].message.content == second.output_text
    # an output that answers no call is refused, naming the field
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=SERVED_NAME, input=[*ASK_WEATHER, result], tools=[WEATHER])
    assert err.value.body["param"] == "input"


def test_tool_call_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_output_tokens=120)
    plain = client.responses.create(**kwargs)
    types: list[str] = []
    arguments: list[str] = []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
            if event.type == "response.function_call_arguments.done":
                assert event.arguments == "".join(arguments)
                arguments.clear()
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in plain.output]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == len(calls)
    assert types.count("response.function_call_arguments.done") == len(calls)
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status


def disconnects(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('gateway_client_disconnects_total{route="/v1/responses"}'):
            return float(line.split()[-1])
    return 0.0


def test_response_stream_disconnect_aborts_the_request(gateway: ServerProcess) -> None:
    body = {"model": SERVED_NAME, "input": "Count to a thousand.", "max_output_tokens": 2000, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        before = disconnects(http)
        with http.stream("POST", "/v1/responses", json=body) as r:
            for line in r.iter_lines():
                if "response.output_text.delta" in line:
                    break
        deadline = time.monotonic() + 10
        while disconnects(http) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert disconnects(http) == before + 1
