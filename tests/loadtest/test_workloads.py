"""Prompt generation: exact lengths, range ratio, shared prefixes, big vocabularies, JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.workloads import RandomWorkload, jsonl_specs, random_specs


def test_token_id_prompts_have_exact_lengths_and_repeat_with_the_seed() -> None:
    w = RandomWorkload(input_len=64, output_len=16, vocab_size=262_144)
    specs = random_specs(w, 50, seed=3)
    assert all(len(s.prompt) == 64 and s.input_tokens == 64 and s.max_tokens == 16 for s in specs)
    ids = [t for s in specs for t in s.prompt]  # type: ignore[union-attr]
    assert min(ids) >= 0 and max(ids) < 262_144
    assert max(ids) > 200_000  # the whole vocabulary is used, not a small corner of it
    assert random_specs(w, 50, seed=3) == specs and random_specs(w, 50, seed=4) != specs


def test_range_ratio_bounds_lengths() -> None:
    specs = random_specs(RandomWorkload(100, 20, range_ratio=0.5, vocab_size=1000), 300, seed=0)
    lens = [len(s.prompt) for s in specs]
    outs = [s.max_tokens for s in specs]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 30
    assert min(outs) >= 10 and max(outs) <= 30


def test_prefix_sharing_workload() -> None:
    specs = random_specs(RandomWorkload(16, 4, prefix_len=32, num_prefixes=2, vocab_size=5000), 6, seed=1)
    prefixes = [tuple(s.prompt[:32]) for s in specs]  # type: ignore[index]
    assert len(set(prefixes)) == 2 and prefixes[0] == prefixes[2] == prefixes[4]
    assert all(len(s.prompt) == 48 for s in specs)
    assert len({tuple(s.prompt[32:]) for s in specs}) == 6  # type: ignore[index]


def test_text_prompts_retokenize_to_the_requested_length(tokenizer: Any) -> None:
    specs = random_specs(RandomWorkload(64, 8, text=True), 10, seed=0, tokenizer=tokenizer)
    special = set(tokenizer.all_special_ids)
    for s in specs:
        assert isinstance(s.prompt, str)
        enc = tokenizer.encode(s.prompt, add_special_tokens=False)
        assert len(enc) == s.input_tokens and abs(len(enc) - 64) <= 2
        assert not special & set(enc)
    assert sum(s.input_tokens == 64 for s in specs) >= 8


def test_random_prompts_need_a_vocabulary() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        random_specs(RandomWorkload(8, 8), 1, seed=0)


def test_jsonl_prompts_cycle_and_keep_messages(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "hello", "max_tokens": 5}, {"messages": [{"role": "user", "content": "hi"}]},
            {"prompt": [1, 2, 3]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    specs = jsonl_specs(path, 4, default_output_len=9, seed=0)
    assert [s.max_tokens for s in specs] == [5, 9, 9, 5]
    assert specs[1].messages == rows[1]["messages"] and specs[1].prompt == "hi"
    assert specs[2].input_tokens == 3
