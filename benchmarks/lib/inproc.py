"""The in-process way of http_overhead.py: vLLM's AsyncLLM driven by loadtest's closed loop in this
process, no HTTP. Runs as a child of http_overhead.py (`python -m benchmarks.lib.inproc`, the
command from ways.inproc_child_cmd), which passes the profile and writes the table; here only the
engine and the loop. With `--cells-stdin` (http_interleaved.py) it runs one cell per line read,
"<concurrency> <repeat>", and answers each with CELL_DONE, so the parent can interleave it with the
HTTP ways while every engine stays up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.lib import engine_side, servers
from benchmarks.lib.ways import CELL_DONE, requests_for, result_line, seed_for


def inproc_child(a: argparse.Namespace) -> None:
    """AsyncLLM in this process: the loadtest closed loop without HTTP; writes result lines."""
    import asyncio

    from loadtest.metrics import summarize
    from loadtest.records import RequestRecord
    from loadtest.workloads import RandomWorkload, random_specs
    from server.engine import engine_args_kwargs, prepare_engine_environment
    from server.settings import load_settings

    settings = load_settings(a.profile)
    prepare_engine_environment(settings)
    kwargs = engine_args_kwargs(settings)
    deadline = float(a.deadline_at)
    t0 = time.monotonic()

    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=UsageContext.OPENAI_API_SERVER)
    start_s = time.monotonic() - t0
    print(f"[inproc] engine up in {start_s:.1f}s (vLLM {vllm.__version__})", flush=True)

    def sampling(max_tokens: int) -> SamplingParams:
        # what the gateway builds for the loadtest body (temperature 0, ignore_eos, stream)
        return SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              skip_special_tokens=True, output_kind=RequestOutputKind.DELTA)

    async def one(prompt: list[int], max_tokens: int, rec: RequestRecord, clock_zero: float, rid: str) -> None:
        start = time.perf_counter()
        rec.sent_s = start - clock_zero
        last = start
        n_out = 0
        try:
            async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt), sampling(max_tokens), rid):
                now = time.perf_counter()
                toks = len(out.outputs[0].token_ids) if out.outputs else 0
                if toks:
                    if rec.ttft_s is None:
                        rec.ttft_s = now - start
                    else:
                        rec.itl_s.append(now - last)
                    last = now
                    rec.chunks += 1
                    n_out += toks
                    rec.output_chars += len(out.outputs[0].text)
            rec.status = 200
        except Exception as exc:  # a failure is a record, as in loadtest
            rec.error = repr(exc)[:300]
        rec.latency_s = time.perf_counter() - start
        rec.prompt_tokens = len(prompt)
        rec.completion_tokens = n_out

    async def closed_loop(specs, width: int, count: int, tag: str):  # noqa: ANN001, ANN202
        clock_zero = time.perf_counter()
        records: list[RequestRecord] = []
        counter = iter(range(10**9))

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= count:
                    return
                rec = RequestRecord(index=i, scheduled_s=time.perf_counter() - clock_zero)
                spec = specs[i % len(specs)]
                rec.input_tokens_requested, rec.max_tokens = spec.input_tokens, spec.max_tokens
                await one(list(spec.prompt), spec.max_tokens, rec, clock_zero, f"{tag}-{i}")
                records.append(rec)

        await asyncio.gather(*(worker() for _ in range(max(1, min(width, count)))))
        records.sort(key=lambda r: r.index)
        duration = max((r.sent_s + (r.latency_s or 0.0) for r in records), default=0.0)
        return records, duration

    def cells():  # noqa: ANN202
        if not a.cells_stdin:
            yield from ((int(x), 0) for x in a.concurrency.split(","))
            return
        for line in sys.stdin:  # http_interleaved.py: "<concurrency> <repeat>" per cell, in its order
            c, rep = line.split()
            yield int(c), int(rep)

    async def main() -> None:
        for c, rep in cells():
            if time.time() > deadline - a.min_left_s / 4:
                print(f"[inproc] c={c} skipped: deadline", flush=True)
                break
            n = requests_for(c, a.requests, a.cell_output_tokens, a.output_tokens)
            wl = RandomWorkload(input_len=a.input_tokens, output_len=a.output_tokens, vocab_size=a.vocab_size)
            seed = seed_for(a.seed + 100 * rep, c)
            warm = random_specs(wl, c, seed + 1)  # loadtest's --warmup c uses seed + 1 too
            specs = random_specs(wl, n, seed)
            # warm-up included, as in the HTTP ways' loadtest runs (lib/engine_side.py)
            meter = engine_side.CellMeter(os.getpid(), engine_side.local, count_clients=False)
            await closed_loop(warm, c, len(warm), f"w{c}")
            records, duration = await closed_loop(specs, c, n, f"r{c}")
            side = meter.stop()
            rec = result_line("inproc", c, summarize(records, duration), requests=n, warmup=c, repeat=rep,
                              engine_start_s=round(start_s, 1), vllm=vllm.__version__, **side, **json.loads(a.meta))
            servers.append_jsonl(Path(a.out), rec)
            print(f"[inproc] c={c}: {rec['request_throughput']:.2f} req/s, {rec['output_token_throughput']:.1f} "
                  f"out tok/s, TTFT p50 {rec['ttft_p50_ms']} ms, TPOT p50 {rec['tpot_p50_ms']} ms; "
                  f"{engine_side.brief(rec)}", flush=True)
            if a.cells_stdin:
                print(CELL_DONE, flush=True)

    asyncio.run(main())
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown: the parent ends the process group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="the effective gateway profile (YAML) of the run")
    ap.add_argument("--out", required=True, help="result lines are appended here")
    ap.add_argument("--concurrency", default="1,32,256", help="the cells to run (without --cells-stdin)")
    ap.add_argument("--cells-stdin", action="store_true",
                    help='read one cell per line, "<concurrency> <repeat>", and answer each with CELL_DONE')
    ap.add_argument("--requests", type=int, default=None, help="requests per cell (default: ways.requests_for)")
    ap.add_argument("--cell-output-tokens", type=int, default=0)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--vocab-size", type=int, required=True, help="prompt ids in [0, N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-at", type=float, required=True, help="wall-clock time (time.time()) to stop by")
    ap.add_argument("--min-left-s", type=float, default=90.0, help="skip a cell with less than a quarter of this left")
    ap.add_argument("--meta", default="{}", help="JSON object stored in every result line")
    inproc_child(ap.parse_args())


if __name__ == "__main__":
    main()
