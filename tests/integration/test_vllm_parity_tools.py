"""Differential test of tool calling: the gateway against `vllm serve` (hermes parser, the
profile's chat template), temperature 0, every request in tests/data/parity_tools.jsonl.

Compared per choice: the tool calls (name and parsed arguments), the content and the finish
reason; streams are folded first (content concatenated, `delta.tool_calls` merged by index).
Deliberate differences from `vllm serve`:
- call ids: OpenAI's `call_<hex>` where vLLM's hermes parser gives `chatcmpl-tool-<hex>`;
- streaming with tools: both stream the arguments piece by piece, cut differently (the gateway
  sends only what the finished parse is certain to begin with); the folded result is the same;
- an empty content ("" or null) is compared as equal: vLLM 0.26 and 0.32 differ among themselves;
- a streamed `required` choice cut off by max_tokens: vLLM streams the calls of the unfinished
  array (the last one with partial arguments), the gateway reads the array once it ends and
  sends none, as both servers answer the same request unstreamed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testbed.tool_deltas import no_mismatch_logged, streamed_choices
from tests.conftest import ServerProcess
from tests.integration.test_vllm_parity import call, error_type_as_class_name

DATA = Path(__file__).parents[1] / "data" / "parity_tools.jsonl"
REQUESTS = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return ("not JSON", arguments)


def fold(payload: Any) -> dict[int, dict[str, Any]]:
    """Per choice index: content, [(name, parsed arguments)], finish_reason."""
    out: dict[int, dict[str, Any]] = {}
    if isinstance(payload, dict):
        for c in payload["choices"]:
            out[c["index"]] = {
                "content": c["message"]["content"] or "",
                "calls": [(t["function"]["name"], parsed(t["function"]["arguments"]))
                          for t in c["message"].get("tool_calls") or []],
                "finish_reason": c["finish_reason"],
            }
        return out
    pieces: dict[int, dict[str, Any]] = {}
    for chunk in payload:
        for c in chunk["choices"]:
            folded = pieces.setdefault(c["index"], {"content": "", "calls": {}, "finish_reason": None})
            delta = c.get("delta") or {}
            folded["content"] += delta.get("content") or ""
            for t in delta.get("tool_calls") or []:
                entry = folded["calls"].setdefault(t["index"], {"name": "", "arguments": ""})
                function = t.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            if c.get("finish_reason"):
                folded["finish_reason"] = c["finish_reason"]
    for index, folded in pieces.items():
        calls = [folded["calls"][i] for i in sorted(folded["calls"])]
        out[index] = {"content": folded["content"], "calls": [(e["name"], parsed(e["arguments"])) for e in calls],
                      "finish_reason": folded["finish_reason"]}
    return out


def test_request_list_covers_the_tool_choices() -> None:
    assert len(REQUESTS) >= 25
    choices = {json.dumps(r["body"].get("tool_choice"), sort_keys=True) for r in REQUESTS}
    assert {'"auto"', '"required"', '"none"', "null"} <= choices
    assert any(r["body"].get("stream") for r in REQUESTS)
    assert any(m["role"] == "tool" for r in REQUESTS for m in r["body"]["messages"])


@pytest.mark.parametrize("case", REQUESTS, ids=[r["name"] for r in REQUESTS])
def test_same_tool_calls_as_vllm(case: dict[str, Any], gateway: ServerProcess, vllm_reference: ServerProcess) -> None:
    endpoint = "/v1/chat/completions"
    ours_status, ours = call(gateway.base_url, endpoint, case["body"])
    ref_status, ref = call(vllm_reference.base_url, endpoint, case["body"])
    assert ours_status == ref_status, (ours, ref)
    if ref_status != 200:
        assert ours["error"]["type"] == error_type_as_class_name(ref["error"]["type"], ref_status)
        return
    if isinstance(ref, list) and case["body"].get("tool_choice") == "required":
        if any(c["finish_reason"] == "length" for c in fold(ref).values()):
            pytest.skip("streamed `required` cut off by max_tokens: a listed difference")
    assert fold(ours) == fold(ref)
    if isinstance(ref, dict):
        for c in ours["choices"]:
            assert all(t["id"].startswith("call_") and t["type"] == "function" for t in c["message"]["tool_calls"])
    # `required` on this profile is a JSON array that goes whole when the choice ends: streamed
    # and plain are the same parse, and `stream_required` already compares the stream with vLLM's
    if case["body"].get("tool_choice", "auto") not in ("none", "required") and case["body"].get("tools"):
        check_streamed_arguments(gateway, case["body"], ours)


# (tool_choice, arguments, pieces) of each call streamed over the data
STREAMED: list[tuple[str, str, int]] = []


def check_streamed_arguments(gateway: ServerProcess, body: dict[str, Any], answer: Any) -> None:
    """The gateway's answer to the same request in the other mode (streamed or not): each streamed
    call's argument pieces concatenated are the non-streamed arguments exactly, and the calls,
    their names and the finish reasons are the same."""
    status, other = call(gateway.base_url, "/v1/chat/completions", {**body, "stream": not body.get("stream")})
    assert status == 200, other
    plain, streamed = (answer, other) if isinstance(answer, dict) else (other, answer)
    pieces = streamed_choices(streamed)
    for choice in plain["choices"]:
        got = pieces[choice["index"]]
        if choice["finish_reason"] == "length" and not choice["message"].get("tool_calls"):
            continue  # a call cut off: the parse reads none, the stream sent it as far as it went
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (t["function"]["name"], t["function"]["arguments"]) for t in choice["message"].get("tool_calls") or []]
        assert got["finish_reason"] == choice["finish_reason"]
        assert got["content"].strip() == (choice["message"]["content"] or "").strip()
        choice_name = body.get("tool_choice") if isinstance(body.get("tool_choice"), str) else "named"
        STREAMED.extend((choice_name or "auto", c["arguments"], c["pieces"]) for c in got["calls"])


def test_streamed_calls_came_in_pieces(gateway: ServerProcess) -> None:
    """(After the cases above.) A call longer than a few tokens arrived as it was written: a named
    function's JSON (the CPU profile forces it into the schema) and hermes calls under `auto`
    (SmolLM2 writes none on this data: tests/integration/test_tool_choice_gemma4.py streams the
    model's own syntax on the engine). `required` is not checked here: on this profile its JSON array
    goes whole when the choice ends."""
    long_calls = [(c, a, n) for c, a, n in STREAMED if len(a) > 12]
    if not long_calls:
        pytest.skip("no case streamed a call (run with the cases above)")
    assert all(n > 1 for _, _, n in long_calls), long_calls
    assert no_mismatch_logged(gateway)
