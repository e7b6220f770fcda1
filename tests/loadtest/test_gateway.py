"""Against the real gateway with the embedded model (session-shared `gateway` fixture)."""

from __future__ import annotations

import asyncio
from typing import Any

from loadtest.client import Endpoint
from loadtest.metrics import summarize
from loadtest.runner import Bounds, Load, run_load
from loadtest.workloads import RandomWorkload, random_specs
from tests.conftest import SERVED_NAME, ServerProcess

INPUT_LEN, OUTPUT_LEN, N = 32, 8, 12


def test_short_run_has_no_errors_and_token_counts_match_usage(gateway: ServerProcess, tokenizer: Any) -> None:
    # Token-id prompts: exact prompt lengths with no detokenize/retokenize round-trip.
    specs = random_specs(RandomWorkload(INPUT_LEN, OUTPUT_LEN), N, seed=0, tokenizer=tokenizer)
    endpoint = Endpoint(base_url=gateway.base_url, model=SERVED_NAME, ignore_eos=True)
    result = asyncio.run(run_load(endpoint, Load("concurrency", 4), Bounds(num_requests=N), specs,
                                  warmup_specs=specs[:1], timeout_s=120))
    s = summarize(result.records, result.duration_s)
    assert s["failed"] == 0, s["errors"]
    assert s["completed"] == N
    for r in result.records:
        # The server's usage, the requested lengths and the streamed chunks all agree.
        assert (r.prompt_tokens, r.completion_tokens) == (INPUT_LEN, OUTPUT_LEN)
        assert r.chunks == OUTPUT_LEN and len(r.itl_s) == OUTPUT_LEN - 1
        assert r.ttft_s is not None and r.latency_s is not None and 0 < r.ttft_s < r.latency_s
    assert s["total_output_tokens"] == N * OUTPUT_LEN and s["total_input_tokens"] == N * INPUT_LEN
    assert s["output_token_throughput"] > 0 and s["tpot_ms"]["median"] > 0
    assert s["output_chars_per_token"] > 0.5, s["output_chars_per_token"]  # the stream carried text
