"""The output items of a streamed `/v1/responses` generation read for tool calls (chat's
`ToolCallStream`): the text before the first call as one message, streamed as it comes, then
one `function_call` item per call, added when the call is named, its arguments streamed as
`response.function_call_arguments.delta` events as they are written.

At the finish, chat's tool stream gives the rest from the non-streamed parse: each streamed
call's remaining arguments, the calls not streamed (whole, as before), content not yet sent (a
message of its own when the message before the calls is closed). Whitespace before a call is not
made a message of its own (the non-streamed parse drops it). A call cut off by max_tokens that
streamed and that the parse could not read stays as far as it went, its item incomplete.
"""

from __future__ import annotations

from server.protocol.responses import (
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallOutput,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    TextDeltaEvent,
)
from server.serving.responses_items import (
    Events,
    function_call_events,
    message_events,
    message_opening,
    new_function_call_id,
    new_message_id,
)
from server.serving.tool_stream import CallPiece, ToolCallStream
from server.serving.tools import ToolPlan


class ToolItemsStream:
    """Feed each piece of content text (after reasoning), then `finish`; `first_index` is the
    output index of the first item (after the reasoning item, if any), read when items open."""

    def __init__(self, plan: ToolPlan, message_id: str) -> None:
        self.plan = plan
        self.tools = ToolCallStream(plan)
        self.message_id = message_id
        self.message_index: int | None = None  # the message's output index once opened
        self.message_closed = False
        self.sent: list[str] = []
        self.blank = ""  # whitespace not sent yet: it becomes text only if more text follows
        self.items: list[OutputItem] = []  # the items opened so far, in output order
        self.first: int | None = None  # the output index of items[0]
        self.calls: dict[int, tuple[int, FunctionCallOutput, list[str]]] = {}  # chat index -> index, item, parts

    def _next_index(self, first_index: int) -> int:
        if self.first is None:  # fixed once an item opens (the reasoning item is done by then)
            self.first = first_index
        return self.first + len(self.items)

    def feed(self, text: str, first_index: int) -> Events:
        release = self.tools.feed(text)
        content = self.blank + release.content
        self.blank = ""
        if content and self.message_index is None and not content.strip():
            self.blank = content
        elif content:
            if self.message_index is None:
                self.message_index = self._next_index(first_index)
                self.items.append(OutputMessage(id=self.message_id, status="in_progress", content=[]))
                yield from message_opening(self.message_id, self.message_index)
            self.sent.append(content)
            yield TextDeltaEvent, {"item_id": self.message_id, "output_index": self.message_index, "delta": content}
        for piece in release.calls:
            yield from self._call_piece(piece, first_index)

    def _close_message(self, status: str) -> Events:
        if self.message_index is None or self.message_closed:
            return
        self.message_closed = True
        message = OutputMessage(id=self.message_id, status=status,  # type: ignore[arg-type]
                                content=[OutputText(text="".join(self.sent))])
        assert self.first is not None
        self.items[self.message_index - self.first] = message
        yield from message_events(message, self.message_index, opened=True)

    def _call_piece(self, piece: CallPiece, first_index: int) -> Events:
        if piece.id is not None:
            yield from self._close_message("completed")
            index = self._next_index(first_index)
            item = FunctionCallOutput(id=new_function_call_id(), call_id=piece.id, name=piece.name or "",
                                      arguments="", status="in_progress")  # type: ignore[arg-type]
            self.calls[piece.index] = (index, item, [])
            self.items.append(item)
            yield OutputItemEvent, {"type": "response.output_item.added", "output_index": index, "item": item}
        index, item, parts = self.calls[piece.index]
        if piece.arguments:
            parts.append(piece.arguments)
            yield FunctionCallArgumentsDeltaEvent, {"item_id": item.id, "output_index": index,
                                                    "delta": piece.arguments}

    def finish(self, finish_reason: str | None, status: str,
               first_index: int) -> tuple[Events, list[OutputItem], str | None]:
        """(the rest's events, the output items in order, the finish reason)."""
        end = self.tools.finish(finish_reason)
        if self.blank and not end.calls and not self.calls:  # whitespace alone is the answer
            end.content = self.blank + end.content
        events: list = []
        if end.content and self.message_index is not None and not self.message_closed:
            self.sent.append(end.content)
            events.append((TextDeltaEvent, {"item_id": self.message_id, "output_index": self.message_index,
                                            "delta": end.content}))
            end.content = ""
        events += self._close_message(status)
        if end.content:  # content the parse found that did not stream before the calls
            message = OutputMessage(id=new_message_id(), status=status,  # type: ignore[arg-type]
                                    content=[OutputText(text=end.content)])
            events += message_events(message, self._next_index(first_index), opened=False)
            self.items.append(message)
        for piece in end.pieces:
            if piece.id is None:
                events += self._call_piece(piece, first_index)
        # Parsed calls are whole; a named call's arguments are the raw output, which may be cut off.
        call_status = status if self.plan.mode == "named" else "completed"
        parsed = {i: call for i, call in enumerate(end.calls)}
        for chat_index, (index, item, parts) in sorted(self.calls.items()):
            call = parsed.get(chat_index)
            done = item.model_copy(update={
                "arguments": "".join(parts), "status": call_status if call is not None else status})
            self.items[self.items.index(item)] = done
            events.append((FunctionCallArgumentsDoneEvent, {"item_id": item.id, "output_index": index,
                                                            "arguments": done.arguments, "name": item.name}))
            events.append((OutputItemEvent, {"type": "response.output_item.done", "output_index": index,
                                             "item": done}))
        for chat_index, call in enumerate(end.calls):
            if chat_index in self.calls:
                continue
            item = FunctionCallOutput(id=new_function_call_id(), call_id=call.id, name=call.function.name,
                                      arguments=call.function.arguments, status=call_status)  # type: ignore[arg-type]
            events += function_call_events(item, self._next_index(first_index))
            self.items.append(item)
        return iter(events), self.items, end.finish_reason
