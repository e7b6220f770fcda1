"""/v1/messages on the real engine and model, through the anthropic SDK: plain, `messages.stream()`
to the end, a two-turn tool loop, count_tokens, and errors in Anthropic's shape. API-key checks
(x-api-key) are in tests/unit/test_messages_fake.py: the session gateway has no keys."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import SERVED_NAME, ServerProcess

QUESTION = "What is the capital of France?"
# anthropic 2.x no longer has sampling parameters in its signatures; the API (and this gateway) still takes them.
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(gateway: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=120)


def test_message_plain(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=SERVED_NAME, max_tokens=24, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}], metadata={"user_id": "u1"})
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == SERVED_NAME and message.content[0].type == "text"
    assert "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 24


def test_system_prompt_and_count_tokens(client: anthropic.Anthropic, tokenizer) -> None:  # type: ignore[no-untyped-def]
    system = [{"type": "text", "text": "Answer briefly."}]
    message = client.messages.create(model=SERVED_NAME, max_tokens=2, extra_body=GREEDY,
                                     system=system,  # type: ignore[arg-type]
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert message.usage.input_tokens == len(tokenizer(text, add_special_tokens=False).input_ids)
    count = client.messages.count_tokens(model=SERVED_NAME, system=system,  # type: ignore[arg-type]
                                         messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == message.usage.input_tokens


def test_stream_to_the_end_matches_plain(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=SERVED_NAME, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    plain = client.messages.create(**kwargs)  # type: ignore[call-overload]
    kinds = []
    with client.messages.stream(**kwargs) as stream:  # type: ignore[arg-type]
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == plain.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=SERVED_NAME, max_tokens=32, extra_body=GREEDY, stop_sequences=[" Paris"],
                                     messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == " Paris"
    assert "Paris" not in message.content[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop(client: anthropic.Anthropic, stream: bool) -> None:
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model=SERVED_NAME, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with client.messages.stream(messages=messages, **kwargs) as s:  # type: ignore[arg-type]
            first = s.get_final_message()
    else:
        first = client.messages.create(messages=messages, **kwargs)  # type: ignore[call-overload]
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and call.input.get("city")
    assert first.stop_reason == "tool_use"
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "Sunny, 24 degrees Celsius."}]}]
    second = client.messages.create(model=SERVED_NAME, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "none"}, messages=messages)  # type: ignore[arg-type]
    assert second.content[0].type == "text" and second.content[0].text.strip()
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its result reached the prompt


def test_errors_are_anthropic_shaped(client: anthropic.Anthropic, gateway: ServerProcess) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                            "message": caught.value.body["error"]["message"]}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=SERVED_NAME, max_tokens=100000, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(gateway.base_url + "/v1/messages", timeout=60,
                   json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
