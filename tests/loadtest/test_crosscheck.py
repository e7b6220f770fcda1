"""Cross-check with `vllm bench serve` on the same gateway and workload.

Both tools drive the session's gateway with the same workload (random 64-token text prompts,
exactly 16 output tokens, 4 in flight); request throughput and median TTFT must agree within
10%. vLLM's benchmark takes ~20 s just to import, so the run is kept small.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from loadtest.crosscheck import crosscheck
from tests.conftest import SERVED_NAME, ServerProcess


def test_agrees_with_vllm_bench_serve(gateway: ServerProcess, model_dir: Path) -> None:
    args = argparse.Namespace(base_url=gateway.base_url, tokenizer=str(model_dir), model=SERVED_NAME,
                              input_len=64, output_len=16, num_requests=24, concurrency=4, warmup=4,
                              rounds=1, seed=0, verbose=False)
    result = crosscheck(args)
    vb, lt = result["vllm_bench_serve"], result["loadtest"]
    assert vb["completed"] == lt["completed"] == 24 and lt["failed"] == 0
    assert vb["total_output_tokens"] == lt["total_output_tokens"] == 24 * 16
    ratio = result["ratio_loadtest_over_vllm"]
    assert ratio["request_throughput"] == pytest.approx(1.0, abs=0.10), result
    assert ratio["median_ttft_ms"] == pytest.approx(1.0, abs=0.10), result
