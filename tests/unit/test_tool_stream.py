"""`ToolCallStream` over vLLM's hermes and gemma4 parsers, fed a choice cut at every character (and
every few): the content before the call as it comes, each call's id and name in its first piece,
its arguments in pieces whose concatenation is the non-streamed parse's arguments exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.fixtures import synth_tokenizer
from server.engine import TokenLogprob
from server.engine.tool_parsing import VllmToolCallParser
from server.serving.tool_stream import ToolCallStream
from server.serving.tools import ToolPlan, read_tool_calls
from tests.unit.test_tool_call_prefix import GEMMA, HERMES, TOOLS, gemma_call, hermes_call


@pytest.fixture(scope="module")
def hermes_tokenizer(model_dir: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def gemma_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(synth_tokenizer.build(tmp_path_factory.mktemp("gemma") / "m", vocab_size=20000)))


def plan(name: str, tokenizer: Any, mode: str = "auto", single: bool = False) -> ToolPlan:
    choice: Any = mode if mode in ("auto", "required", "none") else {"type": "function", "function": {"name": mode}}
    parser = VllmToolCallParser(name, tokenizer, TOOLS, choice, False if single else None)
    return ToolPlan(tools=TOOLS, mode="named" if isinstance(choice, dict) else mode,  # type: ignore[arg-type]
                    function_name=mode if isinstance(choice, dict) else None, parser=parser, single_call=single)


def run(p: ToolPlan, text: str, step: int, finish_reason: str = "stop") -> dict[str, Any]:
    """The stream's content, calls (merged from their pieces) and finish, fed `step` characters
    at a time, each character with one logprob."""
    stream = ToolCallStream(p)
    content, calls, logprobs, growth = "", [], 0, []
    for start in range(0, len(text), step):
        piece = text[start:start + step]
        release = stream.feed(piece, [TokenLogprob(token=c, token_id=0, logprob=-1.0, candidates=None) for c in piece])
        content += release.content
        logprobs += len(release.logprobs)
        for call in release.calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name
                calls.append({"id": call.id, "name": call.name, "arguments": call.arguments})
                growth.append(1)
            else:
                assert call.index < len(calls) and call.name is None and call.arguments
                calls[call.index]["arguments"] += call.arguments
                growth[call.index] += 1
    end = stream.finish(finish_reason)
    content += end.content
    logprobs += len(end.logprobs)
    for call in end.pieces:
        if call.id is not None:
            assert call.index == len(calls)
            calls.append({"id": call.id, "name": call.name, "arguments": call.arguments})
            growth.append(0)
        else:
            calls[call.index]["arguments"] += call.arguments
    assert logprobs == len(text)  # every token's logprobs go out once
    assert [c.id for c in end.calls] == [c["id"] for c in calls[:len(end.calls)]]
    return {"content": content, "calls": calls, "growth": growth, "finish": end.finish_reason,
            "mismatches": stream.mismatches, "parsed": end.calls}


def check(p: ToolPlan, text: str) -> dict[str, Any]:
    """Streamed at every cut, the calls are the non-streamed parse's, exactly."""
    content, final, reason = read_tool_calls(p, text, "stop")
    for step in (1, 2, 3, 4, 7, 16, len(text)):
        got = run(p, text, step)
        assert got["mismatches"] == []
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (c.function.name, c.function.arguments) for c in final], step
        assert got["finish"] == reason
        if content and content.strip():  # (gemma4's parse drops the space before a call, sent by then)
            assert got["content"].strip() == content.strip()
    return run(p, text, 1)


@pytest.mark.parametrize("arguments", HERMES)
def test_hermes_calls_stream_in_pieces_that_make_the_parsed_arguments(hermes_tokenizer: Any, arguments: str) -> None:
    got = check(plan("hermes", hermes_tokenizer), "I'll write it. " + hermes_call("write", arguments))
    assert got["content"] == "I'll write it. " and got["growth"][0] > 2


@pytest.mark.parametrize("arguments", GEMMA)
def test_gemma4_calls_stream_in_pieces_that_make_the_parsed_arguments(gemma_tokenizer: Any, arguments: str) -> None:
    got = check(plan("gemma4", gemma_tokenizer), "I'll write it. " + gemma_call("write", arguments))
    assert got["content"] == "I'll write it. " and got["growth"][0] > 2


@pytest.mark.parametrize("syntax", ["hermes", "gemma4"])
def test_parallel_calls_each_have_their_index_and_empty_arguments_close(
        syntax: str, hermes_tokenizer: Any, gemma_tokenizer: Any) -> None:
    if syntax == "hermes":
        p, call, arg = plan("hermes", hermes_tokenizer), hermes_call, lambda k, v: f'"{k}": "{v}"'
        text = call("write", "{" + arg("path", "one") + ", " + arg("text", "first") + "}") + "\n" + call(
            "ping", "{}") + "\n" + call("write", "{" + arg("text", "third call") + "}")
    else:
        p, call = plan("gemma4", gemma_tokenizer), gemma_call
        text = call("write", f'path:{D}one{D},text:{D}first{D}') + call("ping", "") + call(
            "write", f"text:{D}third call{D}")
    got = check(p, text)
    assert [c["name"] for c in got["calls"]] == ["write", "ping", "write"]
    assert [c["arguments"] for c in got["calls"]][1] == "{}"
    assert len({c["id"] for c in got["calls"]}) == 3


D = '<|"|>'


def test_parallel_tool_calls_false_streams_the_first_call_only(hermes_tokenizer: Any) -> None:
    p = plan("hermes", hermes_tokenizer, single=True)
    text = hermes_call("write", '{"path": "one"}') + hermes_call("write", '{"path": "two"}')
    got = check(p, text)
    assert [json.loads(c["arguments"]) for c in got["calls"]] == [{"path": "one"}]


def test_named_gemma4_streams_only_the_named_function(gemma_tokenizer: Any) -> None:
    got = check(plan("gemma4", gemma_tokenizer, mode="write"), gemma_call("write", f"text:{D}named{D}"))
    assert [c["name"] for c in got["calls"]] == ["write"] and got["finish"] == "stop"
    got = check(plan("gemma4", gemma_tokenizer, mode="required"), gemma_call("ping", ""))
    assert [c["name"] for c in got["calls"]] == ["ping"] and got["finish"] == "tool_calls"


def test_a_hermes_call_cut_by_length_stays_the_cut_call(hermes_tokenizer: Any) -> None:
    p = plan("hermes", hermes_tokenizer)
    text = "Sure. " + hermes_call("write", '{"path": "p", "text": "a long text cut off')[:-len("}\n</tool_call>")]
    got = run(p, text, 1, finish_reason="length")
    # The parse finds no call; what streamed is the call as far as it went, not text as well.
    assert got["parsed"] == [] and got["finish"] == "length" and got["mismatches"] == []
    assert got["content"] == "Sure. "
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        ("write", '{"path": "p", "text": "a long text cut off')]


def test_a_gemma4_call_cut_by_length_gets_the_parsed_rest(gemma_tokenizer: Any) -> None:
    p = plan("gemma4", gemma_tokenizer)
    text = gemma_call("write", f"count:3,text:{D}cut off")[:-len("}<tool_call|>")]
    got = run(p, text, 1, finish_reason="length")
    assert got["mismatches"] == [] and got["finish"] == "tool_calls"
    assert [c["arguments"] for c in got["calls"]] == [got["parsed"][0].function.arguments]


def test_a_finished_parse_that_disagrees_is_logged_and_counted(hermes_tokenizer: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    # A duplicate key: json.loads keeps the last value in the first key's place, which no prefix
    # rule foresees (a model that repeats a key).
    p = plan("hermes", hermes_tokenizer)
    got = run(p, hermes_call("write", '{"path": "first", "path": "second"}'), 1)
    assert got["mismatches"] and "disagrees" in caplog.text
    assert got["parsed"][0].function.arguments == '{"path": "second"}'


def test_tool_choice_none_streams_no_calls(gemma_tokenizer: Any) -> None:
    p = plan("gemma4", gemma_tokenizer, mode="none")
    stream = ToolCallStream(p)
    release = stream.feed("Hi. " + gemma_call("write", f"text:{D}x{D}"))
    assert release.calls == [] and stream.finish("stop").pieces == []


def test_a_named_function_forced_into_json_streams_its_arguments_as_written(hermes_tokenizer: Any) -> None:
    p = plan("hermes", hermes_tokenizer, mode="write")
    p.parser.forced_by_schema = True  # type: ignore[union-attr]  # the CPU profile's JSON-schema path
    assert not p.reads_own_syntax
    text = '\n{"path": "a/b", "text": "as written, \\u00e9 kept"}'
    for step in (1, 3, 8):
        got = run(p, text, step)
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [("write", text)]
        assert got["growth"][0] > 2 and got["content"] == "" and got["finish"] == "stop"
    assert run(p, "  ", 1)["calls"] == []  # whitespace alone: no call, as the parse says
