"""Calls read while they are written, with vLLM's own hermes and gemma4 parsers (this venv's vLLM):
fed a call's text cut at every character (and every few), each prefix extends the last and the
finished parse's arguments begin with every one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fixtures import synth_tokenizer
from server.engine.tool_call_prefix import CallPrefixes
from server.engine.tool_parsing import VllmToolCallParser

D = '<|"|>'
TOOLS = [
    {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}, "count": {"type": "integer"},
        "ratio": {"type": "number"}, "flag": {"type": "boolean"}, "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "maybe": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def hermes(model_dir: Path) -> VllmToolCallParser:
    from vllm.tokenizers import get_tokenizer

    return VllmToolCallParser("hermes", get_tokenizer(str(model_dir)), TOOLS, "auto", None)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> VllmToolCallParser:
    from vllm.tokenizers import get_tokenizer

    out: Path = synth_tokenizer.build(tmp_path_factory.mktemp("gemma") / "m", vocab_size=20000)
    return VllmToolCallParser("gemma4", get_tokenizer(str(out)), TOOLS, "auto", None)


def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def gemma_call(name: str, arguments: str) -> str:
    return f"<|tool_call>call:{name}{{{arguments}}}<tool_call|>"


def streamed(parser: VllmToolCallParser, text: str, step: int) -> tuple[list[str], list[int]]:
    """Each call's last prefix and how many times it grew, `text` fed `step` characters at a time."""
    reader = parser.call_prefixes()
    assert isinstance(reader, CallPrefixes)
    opener = text.index(parser.start_marker or "")
    sent: list[str] = []
    grew: list[int] = []
    for end in range(opener + 1, len(text) + step, step):
        for index, call in enumerate(reader.partial_calls(text[opener:end])):
            if index == len(sent):
                sent.append(call.arguments)
                grew.append(1)
                continue
            assert call.arguments.startswith(sent[index]) or sent[index].startswith(call.arguments), (
                sent[index], call.arguments)
            if len(call.arguments) > len(sent[index]):
                sent[index], grew[index] = call.arguments, grew[index] + 1
    return sent, grew


def check(parser: VllmToolCallParser, text: str, streams: int = 1) -> list[str]:
    """Every cut of `text` gives prefixes of the finished arguments; `streams`: how many calls
    must have grown in more than one piece (cut one character at a time)."""
    final = [c.arguments for c in parser.extract(text).calls]
    assert final, text
    for step in (1, 2, 3, 5, 8, 13):
        sent, grew = streamed(parser, text, step)
        assert len(sent) <= len(final)
        for prefix, whole in zip(sent, final):
            assert whole.startswith(prefix), (step, prefix, whole)
        if step == 1:
            assert sum(g > 1 for g in grew) >= streams, (grew, sent)
    return final


HERMES = [
    '{"path": "a/b.txt", "text": "line 1\\nline \\"2\\"\\t\\\\ end"}',
    '{"text": "caf\\u00e9 東京 😀 \\ud83d\\ude00 \\u4e2d\\/ é"}',
    '{"count": 42, "ratio": -1.50e2, "flag": true, "maybe": null, "path": "x"}',
    '{"opts": {"deep": {"a": [1, {"b": "c"}]}, "s": "t"}, "tags": ["a", "b"], "path": "after nested"}',
    '{"path":"compact","count":7}',
    '{ "path" : "spaced" ,\n  "text" : "x" }',
]


@pytest.mark.parametrize("arguments", HERMES)
def test_hermes_prefixes_lead_to_the_finished_arguments(hermes: VllmToolCallParser, arguments: str) -> None:
    [final] = check(hermes, "Let me write it. " + hermes_call("write", arguments))
    assert json.loads(final) == json.loads(arguments)


def test_hermes_empty_arguments_and_parallel_calls(hermes: VllmToolCallParser) -> None:
    assert check(hermes, hermes_call("ping", "{}"), streams=0) == ["{}"]
    text = hermes_call("write", '{"path": "one", "text": "first call"}') + "\n" + hermes_call(
        "write", '{"path": "two", "text": "second call"}')
    first, second = check(hermes, text, streams=2)
    assert json.loads(second) == {"path": "two", "text": "second call"}


def test_hermes_a_call_cut_off_gives_a_prefix_of_what_it_would_have_been(hermes: VllmToolCallParser) -> None:
    whole = hermes_call("write", '{"count": 3, "text": "cut off here and more"}')
    cut = whole[:whole.index(" here")]
    assert hermes.extract(cut).calls == []  # the finished parse finds none: what streamed stays cut
    [prefix], _ = streamed(hermes, cut, 1)
    assert prefix == '{"count": 3, "text": "cut off'


def test_hermes_a_raw_control_character_stops_the_call(hermes: VllmToolCallParser) -> None:
    text = hermes_call("write", '{"path": "a", "text": "raw\nnewline"}')
    assert hermes.extract(text).calls == []  # json.loads refuses it
    [prefix], _ = streamed(hermes, text, 1)
    assert prefix == '{"path": "a", "text": "raw'


GEMMA = [
    f"path:{D}a/b.txt{D},text:{D}line 1\nline \"2\" \\ {{braces}}, [brackets]: colon{D}",
    f"text:{D}café 東京 😀 <b>tag</b>{D},path:{D}x{D}",
    f"count:42,ratio:-1.5,flag:true,maybe:null,path:{D}after literals{D}",
    f"opts:{{deep:{{a:[1,2]}},s:{D}t{D}}},tags:[{D}a{D},{D}b{D}],path:{D}after nested{D}",
    f"count:{D}12{D},text:{D}a number as a string, coerced by the schema{D}",
    f"free:{D}not in the schema{D},text:{D}x{D}",
]


@pytest.mark.parametrize("arguments", GEMMA)
def test_gemma4_prefixes_lead_to_the_finished_arguments(gemma: VllmToolCallParser, arguments: str) -> None:
    check(gemma, "Let me write it. " + gemma_call("write", arguments))


def test_gemma4_empty_arguments_and_parallel_calls(gemma: VllmToolCallParser) -> None:
    assert check(gemma, gemma_call("ping", ""), streams=0) == ["{}"]
    text = gemma_call("write", f"path:{D}one{D},text:{D}first call{D}") + gemma_call(
        "write", f"path:{D}two{D},text:{D}second call{D}")
    first, second = check(gemma, text, streams=2)
    assert json.loads(second) == {"path": "two", "text": "second call"}


def test_gemma4_holds_a_string_the_schema_may_coerce(gemma: VllmToolCallParser) -> None:
    text = gemma_call("write", f"count:{D}12{D},path:{D}p{D}")
    assert json.loads(gemma.extract(text).calls[0].arguments) == {"count": 12, "path": "p"}
    reader = gemma.call_prefixes()
    assert reader is not None
    [call] = reader.partial_calls(text[:text.index("12") + 1])
    assert call.arguments == "{"  # `"1` could end as the number 12


def test_gemma4_a_call_cut_off_streams_its_open_string(gemma: VllmToolCallParser) -> None:
    cut = gemma_call("write", f"count:3,text:{D}cut off here")[:-len("}<tool_call|>")]
    [prefix], _ = streamed(gemma, cut, 1)
    assert prefix == '{"count": 3, "text": "cut off here'
    assert gemma.extract(cut).calls[0].arguments.startswith(prefix)


def test_parsers_without_a_reader_stream_no_calls(model_dir: Path) -> None:
    from vllm.tokenizers import get_tokenizer

    parser = VllmToolCallParser("pythonic", get_tokenizer(str(model_dir)), TOOLS, "auto", None)
    assert parser.call_prefixes() is None
