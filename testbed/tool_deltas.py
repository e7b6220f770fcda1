"""Streamed tool calls put back together, checking the shape of each piece as OpenAI streams it:
a call's first delta has its index, id, type and name, later ones the index and more arguments."""

from __future__ import annotations

from typing import Any

# What the gateway logs when a finished parse does not begin with what a call streamed
# (server/serving/tool_stream.py): tests read the gateway's log for it.
MISMATCH_LOG = "streamed tool call disagrees with the finished parse"


def no_mismatch_logged(server: Any) -> bool:
    """Whether the gateway's log has no streamed-call mismatch (True for a server started outside
    the test run, whose log is not at hand)."""
    return not hasattr(server, "log") or MISMATCH_LOG not in server.log()


def merged_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of one choice's chat deltas (`choices[i].delta` dicts or the choices), in index
    order, each {"id", "name", "arguments", "pieces"} (pieces: how many deltas carried it)."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        delta = d.get("delta", d)
        for piece in delta.get("tool_calls") or []:
            index, function = piece["index"], piece["function"]
            if index == len(calls):  # a new call: in order, its first piece names it
                assert piece["id"] and piece["type"] == "function" and function["name"], piece
                calls.append({"id": piece["id"], "name": function["name"], "arguments": "", "pieces": 0})
            else:
                assert index < len(calls), f"call {index} before call {len(calls)}"
                assert piece.get("id") is None and function.get("name") is None, piece
            calls[index]["arguments"] += function.get("arguments") or ""
            calls[index]["pieces"] += 1
    return calls


def streamed_choices(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index of a chat stream's chunks (dicts): its content, its calls (`merged_calls`)
    and its finish reason."""
    deltas: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            deltas.setdefault(choice["index"], []).append(choice)
    out = {}
    for index, choice_deltas in deltas.items():
        out[index] = {"content": "".join(d["delta"].get("content") or "" for d in choice_deltas),
                      "calls": merged_calls(choice_deltas),
                      "finish_reason": next(
                          (d["finish_reason"] for d in choice_deltas if d.get("finish_reason")), None)}
    return out


def sdk_chat_calls(stream: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The calls and finish reason of an OpenAI SDK chat stream (choice 0)."""
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            deltas.append({"delta": choice.delta.model_dump(exclude_none=True)})
            finish = choice.finish_reason or finish
    return merged_calls(deltas), finish


def sdk_response_calls(stream: Any) -> tuple[list[dict[str, Any]], Any]:
    """The function calls of an OpenAI SDK responses stream: per call item, in output order, its
    name, the arguments its deltas make and how many deltas; and the final response."""
    calls: dict[str, dict[str, Any]] = {}
    for event in stream:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            assert event.item.arguments == "", event
            calls[event.item.id] = {"name": event.item.name, "arguments": "", "pieces": 0}
        elif event.type == "response.function_call_arguments.delta":
            calls[event.item_id]["arguments"] += event.delta
            calls[event.item_id]["pieces"] += 1
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == calls[event.item_id]["arguments"], event
    return list(calls.values()), stream.get_final_response()


def check_responses_stream_is_plain(client: Any, **kwargs: Any) -> None:
    """`client.responses` (OpenAI SDK) with `kwargs` plain, then streamed: the streamed function
    calls are the plain ones (names, arguments exactly), the first came in more than one delta,
    and the stream's final response holds the arguments its deltas made."""
    plain = [o for o in client.responses.create(**kwargs).output if o.type == "function_call"]
    with client.responses.stream(**kwargs) as stream:
        items, final = sdk_response_calls(stream)
    assert [(c["name"], c["arguments"]) for c in items] == [(o.name, o.arguments) for o in plain]
    assert items and items[0]["pieces"] > 1
    assert [o.arguments for o in final.output if o.type == "function_call"] == [c["arguments"] for c in items]


def sdk_message_uses(stream: Any) -> tuple[list[dict[str, Any]], Any]:
    """The tool_use blocks of an anthropic SDK `messages.stream()`: per block, its name, the JSON
    its `input_json_delta`s make and how many; and the final message."""
    uses: dict[int, dict[str, Any]] = {}
    for event in stream:
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            uses[event.index] = {"name": event.content_block.name, "arguments": "", "pieces": 0}
        elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
            uses[event.index]["arguments"] += event.delta.partial_json
            uses[event.index]["pieces"] += 1
    return [uses[i] for i in sorted(uses)], stream.get_final_message()
