"""Workloads: random-token prompts, shared-prefix prompts, prompts from a JSONL file.

Random prompts are token ids drawn uniformly from the vocabulary minus special tokens. They are
sent as token ids (exact length, no tokenizer round-trip; /v1/completions only) unless text is
asked for, which needs a tokenizer: ids are decoded and re-encoded until the length is right,
since decode/encode is not an identity.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loadtest.records import RequestSpec


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy import, only when asked for

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class RandomWorkload:
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 1
    vocab_size: int | None = None
    text: bool = False


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    # Uniform in [mean*(1-r), mean*(1+r)], as `vllm bench serve --random-range-ratio`.
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(low, high)


class _IdSampler:
    """Uniform token ids that are not special tokens; no list of the vocabulary is built (262k is fine)."""

    def __init__(self, vocab_size: int, special: set[int], rng: random.Random) -> None:
        self.vocab_size = vocab_size
        self.special = special
        self.rng = rng

    def sample(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            tok = self.rng.randrange(self.vocab_size)
            if tok not in self.special:
                out.append(tok)
        return out


def _fit_text(ids: list[int], target: int, tokenizer: Tokenizer, sampler: _IdSampler) -> tuple[str, int]:
    """Text whose re-encoding is `target` tokens long (or as close as 10 rounds get)."""
    text = tokenizer.decode(ids)
    for _ in range(10):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target:
            return text, target
        enc = enc[:target] if len(enc) > target else enc + sampler.sample(target - len(enc))
        text = tokenizer.decode(enc)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_specs(workload: RandomWorkload, count: int, seed: int, tokenizer: Tokenizer | None = None) -> list[RequestSpec]:
    rng = random.Random(seed)
    if tokenizer is not None:
        vocab = workload.vocab_size or len(tokenizer)  # type: ignore[arg-type]
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
    elif workload.text:
        raise ValueError("text prompts need --tokenizer")
    elif workload.vocab_size:
        vocab, special = workload.vocab_size, set()
    else:
        raise ValueError("random prompts need --tokenizer or --vocab-size")
    sampler = _IdSampler(vocab, special, rng)
    prefixes = [sampler.sample(workload.prefix_len) for _ in range(max(1, workload.num_prefixes))]
    specs = []
    for i in range(count):
        prefix = prefixes[i % len(prefixes)] if workload.prefix_len else []
        ids = prefix + sampler.sample(_length(rng, workload.input_len, workload.range_ratio))
        out_len = _length(rng, workload.output_len, workload.range_ratio)
        if workload.text:
            assert tokenizer is not None
            text, n = _fit_text(ids, len(ids), tokenizer, sampler)
            specs.append(RequestSpec(prompt=text, max_tokens=out_len, input_tokens=n))
        else:
            specs.append(RequestSpec(prompt=ids, max_tokens=out_len, input_tokens=len(ids)))
    return specs


def jsonl_specs(path: Path, count: int, default_output_len: int, seed: int, shuffle: bool = False) -> list[RequestSpec]:
    """Lines: {"prompt": str | [ids]} or {"messages": [...]}, optional "max_tokens"/"output_len"."""
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                row = json.loads(line)
                if "prompt" not in row and "messages" not in row:
                    raise ValueError(f"{path}:{n}: needs 'prompt' or 'messages'")
                rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    if shuffle:
        random.Random(seed).shuffle(rows)
    specs = []
    for i in range(count):
        row = rows[i % len(rows)]
        messages = row.get("messages")
        prompt = row.get("prompt", messages[-1]["content"] if messages else "")
        specs.append(RequestSpec(
            prompt=prompt, messages=messages,
            max_tokens=int(row.get("max_tokens", row.get("output_len", default_output_len))),
            input_tokens=len(prompt) if isinstance(prompt, list) else row.get("input_len")))
    return specs
