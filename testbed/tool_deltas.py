"""Streamed tool calls put back together, checking the shape of each piece as OpenAI streams it:
a call's first delta has its index, id, type and name, later ones the index and more arguments."""

from __future__ import annotations

from typing import Any


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
