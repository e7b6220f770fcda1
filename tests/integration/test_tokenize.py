"""/tokenize and /detokenize on the real model's tokenizer and chat template."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import SERVED_NAME, ServerProcess

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def http(gateway: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=gateway.base_url, timeout=60)


def test_tokenize_text_matches_the_tokenizer(http: httpx.Client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for add_special in (True, False):
        r = http.post("/tokenize", json={"model": SERVED_NAME, "prompt": "Hello, world!",
                                         "add_special_tokens": add_special})
        ids = tokenizer("Hello, world!", add_special_tokens=add_special).input_ids
        assert r.json() == {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}


def test_tokenize_messages_counts_what_chat_sends(http: httpx.Client, gateway: ServerProcess, tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = http.post("/tokenize", json={"messages": CHAT})
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage.prompt_tokens == r.json()["count"]
    continued = http.post("/tokenize", json={"messages": [*CHAT, {"role": "assistant", "content": "Hi"}],
                                             "add_generation_prompt": False, "continue_final_message": True})
    assert tokenizer.decode(continued.json()["tokens"]).endswith("assistant\nHi")


def test_round_trip(http: httpx.Client) -> None:
    text = "Grüße, 世界! The quick brown fox."
    ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": SERVED_NAME, "tokens": ids}).json() == {"prompt": text}


def test_bad_input_is_a_400_naming_the_field(http: httpx.Client) -> None:
    for path, body, param in (("/detokenize", {"tokens": [49152]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
                              ("/tokenize", {"messages": []}, "messages")):
        r = http.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_long_text_prompts_are_tokenized_off_the_loop_and_unchanged(http: httpx.Client, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Above OFFLOAD_PROMPT_CHARS the template and tokenizer run in a worker thread: same ids."""
    from server.serving.lease import OFFLOAD_PROMPT_CHARS

    text = " ".join(f"item {i} of the list," for i in range(OFFLOAD_PROMPT_CHARS // 10))
    assert len(text) > OFFLOAD_PROMPT_CHARS
    r = http.post("/tokenize", json={"prompt": text})
    assert r.json()["tokens"] == tokenizer(text).input_ids
    messages = [{"role": "user", "content": text + " Which item comes first?"}]
    chat = http.post("/v1/chat/completions", json={"model": SERVED_NAME, "messages": messages,
                                                   "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200, chat.text
    counted = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert chat.json()["usage"]["prompt_tokens"] == counted
