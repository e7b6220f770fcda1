"""The two load clients the replicas benchmark runs on every way (benchmarks/replicas.py): vLLM's own
`vllm bench serve` (through benchmarks/vllm_cli.py) and `loadtest`, their commands and their results
in one set of fields (lib/ways.summary_fields, which reads loadtest's summaries)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CLIENTS = ("vllm-bench", "loadtest")


def vllm_bench_cmd(base_url: str, model: str, tokenizer: str, c: int, n: int, a: argparse.Namespace, seed: int,
                   result_dir: Path, name: str) -> list[str]:
    """`vllm bench serve` as the issue ran it: random text prompts of --input-tokens tokens, exactly
    --output-tokens out (ignore_eos), --max-concurrency c, --warmup warm-up requests (at most c)."""
    return [sys.executable, "-m", "benchmarks.vllm_cli", "bench", "serve", "--backend", "openai",
            "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(a.input_tokens),
            "--random-output-len", str(a.output_tokens), "--num-prompts", str(n), "--max-concurrency", str(c),
            "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(min(c, a.warmup)), "--seed", str(seed),
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir), "--result-filename", name]


def from_vllm_bench(res: dict[str, Any]) -> dict[str, Any]:
    """vllm bench serve's result file in the fields of loadtest's result lines (lib/ways.summary_fields)."""
    def r3(key: str) -> float | None:
        v = res.get(key)
        return None if v is None else round(float(v), 3)

    return {"completed": res.get("completed"), "failed": res.get("failed", 0),
            "duration_s": r3("duration"), "request_throughput": r3("request_throughput"),
            "output_token_throughput": round(float(res.get("output_throughput") or 0.0), 2),
            "total_output_tokens": res.get("total_output_tokens"), "total_input_tokens": res.get("total_input_tokens"),
            "ttft_p50_ms": r3("median_ttft_ms"), "ttft_p99_ms": r3("p99_ttft_ms"),
            "tpot_p50_ms": r3("median_tpot_ms"), "tpot_p99_ms": r3("p99_tpot_ms"),
            "itl_p50_ms": r3("median_itl_ms"), "itl_p99_ms": r3("p99_itl_ms")}
