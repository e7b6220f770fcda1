"""Hand-built SSE events for the chunk a stream sends most: one choice's plain text delta.

Building and dumping a pydantic model per chunk was the largest share of the event loop's work that
the gateway could cut on its own at high concurrency (docs/performance/event-loop.md). These builders write
byte for byte what the models write (tests/unit/test_serving_chunks.py compares them over awkward text);
every other chunk (logprobs, echo, roles, reasoning, tool calls, usage) still goes through the models.
"""

from __future__ import annotations

from json.encoder import encode_basestring  # the C encoder json.dumps uses, without its per-call setup


def _json_scalar(value: int | str | None) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return encode_basestring(value)
    return str(int(value))


def _event_head(object_name: str, request_id: str, created: int, model: str) -> str:
    """Everything of a one-choice chunk event up to the choice's index: the same for a whole stream."""
    return (
        f'data: {{"id":{encode_basestring(request_id)},"object":"{object_name}",'
        f'"created":{int(created)},"model":{encode_basestring(model)},"choices":[{{"index":'
    )


class CompletionTextChunks:
    """`data: {...}` events of /v1/completions for one stream, as CompletionStreamResponse
    (without usage) dumps them."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _event_head("text_completion", request_id, created, model)

    def event(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        return (
            f'{self._head}{index},"text":{encode_basestring(text)},"logprobs":null,'
            f'"finish_reason":{_json_scalar(finish_reason)},"stop_reason":{_json_scalar(stop_reason)}}}]}}\n\n'
        )


class ChatContentChunks:
    """`data: {...}` events of /v1/chat/completions for a delta with content only and no logprobs,
    as ChatCompletionStreamResponse dumps them with the chat stream's exclusions (the delta's unset
    fields, and stop_reason before the finish)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = _event_head("chat.completion.chunk", request_id, created, model)

    def event(self, index: int, content: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        tail = "" if finish_reason is None else f',"stop_reason":{_json_scalar(stop_reason)}'
        return (
            f'{self._head}{index},"delta":{{"content":{encode_basestring(content)}}},"logprobs":null,'
            f'"finish_reason":{_json_scalar(finish_reason)}{tail}}}]}}\n\n'
        )
