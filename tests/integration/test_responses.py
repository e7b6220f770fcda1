"""/v1/responses on the real engine and model, through the OpenAI SDK (plain and `responses.stream`)."""

from __future__ import annotations

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
                                                                         "parameters": {}, "strict": False}])
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
