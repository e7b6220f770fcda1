#!/bin/bash
# server.freeze_gc_heap on one H200: benchmarks/experiments/gc_pauses.py with two gateways (startup heap frozen / not,
# gpu_memory_utilization 0.3 each), cells interleaved. Run from the repository root on the device machine, as
# one `run` call on a machine that has the vLLM bundle (or the call that carries its last part):
#   run(command="bash benchmarks/device/gc-pauses.sh", carry=[".gpu/install.sh"])
# Prefill profile, token-id prompts, 512 in / 256 out, c = 256 from 4 loadtest processes, 2048 requests per
# cell, 2 repeats: ~260 s warm (two gateway starts one after the other ~120 s, four cells ~35 s each).
# Under $OUT: gc.jsonl (one line per cell), gc.log (driver output with the table), gc-work.tar.gz (profiles,
# gateway and loadtest logs). Knobs: CONCURRENCY (256), REQUESTS (2048), REPEATS (2), INPUT_TOKENS (512),
# OUTPUT_TOKENS (256), WORKERS (4), CALL_LIMIT_S (600), EXTRA (more gc_pauses flags).
set -uo pipefail
source benchmarks/device/env.sh  # OUT, PYTHONPATH, GPU_MODEL_DIR, $deadline; exits if vLLM is missing
work=/tmp/gc-work; rm -rf "$work"; mkdir -p "$work"
python3 -m benchmarks.experiments.gc_pauses --device gpu --concurrency "${CONCURRENCY:-256}" --requests "${REQUESTS:-2048}" \
  --repeats "${REPEATS:-2}" --input-tokens "${INPUT_TOKENS:-512}" --output-tokens "${OUTPUT_TOKENS:-256}" \
  --loadtest-workers "${WORKERS:-4}" --deadline-s "$deadline" --out "$OUT/gc.jsonl" --workdir "$work" \
  ${EXTRA:-} 2>&1 | tee "$OUT/gc.log"
# One archive: a call returns at most 8 files.
tar czf "$OUT/gc-work.tar.gz" --exclude=gemma-4-e2b-synth --exclude='*.csv' --exclude='vllm-cache' \
  --exclude='*-run' --exclude='*-tmp' --exclude='*-r[0-9]*-w[0-9]*.json' -C "$(dirname "$work")" "$(basename "$work")" 2>/dev/null
echo "gc-pauses done after $(( SECONDS - t0 ))s"
