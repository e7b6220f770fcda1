#!/bin/bash
# The HTTP ways on one H200 (issue 9 part 2): the tuned profile three ways (in-process AsyncLLM, gateway,
# vllm serve), by benchmarks/http_overhead.py or, with INTERLEAVED=1, benchmarks/http_interleaved.py.
# Run from the repository root on the device machine, as one `run` call:
#   run(command="bash benchmarks/device/http-ways.sh", carry=[".gpu/install.sh", ".gpu/pN"])
# either as the call that brings the last staged part (../shared/gpu/README.md) or any later call on
# the same warm machine. Everything lands under $OUT: part2.jsonl (one line per way x concurrency),
# part2.json ({meta, results} of this call), part2.log (driver output), part2-work.tar.gz (profile, server and
# loadtest logs, raw loadtest results). The driver stops itself before the 600 s device limit.
# Budget: engine start ~270 s cold on a fresh machine, ~60 s with the compile cache warm; three
# engines plus ~40 s of load each need ~330 s warm, so on a fresh machine plan TWO calls: the first
# (cold compile) measures what fits, the second, same machine, gives the complete three-way table.
# Knobs (environment): WAYS (inproc,gateway,vllm), CONCURRENCY (1,32,256), REQUESTS (2 x c, >= 16),
# INPUT_TOKENS (512), OUTPUT_TOKENS (256), CALL_LIMIT_S (600), EXTRA (more http_overhead flags);
# INTERLEAVED=1 runs http_interleaved instead (REPEATS 3, WORKERS 4 load-client processes, CELL_OUTPUT_TOKENS
# 65536: at least that many output tokens per cell, i.e. 256 requests at c = 32 of 256 tokens): the three
# engines up at once at gpu_memory_utilization 0.3, each cell interleaving the ways, then the client check.
# TEXT=1 (with INTERLEAVED=1) sends text prompts of exactly INPUT_TOKENS tokens (issue 14, goal 4), HTTP ways
# only; the lead's run, ~250-300 s warm (engines ~60-90 s side by side, 3 repeats + client check ~160 s):
#   TEXT=1 INTERLEAVED=1 WAYS=gateway,vllm CONCURRENCY=64 INPUT_TOKENS=4096 OUTPUT_TOKENS=16 bash benchmarks/device/http-ways.sh
set -uo pipefail
source benchmarks/device/env.sh
work=/tmp/part2-work; mkdir -p "$work"
if [ -n "${INTERLEAVED:-}" ]; then  # issue 14: all engines up at once, cells interleaved, client check
  prompts="token-id prompts"; text=()
  if [ -n "${TEXT:-}" ]; then prompts="text prompts (servers tokenize)"; text=(--text-prompts); fi
  python3 -m benchmarks.http_interleaved ${text[@]+"${text[@]}"} --device gpu --deadline-s "$deadline" --repeats "${REPEATS:-3}" \
    --ways "${WAYS:-inproc,gateway,vllm}" --concurrency "${CONCURRENCY:-1,32,256}" --loadtest-workers "${WORKERS:-4}" \
    ${REQUESTS:+--requests "$REQUESTS"} --cell-output-tokens "${CELL_OUTPUT_TOKENS:-65536}" \
    --input-tokens "${INPUT_TOKENS:-512}" --output-tokens "${OUTPUT_TOKENS:-256}" \
    --out "$OUT/part2.jsonl" --workdir "$work" \
    --label "H200, vLLM 0.26.0, Gemma 4 E2B dummy weights + synthetic byte-level tokenizer, $prompts, interleaved" \
    --doc "$OUT/part2.json" ${EXTRA:-} 2>&1 | tee "$OUT/part2.log"
else
python3 -m benchmarks.http_overhead --device gpu --deadline-s "$deadline" --min-left-s 100 \
  --ways "${WAYS:-inproc,gateway,vllm}" --concurrency "${CONCURRENCY:-1,32,256}" \
  ${REQUESTS:+--requests "$REQUESTS"} --input-tokens "${INPUT_TOKENS:-512}" --output-tokens "${OUTPUT_TOKENS:-256}" \
  --out "$OUT/part2.jsonl" --workdir "$work" --run-id "h200-part2-$(date -u +%H%M%S)" \
  --label "H200, vLLM 0.26.0, Gemma 4 E2B dummy weights + synthetic byte-level tokenizer, token-id prompts" \
  --doc "$OUT/part2.json" ${EXTRA:-} 2>&1 | tee "$OUT/part2.log"
fi
# One archive: a call returns at most 8 files, and loose logs beyond that were dropped silently.
tar czf "$OUT/part2-work.tar.gz" --exclude=gemma-4-e2b-synth --exclude='*.csv' --exclude='*-r[0-9]*-w[0-9]*.json' -C "$(dirname "$work")" "$(basename "$work")" 2>/dev/null
echo "part2 done after $(( SECONDS - t0 ))s"
