"""Cross-check with `vllm bench serve`: both tools on the same server and the same workload.

The automatic check runs both against the scripted fake server: its timings do not depend on the
machine's load, so request throughput and median TTFT must agree within 10% (in practice within
a few percent) and any difference is the tools', not the server's. The same check against the
real gateway is marked slow (engine timings on a shared 2-core box drift by more than 10%
between two back-to-back runs); its recorded result is loadtest/examples/crosscheck_gateway.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from loadtest.crosscheck import crosscheck
from tests.conftest import SERVED_NAME, ServerProcess
from tests.loadtest.conftest import ServerFactory
from tests.loadtest.fake_server import Script


def _args(base_url: str, tokenizer: Path, model: str, n: int, out_len: int) -> argparse.Namespace:
    return argparse.Namespace(base_url=base_url, tokenizer=str(tokenizer), model=model, input_len=64,
                              output_len=out_len, num_requests=n, concurrency=4, warmup=4, rounds=1,
                              seed=0, verbose=False)


def _assert_agree(result: dict[str, Any], n: int, out_len: int) -> None:
    vb, lt = result["vllm_bench_serve"], result["loadtest"]
    assert vb["completed"] == lt["completed"] == n and lt["failed"] == 0
    assert vb["total_output_tokens"] == lt["total_output_tokens"] == n * out_len
    ratio = result["ratio_loadtest_over_vllm"]
    assert ratio["request_throughput"] == pytest.approx(1.0, abs=0.10), result
    assert ratio["median_ttft_ms"] == pytest.approx(1.0, abs=0.10), result


def test_agrees_with_vllm_bench_serve_on_the_fake_server(fake_server: ServerFactory, model_dir: Path) -> None:
    server = fake_server([Script(ttft_s=0.3, itl_s=0.03, tokens=16)])
    result = crosscheck(_args(server.base_url, model_dir, "fake-model", n=24, out_len=16))
    _assert_agree(result, 24, 16)
    # Both agree with the script too: 4 in flight, each 0.3 + 15 * 0.03 s long.
    assert result["loadtest"]["median_ttft_ms"] == pytest.approx(300, rel=0.1)
    assert result["vllm_bench_serve"]["request_throughput"] == pytest.approx(4 / 0.75, rel=0.1)


@pytest.mark.slow
def test_agrees_with_vllm_bench_serve_on_the_gateway(gateway: ServerProcess, model_dir: Path) -> None:
    _assert_agree(crosscheck(_args(gateway.base_url, model_dir, SERVED_NAME, n=40, out_len=16)), 40, 16)
