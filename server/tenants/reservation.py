"""The max_tokens rule: how many tokens a request reserves from its tenant's limits.

A request's real cost is known only when it ends, so admission charges its worst case:

    reserved = sum over its prompts of (prompt tokens + n x max_tokens)

where the prompt tokens are the exact count of the token ids the engine is given (the rendered
chat template with its tools, tool calls, tool results and any script, or the completion
prompt's ids), and max_tokens is the output limit serving gives the engine: the request's own,
clamped to the room left in the context, or all of that room when the request sets none.

Serving computes it once the prompt is tokenized, the tokenization the engine uses (nothing is
tokenized twice), and the tenant limits decide on it before the engine sees the request
(`RequestStats.admit`). When the request ends the reservation is replaced by the tokens it
really used (prompt + completion), which can only be fewer.
"""

from __future__ import annotations

from collections.abc import Iterable


def reserved_tokens(prompts: Iterable[tuple[int, int]], n: int = 1) -> int:
    """Tokens a request reserves: `prompts` holds (prompt tokens, max_tokens) per prompt, and
    each prompt may produce `n` completions of up to max_tokens."""
    return sum(prompt + n * max_tokens for prompt, max_tokens in prompts)
