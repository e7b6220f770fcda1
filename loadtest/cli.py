"""Command line: `run` (default), `compare A.json B.json`, `plot RESULT.json`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from loadtest.client import Endpoint
from loadtest.metrics import SLO_METRICS
from loadtest.records import RequestSpec
from loadtest.runner import Bounds, Load, RunResult, run_load

COMMANDS = ("run", "compare", "plot")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def _slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in SLO_METRICS or not value:
        raise argparse.ArgumentTypeError(f"SLO must be one of {'/'.join(SLO_METRICS)}:MILLISECONDS, got {text!r}")
    return name, float(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loadtest", description="Load test an OpenAI-compatible server.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a load test (default command)")
    target = run.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="server root or .../v1, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    target.add_argument("--api", choices=["completions", "chat"], default="completions",
                        help="/v1/completions or /v1/chat/completions")
    target.add_argument("--no-stream", action="store_true", help="plain responses (TTFT = E2E, no ITL)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, s")
    target.add_argument("--extra-body", type=_json_object, help='JSON merged into every body, e.g. \'{"min_tokens": 16}\'')

    shape = run.add_argument_group("load shape (a comma list sweeps)")
    shape.add_argument("--concurrency", type=_floats, help="fixed concurrency, e.g. 1,2,4,8")
    shape.add_argument("--rate", type=_floats, help="request rate per second, e.g. 1,2,inf")
    shape.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier")
    shape.add_argument("--max-concurrency", type=int, help="cap on in-flight requests with --rate")
    shape.add_argument("--ramp-up", type=float, default=0.0, help="seconds to rise linearly to the full load")
    shape.add_argument("--num-requests", "-n", type=int, help="requests per run (default 100 unless --duration)")
    shape.add_argument("--duration", type=float, help="seconds per run; in-flight requests finish")
    shape.add_argument("--warmup", type=int, default=0, help="uncounted warm-up requests before each run")
    shape.add_argument("--workers", type=int, default=1,
                       help="client processes sharing the load (default 1): concurrency, rate, --max-concurrency, "
                            "-n and --warmup are split between them (10 over 3 -> 4,3,3), --duration applies to "
                            "each; they start together after the warm-up and their records are merged into one "
                            "summary. Needs concurrency >= N. With N > 1 there is no live progress bar: a line "
                            "per finished worker instead")

    work = run.add_argument_group("workload")
    work.add_argument("--dataset", choices=["random", "jsonl"], default="random")
    work.add_argument("--jsonl", type=Path, help="prompts file for --dataset jsonl")
    work.add_argument("--input-len", type=int, default=128)
    work.add_argument("--output-len", type=int, default=128)
    work.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    work.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens (prefix-sharing workload)")
    work.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes")
    work.add_argument("--tokenizer", help="local tokenizer path (transformers) for exact-length prompts")
    work.add_argument("--vocab-size", type=int, help="token-id prompts without a tokenizer")
    work.add_argument("--text-prompts", action="store_true",
                      help="send text, not token ids (needs --tokenizer; implied by --api chat)")
    work.add_argument("--ignore-eos", action="store_true", help="fixed output length (vLLM's ignore_eos)")
    work.add_argument("--seed", type=int, default=0)

    out = run.add_argument_group("results")
    out.add_argument("--slo", type=_slo, action="append", default=[],
                     help="goodput SLO, e.g. ttft:500 tpot:50 e2e:5000 (ms), repeatable")
    out.add_argument("--out", type=Path, help="result JSON (a .csv is written next to it)")
    out.add_argument("--plot", action="store_true", help="PNG plots next to --out")
    out.add_argument("--no-progress", action="store_true")
    run.set_defaults(func=cmd_run)

    cmp_ = sub.add_parser("compare", help="side-by-side table of two result files")
    cmp_.add_argument("a", type=Path)
    cmp_.add_argument("b", type=Path)
    cmp_.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="(re)draw the plots of a result file")
    plot.add_argument("result", type=Path)
    plot.set_defaults(func=cmd_plot)
    return parser


def _loads(args: argparse.Namespace) -> list[Load]:
    if args.concurrency and args.rate:
        sys.exit("give --concurrency or --rate, not both")
    if args.rate:
        return [Load("rate", r, args.burstiness, args.max_concurrency, args.ramp_up) for r in args.rate]
    values = args.concurrency or [1.0]
    return [Load("concurrency", int(c), ramp_up_s=args.ramp_up) for c in values]


def _discover_model(endpoint_base: str, api_key: str | None) -> str:
    import httpx

    base = endpoint_base.rstrip("/")
    url = (base if base.endswith("/v1") else base + "/v1") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(url, headers=headers, timeout=30).raise_for_status().json()
    return str(data["data"][0]["id"])


def _specs(args: argparse.Namespace, count: int, seed: int) -> list[RequestSpec]:
    from loadtest import workloads

    if args.dataset == "jsonl":
        if not args.jsonl:
            sys.exit("--dataset jsonl needs --jsonl PATH")
        return workloads.jsonl_specs(args.jsonl, count, args.output_len, seed)
    tokenizer = workloads.load_tokenizer(args.tokenizer) if args.tokenizer else None
    spec = workloads.RandomWorkload(
        input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, vocab_size=args.vocab_size,
        text=args.text_prompts or args.api == "chat")
    try:
        return workloads.random_specs(spec, count, seed, tokenizer)
    except ValueError as exc:
        sys.exit(str(exc))


def _config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    skip = {"func", "api_key"}  # never write secrets into result files
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}
    cfg["model"] = model
    cfg["slo"] = dict(args.slo)
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from loadtest.progress import ProgressBar
    from loadtest.report import format_summary
    from loadtest.metrics import summarize

    num = args.num_requests if args.num_requests is not None else (None if args.duration else 100)
    bounds = Bounds(num_requests=num, duration_s=args.duration)
    model = args.model or _discover_model(args.base_url, args.api_key)
    endpoint = Endpoint(base_url=args.base_url, model=model, api=args.api, stream=not args.no_stream,
                        api_key=args.api_key, ignore_eos=args.ignore_eos, temperature=args.temperature,
                        extra_body=args.extra_body)
    specs = _specs(args, num or 1000, args.seed)  # duration runs cycle through a pool
    warmup = _specs(args, args.warmup, args.seed + 1) if args.warmup else []
    slos = dict(args.slo)
    runs: list[RunResult] = []
    for load in _loads(args):
        if args.workers > 1:
            result = _run_workers(args, endpoint, load, bounds, specs, warmup)
        else:
            bar = ProgressBar(num, load.label, enabled=not args.no_progress)
            try:
                result = asyncio.run(run_load(endpoint, load, bounds, specs, warmup_specs=warmup, seed=args.seed,
                                              observer=bar, timeout_s=args.timeout))
            finally:
                bar.close()
        runs.append(result)
        print(format_summary(load.label, summarize(result.records, result.duration_s, slos)), flush=True)
    if args.out:
        _write(args, runs, model, slos)
    return 0


def _run_workers(args: argparse.Namespace, endpoint: Endpoint, load: Load, bounds: Bounds,
                 specs: list[RequestSpec], warmup: list[RequestSpec]) -> RunResult:
    from loadtest.workers import WorkerJob, WorkerResult, run_workers

    def done(res: WorkerResult, job: WorkerJob) -> None:
        if not args.no_progress:
            failed = sum(1 for r in res.records if not r.ok)
            print(f"{load.label}: worker {job.worker + 1}/{args.workers} ({job.load.label}) done: "
                  f"{len(res.records)} requests, {failed} failed", file=sys.stderr, flush=True)

    try:
        return run_workers(endpoint, load, bounds, specs, workers=args.workers, warmup_specs=warmup,
                           seed=args.seed, timeout_s=args.timeout, on_done=done)
    except RuntimeError as exc:
        sys.exit(f"{load.label}: {exc}")


def _write(args: argparse.Namespace, runs: list[RunResult], model: str, slos: dict[str, float]) -> None:
    from loadtest.results import build_document, write_csv, write_json

    doc = build_document(_config(args, model), runs, slos)
    write_json(args.out, doc)
    write_csv(args.out.with_suffix(".csv"), doc)
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")
    if args.plot:
        from loadtest.plots import write_plots

        for path in write_plots(doc, args.out.parent, args.out.stem):
            print(f"wrote {path}")


def cmd_compare(args: argparse.Namespace) -> int:
    from loadtest.compare import compare_table
    from loadtest.results import read_document

    try:
        a, b = read_document(args.a), read_document(args.b)
    except (OSError, ValueError) as exc:
        sys.exit(f"compare: {exc}")
    print(compare_table(a, b, args.a.stem, args.b.stem))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from loadtest.plots import write_plots
    from loadtest.results import read_document

    for path in write_plots(read_document(args.result), args.result.parent, args.result.stem):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")  # `python -m loadtest --base-url ...` means run
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run" and args.rate and any(r <= 0 or math.isnan(r) for r in args.rate):
        sys.exit("--rate values must be > 0")
    if args.command == "run":
        from loadtest.workers import validate

        problem = validate(args.workers, concurrency=args.concurrency, rate=args.rate,
                           max_concurrency=args.max_concurrency, num_requests=args.num_requests,
                           burstiness=args.burstiness)
        if problem:
            parser.error(problem)
    return int(args.func(args) or 0)
