"""/v1/chat/completions on the real engine and model, through the OpenAI SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import SERVED_NAME, ServerProcess


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_plain(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=24, temperature=0)
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert result.object == "chat.completion"
    assert result.usage.completion_tokens <= 24


def test_chat_stream_matches_plain(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, messages=QUESTION, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_usage_counts_the_template(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    result = client.chat.completions.create(model=SERVED_NAME, messages=QUESTION, max_tokens=2, temperature=0)
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)


def test_chat_n_and_seed(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "Name an animal."}],
                  max_tokens=8, temperature=1.0, n=2, seed=99)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_max_completion_tokens_and_stop(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_completion_tokens=30, temperature=0, stop=["."])
    assert "." not in result.choices[0].message.content
    assert result.choices[0].finish_reason == "stop"
    capped = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_completion_tokens=3, temperature=0)
    assert capped.usage.completion_tokens == 3
    assert capped.choices[0].finish_reason == "length"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(e.token for e in content) == result.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_structured_output_parses_as_json(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    result = client.chat.completions.create(
        model=SERVED_NAME, messages=QUESTION, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    data = json.loads(result.choices[0].message.content)
    assert set(data) == {"city", "country"}
    assert all(isinstance(v, str) for v in data.values())


@pytest.mark.parametrize("body,status,param", [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"model": "nope", "messages": QUESTION}, 404, "model"),
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools"),
    ({"messages": QUESTION, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": QUESTION, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": QUESTION, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ({"messages": QUESTION, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"messages": QUESTION, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
])
def test_chat_errors(gateway: ServerProcess, body: dict, status: int, param: str | None) -> None:
    r = httpx.post(gateway.base_url + "/v1/chat/completions", json={"model": SERVED_NAME, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param:
        assert error["param"] == param


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["\\ud83d"], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "\xc3\x28", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
])
def test_invalid_unicode_is_400(gateway: ServerProcess, route: str, body: bytes) -> None:
    r = httpx.post(gateway.base_url + route, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
