"""/v1/completions, /v1/models, /health, /ready on the real engine and model, via the OpenAI SDK and httpx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import SERVED_NAME, ServerProcess


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(gateway: ServerProcess):  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=gateway.base_url, timeout=120) as c:
        yield c


def chat_prompt(tokenizer, question: str) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param
    return error


def test_capital_of_france_with_chat_template(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    result = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=32, temperature=0)
    assert "Paris" in result.choices[0].text
    assert result.choices[0].finish_reason in {"stop", "length"}


def test_readme_curl_request(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
    })
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["model"] == SERVED_NAME
    assert "Paris" in body["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["completion_tokens"] == 16
    assert body["usage"]["total_tokens"] == 21
    assert r.headers["x-request-id"]


def test_stream_concatenates_to_plain_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="Once upon a time", max_tokens=40, temperature=0)
    plain = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stream_include_usage(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "Write a list of fruits:"
    chunks = list(client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert last.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/completions", json={
        "model": SERVED_NAME, "prompt": "Hello", "max_tokens": 5, "stream": True,
    }) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        json.loads(line[len("data: "):])


def test_n_three_choices(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=SERVED_NAME, prompt="My favourite colour is", max_tokens=8, n=3, temperature=0.9, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert all(c.text for c in result.choices)
    assert 3 <= result.usage.completion_tokens <= 24


def test_n_streaming_indices(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=SERVED_NAME, prompt="Colours:", max_tokens=6, n=2, temperature=1.0, seed=3, stream=True
    ))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_cuts(client: openai.OpenAI) -> None:
    base = client.completions.create(model=SERVED_NAME, prompt="The capital of France is", max_tokens=16, temperature=0)
    assert "." in base.choices[0].text
    cut = client.completions.create(
        model=SERVED_NAME, prompt="The capital of France is", max_tokens=16, temperature=0, stop=["."]
    )
    assert cut.choices[0].text == base.choices[0].text.split(".")[0]
    assert cut.choices[0].finish_reason == "stop"


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="Tell me a story about a cat", max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs)
    b = client.completions.create(seed=1234, **kwargs)
    assert a.choices[0].text == b.choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a.choices[0].text}) > 1  # seeds do change the sample


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "The capital of France is"
    ids = tokenizer(text).input_ids
    by_text = client.completions.create(model=SERVED_NAME, prompt=text, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batched_prompts(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompts = ["The capital of France is", "One, two, three,"]
    result = client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in result.choices] == [0, 1]
    singles = [
        client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in prompts
    ]
    assert [c.text for c in result.choices] == singles
    assert result.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in prompts)


def test_token_id_lists(http: httpx.Client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = [tokenizer("Hello there").input_ids, tokenizer("Good morning").input_ids]
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": ids, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert len(r.json()["choices"]) == 2
    assert r.json()["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


def test_usage_counts_match_tokenizer(client: openai.OpenAI, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "Count the tokens of this sentence, please."
    result = client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=9, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert result.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert result.usage.completion_tokens == 9 == len(result.choices[0].logprobs.tokens)
    assert result.usage.total_tokens == result.usage.prompt_tokens + 9


def test_logprobs_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=SERVED_NAME, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == result.choices[0].text
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_echo(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    result = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert result.choices[0].text.startswith(prompt)
    assert len(result.choices[0].text) > len(prompt)


def test_min_tokens_and_ignore_eos(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=SERVED_NAME, prompt="Hi", max_tokens=20, temperature=0,
        extra_body={"min_tokens": 20, "ignore_eos": True},
    )
    assert result.usage.completion_tokens == 20
    assert result.choices[0].finish_reason == "length"


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]


def test_health_and_ready(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200


# -- errors: OpenAI shape, right status, nothing 5xx ------------------------------------------


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompt_is_400(http: httpx.Client, prompt: object) -> None:
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt})
    assert_openai_error(r, 400, "prompt")


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_is_400(http: httpx.Client, max_tokens: int) -> None:
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": max_tokens})
    assert_openai_error(r, 400, "max_tokens")


def test_prompt_longer_than_context_is_400_with_both_lengths(http: httpx.Client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "hello " * 4200
    n = len(tokenizer(prompt).input_ids)
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4})
    error = assert_openai_error(r, 400, "prompt")
    assert "4096" in error["message"] and str(n) in error["message"]


def test_max_tokens_above_context_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": SERVED_NAME, "prompt": "hi", "max_tokens": 5000})
    assert_openai_error(r, 400, "max_tokens")


def test_unknown_model_is_404(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"})
    error = assert_openai_error(r, 404, "model")
    assert "gpt-17" in error["message"]


def test_unknown_model_raises_sdk_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


@pytest.mark.parametrize("body", [b'{"model": "x", "prompt":', b"not json", b"\xff\xfe\x00"])
def test_malformed_json_is_400(http: httpx.Client, body: bytes) -> None:
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("body", [
    {"model": SERVED_NAME},
    {"model": SERVED_NAME, "prompt": "hi", "temperature": -1},
    {"model": SERVED_NAME, "prompt": "hi", "top_p": 7},
    {"model": SERVED_NAME, "prompt": "hi", "n": 0},
    {"model": SERVED_NAME, "prompt": "hi", "n": 2, "temperature": 0},
    {"model": SERVED_NAME, "prompt": "hi", "logprobs": 500},
    {"model": SERVED_NAME, "prompt": [1, -5]},
    {"model": SERVED_NAME, "prompt": [10**9]},
    {"model": SERVED_NAME, "prompt": {"a": 1}},
    {"model": SERVED_NAME, "prompt": "hi", "max_tokens": "many"},
    {"model": SERVED_NAME, "prompt": "hi", "suffix": "x"},
])
def test_invalid_parameters_are_400(http: httpx.Client, body: dict) -> None:
    r = http.post("/v1/completions", json=body)
    assert_openai_error(r, 400)


BEYOND_64_BITS = 2**70


@pytest.mark.parametrize("route,field,value", [
    ("/v1/completions", "seed", BEYOND_64_BITS),
    ("/v1/completions", "seed", -BEYOND_64_BITS),
    ("/v1/completions", "top_k", BEYOND_64_BITS),
    ("/v1/completions", "stop_token_ids", [BEYOND_64_BITS]),
    ("/v1/completions", "prompt", [1, BEYOND_64_BITS]),
    ("/v1/chat/completions", "seed", BEYOND_64_BITS),
    ("/v1/chat/completions", "top_k", BEYOND_64_BITS),
    ("/v1/chat/completions", "logit_bias", {"5": BEYOND_64_BITS}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_integers_beyond_64_bits_are_400_naming_the_field(http: httpx.Client, route: str, field: str,
                                                         value: object, stream: bool) -> None:
    """JSON integers have no size limit; vLLM's engine carries 64 bits (2^70 was a 500)."""
    body = {"model": SERVED_NAME, "max_tokens": 2, "stream": stream,
            **({"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}),
            field: value}
    r = http.post(route, json=body)
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"] == field
    assert "64-bit integer" in r.json()["error"]["message"]
    in_range = {"seed": 2**63 - 1, "prompt": [1, 2]}.get(field)  # others: leave the field out
    assert http.post(route, json={**body, field: in_range}).status_code == 200
