"""Differential test of /v1/messages and /v1/messages/count_tokens against `vllm serve` (same model,
same engine settings, hermes parser and tool template; the session's shared `gateway` and
`vllm_reference` servers), greedy.

Compared: status; the content blocks (type, text; a tool_use block's name and input), stop_reason,
stop_sequence and usage; a stream's event order (runs of deltas folded), each event's fields, the
text, and the final message_delta; count_tokens' input_tokens. Differences kept on purpose:

- Errors: Anthropic's body and error types here everywhere on these routes (`not_found_error`,
  `invalid_request_error`, ...); `vllm serve` wraps its OpenAI error types (`NotFoundError`) in the
  Anthropic body, and answers a validation error (missing max_tokens) with its OpenAI body. The
  statuses are the same and compared.
- `stop_sequence: null` is sent when no stop sequence matched, as Anthropic's API does; vLLM's plain
  response leaves the field out (it serializes without nulls).
- Message ids are `msg_<hex>` (Anthropic's prefix); vLLM sends its chat id (`chatcmpl-...`). Tool
  call ids are `call_<hex>` (chat's); vLLM's are `chatcmpl-tool-<hex>`.
- A tool call's arguments go out in `input_json_delta`s cut where chat's tool stream cuts them
  (only what the finished parse is certain to begin with; vLLM's hermes parser cuts them
  elsewhere); folded, the events are the same. With tools, text is streamed up to the parser's
  call opener, and an `any` choice is held whole (the CPU profile forces it into a JSON array),
  as chat's tool streams are.
- count_tokens answers `{"input_tokens"}` only, as Anthropic's API does; vLLM adds
  `context_management.original_input_tokens` (Anthropic's context-editing beta, not served here).
- The system prompt's text blocks and a turn's text blocks are joined by newlines (as chat joins
  text parts); vLLM joins system blocks with nothing. A final assistant turn of text is continued
  (Anthropic's prefill); vLLM answers after it. Neither is in the request list below.
- Requests vLLM accepts that are refused (400) here: image/document blocks, server tools, a
  `tool_result` that answers no earlier `tool_use`, a `tool_use` in a user turn.
- vLLM 0.26 only (0.32 answers as we do, and as Anthropic's API does): a named (`tool`) call ends
  with `stop_reason: "end_turn"` there, `tool_use` here; its stream's `message_delta` leaves
  `stop_sequence` out. `reference_as_032` turns a 0.26 answer into 0.32's before comparing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED_NAME, ServerProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "tool", "name": "get_weather"}

CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {"max_tokens": 24, "messages": QUESTION}),
    ("plain-stream", {"max_tokens": 24, "messages": QUESTION, "stream": True}),
    ("system-stop", {"max_tokens": 32, "system": "You are a geography teacher.", "stop_sequences": [" Paris"],
                     "messages": QUESTION}),
    ("length-stream", {"max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}], "messages": QUESTION,
                       "stream": True}),
    ("tool-named", {"max_tokens": 60, "tools": [WEATHER], "tool_choice": NAMED, "messages": ASK_WEATHER}),
    ("tool-named-stream", {"max_tokens": 60, "tools": [WEATHER], "tool_choice": NAMED, "messages": ASK_WEATHER,
                           "stream": True}),
    ("tool-result", {"max_tokens": 30, "tools": [WEATHER], "messages": [
        *ASK_WEATHER,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C."}]}]}),
    ("bad-model", {"model": "nope", "max_tokens": 8, "messages": QUESTION}),
    ("no-max-tokens", {"max_tokens": None, "messages": QUESTION}),
]


def post(base_url: str, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
    body = {k: v for k, v in {"model": SERVED_NAME, "temperature": 0, **body}.items() if v is not None}
    with httpx.Client(base_url=base_url, timeout=300) as client:  # loaded CI machines
        if not body.get("stream"):
            r = client.post(endpoint, json=body)
            return r.status_code, r.json()
        with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            events, kind = [], None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    data = json.loads(line[len("data: "):])
                    assert data["type"] == kind
                    events.append(data)
    return 200, events


def blocks(content: list[dict[str, Any]]) -> list[tuple[str, Any, Any]]:
    """(type, text or tool name, tool input) of each block: ids aside."""
    return [(b["type"], b.get("text", b.get("name")), b.get("input")) for b in content]


def folded(events: list[dict[str, Any]]) -> list[str]:
    """Event types, each run of content_block_delta of one kind folded into one."""
    out: list[str] = []
    for e in events:
        name = e["type"] + (":" + e["delta"]["type"] if e["type"] == "content_block_delta" else "")
        if not (out and out[-1] == name and name.startswith("content_block_delta")):
            out.append(name)
    return out


def streamed_message(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a stream adds up to (as the anthropic SDK accumulates it)."""
    message = dict(events[0]["message"])
    content: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for e in events[1:]:
        if e["type"] == "content_block_start":
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "text_delta":
                content[e["index"]]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[e["index"]] = partial.get(e["index"], "") + delta["partial_json"]
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"] = {**message["usage"], **e["usage"]}
    for index, text in partial.items():
        content[index]["input"] = json.loads(text)
    message["content"] = content
    return message


def vllm_version() -> str:
    import vllm  # the reference runs on the test's own vLLM

    return vllm.__version__


def reference_as_032(ref: Any) -> Any:
    """vLLM 0.26's answer as 0.32 gives it (the two listed 0.26 differences), else `ref` as it is."""
    if not vllm_version().startswith("0.26"):
        return ref
    if isinstance(ref, dict):  # a message
        ends, called = [ref], any(b["type"] == "tool_use" for b in ref["content"])
    else:  # a stream's events
        ends = [e["delta"] for e in ref if e["type"] == "message_delta"]
        called = any(e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use" for e in ref)
    for end in ends:
        end.setdefault("stop_sequence", None)
        if called and end["stop_reason"] == "end_turn":
            end["stop_reason"] = "tool_use"
    return ref


def test_request_list_covers_plain_streams_tools_and_errors() -> None:
    bodies = [b for _, b in CASES]
    assert sum(bool(b.get("stream")) for b in bodies) >= 3 and sum("tools" in b for b in bodies) >= 3


@pytest.mark.parametrize(("name", "body"), CASES, ids=[name for name, _ in CASES])
def test_messages_same_as_vllm(name: str, body: dict[str, Any], gateway: ServerProcess,
                               vllm_reference: ServerProcess) -> None:
    ours_status, ours = post(gateway.base_url, "/v1/messages", body)
    ref_status, ref = post(vllm_reference.base_url, "/v1/messages", body)
    assert ours_status == ref_status, (ours, ref)
    if ref_status != 200:
        assert ours["type"] == "error" and set(ours["error"]) == {"type", "message"}
        return
    ref = reference_as_032(ref)
    if isinstance(ref, list):
        assert folded(ours) == folded(ref), (ours, ref)
        assert {tuple(sorted(e)) for e in ours} == {tuple(sorted(e)) for e in ref}
        assert ours[-2]["delta"] == ref[-2]["delta"] and ours[-2]["usage"] == ref[-2]["usage"]
        ours, ref = streamed_message(ours), streamed_message(ref)
    assert blocks(ours["content"]) == blocks(ref["content"])
    assert ours["stop_reason"] == ref["stop_reason"]
    assert ours["stop_sequence"] == ref.get("stop_sequence")
    assert ours["usage"] == ref["usage"]
    assert ours["model"] == ref["model"] and ours["type"] == ref["type"] == "message"
    assert set(ours) - set(ref) <= {"stop_sequence"}


@pytest.mark.parametrize("body", [
    {"messages": QUESTION},
    {"system": "Be brief.", "tools": [WEATHER], "messages": ASK_WEATHER},
], ids=["plain", "system-tools"])
def test_count_tokens_same_as_vllm(body: dict[str, Any], gateway: ServerProcess,
                                   vllm_reference: ServerProcess) -> None:
    ours_status, ours = post(gateway.base_url, "/v1/messages/count_tokens", body)
    ref_status, ref = post(vllm_reference.base_url, "/v1/messages/count_tokens", body)
    assert ours_status == ref_status == 200, (ours, ref)
    assert ours == {"input_tokens": ref["input_tokens"]}
