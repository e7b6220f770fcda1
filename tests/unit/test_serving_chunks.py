"""The hand-built chunk events write exactly what the pydantic models write."""

from __future__ import annotations

import pytest

from server.protocol.openai import (
    ChatCompletionStreamResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionStreamResponse,
)
from server.serving.chunks import ChatContentChunks, CompletionTextChunks
from server.serving.sse import sse

AWKWARD_TEXTS = [
    "",
    "plain words",
    'quote " backslash \\ slash / </script>',
    "newline \n tab \t return \r feed \f back \b",
    "".join(chr(c) for c in range(0x20)) + "\x7f",
    "é 日本語 \u2028 \u2029 \ufeff 😀 \U0010ffff",
    "<pad><pad>",
]
ENDINGS = [(None, None), ("stop", None), ("stop", "</s>"), ("stop", 42), ("length", None), ("abort", 'a"b')]
IDS = [("cmpl-0123456789abcdef", "gemma-4-e2b"), ('odd "id"\n', "model/with \\ and é")]


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("text", AWKWARD_TEXTS)
@pytest.mark.parametrize("finish_reason,stop_reason", ENDINGS)
def test_completion_event_matches_the_model(request_id, model, text, finish_reason, stop_reason):
    expected = sse(CompletionStreamResponse(
        id=request_id, created=1764700000, model=model,
        choices=[CompletionChoice(index=3, text=text, finish_reason=finish_reason, stop_reason=stop_reason)],
    ).model_dump_json(exclude={"usage"}))
    got = CompletionTextChunks(request_id, 1764700000, model).event(3, text, finish_reason, stop_reason)
    assert got == expected


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("text", AWKWARD_TEXTS)
@pytest.mark.parametrize("finish_reason,stop_reason", ENDINGS)
def test_chat_event_matches_the_model(request_id, model, text, finish_reason, stop_reason):
    choice = ChatStreamChoice(index=1, delta=ChatDelta(content=text), finish_reason=finish_reason,
                              stop_reason=stop_reason)
    exclude: dict = {"delta": {"role", "reasoning", "tool_calls"}}
    if finish_reason is None:
        exclude["stop_reason"] = True
    expected = sse(ChatCompletionStreamResponse(id=request_id, created=1764700000, model=model, choices=[choice])
                   .model_dump_json(exclude={"usage": True, "choices": {0: exclude}}))
    got = ChatContentChunks(request_id, 1764700000, model).event(1, text, finish_reason, stop_reason)
    assert got == expected

