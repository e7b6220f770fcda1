"""Replaying vLLM's incremental detokenizer on recorded outputs: what one `DecodeStream.step` costs
as vLLM primes and steps it, and how many steps emit no text (experiments/dummy_outputs.py found
that a run of skipped special tokens makes each step decode the whole window again)."""

from __future__ import annotations

import time


def replay_us_per_step(tokenizer, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, float]:  # noqa: ANN001
    """Mean us per `DecodeStream.step` as vLLM primes and steps it, and the share of steps with no text."""
    from tokenizers.decoders import DecodeStream

    steps = silent = 0
    start = time.perf_counter()
    for prompt, out in zip(prompts, outputs):
        stream = DecodeStream(ids=prompt, skip_special_tokens=True)
        for token in out:
            try:
                text = stream.step(tokenizer, token)
            except Exception:  # vLLM resets the stream on "invalid prefix"; count it as silent
                stream, text = DecodeStream(skip_special_tokens=True), None
            steps += 1
            silent += not text
    return (time.perf_counter() - start) / max(steps, 1) * 1e6, silent / max(steps, 1)
