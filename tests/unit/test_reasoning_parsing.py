"""The engine seam's reasoning parser with vLLM's own parsers (gemma4, deepseek_r1) on CPU.

The tokenizer is the embedded SmolLM2 one with the parsers' markers added as special tokens
(gemma4 looks its `<|channel>`, `<channel|>`, `<|tool_call>` ... up in the vocabulary), so
each marker is one token, as in Gemma 4's own tokenizer. Run on both vLLM releases:
`.venv/bin/python -m pytest` (0.32) and `.venv-vllm026/bin/python -m pytest` (0.26).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from server.engine.reasoning_parsing import (  # noqa: E402
    VllmReasoningParser,
    available_reasoning_parsers,
)
from tests.conftest import MODEL_DIR  # noqa: E402

MARKERS = ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|turn>",
           "<|tool_response>", "<think>", "</think>"]
GEMMA_PROMPT = "<|turn>user\nHi<turn|>\n<|turn>model\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the embedded model is missing: run `llm-gateway prepare-model`")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def streamed(parser: VllmReasoningParser, tokenizer: Any, text: str) -> list[tuple[str | None, str | None]]:
    """The parser fed `text` one token at a time, each delta's text as the detokenizer gives it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for i, token_id in enumerate(ids):
        delta = tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])):]
        out.append(parser.stream(delta, [token_id], finished=i == len(ids) - 1))
    return out


def joined(deltas: list[tuple[str | None, str | None]], part: int) -> str:
    return "".join(d[part] or "" for d in deltas)


CASES = [
    ("<|channel>thought\nLet me add.<channel|>The answer is 4.", "Let me add.", "The answer is 4."),
    ("Just an answer, no thoughts.", None, "Just an answer, no thoughts."),
    ("<|channel>thought\nstill thinking when cut off", "still thinking when cut off", None),
    ("<|channel>thought\nneeds a tool<channel|>Checking.<|tool_call>call:f{a:1}<tool_call|>",
     "needs a tool", "Checking.<|tool_call>call:f{a:1}<tool_call|>"),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_gemma4_finished_and_streamed_agree(tokenizer: Any, text: str, reasoning: str | None,
                                            content: str | None) -> None:
    prompt = tokenizer.encode(GEMMA_PROMPT, add_special_tokens=False)
    assert VllmReasoningParser("gemma4", tokenizer, prompt).extract(text) == (reasoning, content)
    deltas = streamed(VllmReasoningParser("gemma4", tokenizer, prompt), tokenizer, text)
    assert joined(deltas, 0) == (reasoning or "")
    assert joined(deltas, 1) == (content or "")


@pytest.mark.parametrize("text", ["Sunny answer", '"<|channel>plan<channel|>Sunny"'])
def test_gemma4_stream_ending_on_eos_leaves_it_out(tokenizer: Any, text: str) -> None:
    # The last delta of a choice that stopped on EOS: vLLM's detokenizer gave no text for it, but
    # its id is there. vLLM 0.26's engine-based gemma4 parser printed it from the id (the H200 run
    # streamed `...Sunny"<eos>`); the markers come as plain pieces here, as a grammar writes them.
    prompt = tokenizer.encode(GEMMA_PROMPT, add_special_tokens=False)
    parser = VllmReasoningParser("gemma4", tokenizer, prompt)
    deltas = [parser.stream(ch, tokenizer.encode(ch, add_special_tokens=False)) for ch in text]
    deltas.append(parser.stream("", [tokenizer.eos_token_id], finished=True, ended_on_stop_token=True))
    assert joined(deltas, 0) + joined(deltas, 1) == text


def test_gemma4_streams_content_as_it_comes(tokenizer: Any) -> None:
    prompt = tokenizer.encode(GEMMA_PROMPT, add_special_tokens=False)
    text = "<|channel>thought\nfirst think<channel|>then answer in several words"
    deltas = streamed(VllmReasoningParser("gemma4", tokenizer, prompt), tokenizer, text)
    before_last = deltas[:-1]
    assert sum(1 for r, _ in before_last if r) > 1, deltas
    assert sum(1 for _, c in before_last if c) > 1, deltas
    first_content = next(i for i, (_, c) in enumerate(deltas) if c)
    assert all(not r for r, _ in deltas[first_content:]), "reasoning after content"


def test_gemma4_prompt_that_leaves_reasoning_open(tokenizer: Any) -> None:
    # A template that ends in `<|channel>` (after a tool response): the output starts inside
    # the reasoning block, as vLLM's adjust_initial_state_from_prompt sets it.
    prompt = tokenizer.encode(GEMMA_PROMPT + "<|channel>", add_special_tokens=False)
    deltas = streamed(VllmReasoningParser("gemma4", tokenizer, prompt), tokenizer,
                      "thought\nmore thinking<channel|>Done.")
    assert joined(deltas, 0) == "more thinking"
    assert joined(deltas, 1) == "Done."


def test_gemma4_keeps_special_tokens(tokenizer: Any) -> None:
    assert VllmReasoningParser("gemma4", tokenizer).keeps_special_tokens is True


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>Add them.</think>It is 4.", "Add them.", "It is 4."),
    ("<think>cut off", "cut off", None),
])
def test_classic_parser_deepseek_r1(tokenizer: Any, text: str, reasoning: str | None,
                                    content: str | None) -> None:
    parser = VllmReasoningParser("deepseek_r1", tokenizer, tokenizer.encode("user: hi", add_special_tokens=False))
    assert parser.keeps_special_tokens is False  # its adjust_request leaves the request alone
    assert parser.extract(text) == (reasoning, content)
    deltas = streamed(VllmReasoningParser("deepseek_r1", tokenizer), tokenizer, text)
    assert joined(deltas, 0) == (reasoning or "")
    assert joined(deltas, 1) == (content or "")


def test_unknown_parser_names_name_the_choices() -> None:
    from server.engine.vllm_engine import check_parser_names
    from server.settings import EngineProfile, Settings

    def profile(**parsers: str) -> Settings:
        return Settings(engine=EngineProfile(model=str(MODEL_DIR), device="cpu",
                                             kv_cache_memory_bytes=1 << 20, **parsers))

    assert "gemma4" in available_reasoning_parsers()
    check_parser_names(profile(tool_call_parser="gemma4", reasoning_parser="gemma4"))
    with pytest.raises(ValueError, match=r"engine.reasoning_parser: vLLM has no reasoning parser 'nope'.*gemma4"):
        check_parser_names(profile(reasoning_parser="nope"))
    with pytest.raises(ValueError, match=r"engine.tool_call_parser: vLLM has no tool parser 'nope'.*hermes"):
        check_parser_names(profile(tool_call_parser="nope"))


@pytest.mark.anyio
async def test_unknown_reasoning_parser_is_refused_before_the_model_loads(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server.engine.vllm_engine as vllm_engine
    from server.settings import EngineProfile, ServerSettings, Settings

    monkeypatch.setattr(vllm_engine, "prepare_engine_environment", lambda _: tmp_path / "rpc")
    settings = Settings(
        server=ServerSettings(state_dir=tmp_path),
        engine=EngineProfile(model=str(MODEL_DIR), device="cpu", kv_cache_memory_bytes=1 << 20,
                             reasoning_parser="no-such-parser"),
    )
    with pytest.raises(ValueError, match=r"engine.reasoning_parser.*'no-such-parser'.*available: .*gemma4"):
        await vllm_engine.VllmEngine.start(settings)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
