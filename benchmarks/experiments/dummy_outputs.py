#!/usr/bin/env python3
"""What the dummy-weight model generates, and what that costs vLLM's incremental detokenizer.

The H200 benchmarks run Gemma 4 E2B with `load_format: dummy` (the weights cannot be fetched) and
the synthetic tokenizer. py-spy of the gateway at c = 256 (benchmarks/README) found the event loop
busy with `FastIncrementalDetokenizer._protected_step`, yet one `DecodeStream.step` costs ~1-3 us
on random ids. One input makes it costly: tokens that decode to no text (special tokens under
`skip_special_tokens`, the default). `DecodeStream` then keeps every id since its last emitted text
and decodes them all again on each step, so a run of such tokens costs O(n) per step (measured here
on the CPU: ~100 us per step after a 512-token prompt, against ~2 us). Real weights rarely emit such
runs; dummy weights under greedy decoding may emit little else.

This tool generates what the HTTP benchmarks generate (token-id prompts without special tokens,
greedy, `ignore_eos`, detokenize off), counts the output ids that are special and the steps a
`DecodeStream` primed with the prompt emits no text for, then replays the detokenizer side by side
on those outputs and on random ordinary ids of the same length (us per step, ratio).

    # on the device machine (vLLM staged), ~210 s on a fresh machine (enforce_eager, no compile):
    python3 -m benchmarks.experiments.dummy_outputs --out $OUT/dummy-outputs.json
    # CPU check with the embedded SmolLM2 and dummy weights:
    .venv/bin/python -m benchmarks.experiments.dummy_outputs --device cpu --model .state/models/smollm2-135m-instruct \
        --prompts 4 --input-tokens 64 --output-tokens 32 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time
from pathlib import Path

from benchmarks.fixtures import synth_tokenizer
from benchmarks.lib import servers
from benchmarks.lib.detok_replay import replay_us_per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--model", help="model directory (default: the synthetic Gemma 4 E2B directory)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    model = a.model
    if model is None:
        model = str(synth_tokenizer.build(servers.gpu_model_dir(Path("/tmp/gemma-4-e2b-synth"))))
    from vllm import LLM, SamplingParams, TokensPrompt
    import vllm

    kwargs: dict = {"load_format": "dummy", "seed": 0, "enforce_eager": True, "enable_prefix_caching": False,
                    "max_model_len": a.input_tokens + a.output_tokens + 16}
    if a.device == "gpu":
        kwargs |= {"gpu_memory_utilization": 0.3, "kv_sharing_fast_prefill": True}
    else:
        kwargs |= {"kv_cache_memory_bytes": 1 << 30}
    t0 = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    start_s = time.perf_counter() - t0
    tokenizer = llm.get_tokenizer()
    backend = tokenizer._tokenizer  # the `tokenizers.Tokenizer` vLLM's fast detokenizer steps
    special = set(tokenizer.all_special_ids) | set(backend.get_added_tokens_decoder())
    vocab = len(tokenizer)
    ordinary = [i for i in range(vocab) if i not in special]
    rng = random.Random(a.seed)
    prompts = [[rng.choice(ordinary) for _ in range(a.input_tokens)] for _ in range(a.prompts)]
    params = SamplingParams(max_tokens=a.output_tokens, temperature=0, ignore_eos=True, detokenize=False)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    flat = [t for out in outputs for t in out]
    common = collections.Counter(flat).most_common(8)
    random_outputs = [[rng.choice(ordinary) for _ in out] for out in outputs]
    # Side by side, alternating, twice each: the same prompts, the model's outputs against random ids.
    model_us, random_us = [], []
    for _ in range(2):
        model_us.append(replay_us_per_step(backend, prompts, outputs))
        random_us.append(replay_us_per_step(backend, prompts, random_outputs))
    doc = {
        "bench": "dummy_outputs", "vllm": vllm.__version__, "device": a.device, "model": model,
        "engine_start_s": round(start_s, 1), "prompts": a.prompts, "input_tokens": a.input_tokens,
        "output_tokens": a.output_tokens, "output_ids": len(flat),
        "special_share": round(sum(t in special for t in flat) / max(len(flat), 1), 4),
        "distinct_output_ids": len(set(flat)),
        "most_common": [{"id": t, "token": backend.id_to_token(t), "special": t in special, "count": n} for t, n in common],
        "silent_step_share_model": round(model_us[-1][1], 4), "silent_step_share_random": round(random_us[-1][1], 4),
        "detok_us_per_step_model": round(min(u for u, _ in model_us), 2),
        "detok_us_per_step_random": round(min(u for u, _ in random_us), 2),
    }
    doc["detok_ratio_model_vs_random"] = round(doc["detok_us_per_step_model"] / max(doc["detok_us_per_step_random"], 1e-9), 2)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1), flush=True)
    # The engine core runs in child processes: stop them here (os._exit left them running, holding
    # the caller's pipes open). LLM has no shutdown of its own in vLLM 0.26 or 0.32.
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
