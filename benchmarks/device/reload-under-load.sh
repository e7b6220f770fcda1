#!/bin/bash
# Issues 9 (part 3) and 15 on one H200: in-place, drain-swap and blue-green reloads of the gateway under
# steady load (benchmarks/reload_under_load.py). In-place needs weights on disk:
# benchmarks/fixtures/random_weights.py writes two random checkpoints in Gemma 4 E2B's layout (~9.4 GiB
# each, bf16) under the work dir, and the gateway serves them (load_format auto) instead of dummy weights;
# a greedy-answer check without load comes first (benchmarks/reload_under_load.py says how).
# Run from the repository root on the device machine, as one `run` call:
#   run(command="bash benchmarks/device/reload-under-load.sh", carry=[".gpu/install.sh", ".gpu/pN"])
# (the call with the last staged part, or any later call on the same warm machine). Profile:
# configs/gemma4-e2b-h200.yaml at engine.gpu_memory_utilization 0.45 (two engines fit for blue-green),
# dummy weights + synthetic tokenizer; 32 streaming clients (512 in / 256 out) from 10 s before the
# first reload to 10 s after the last. Output under $OUT: part3.jsonl (one line per reload + one for
# the run), part3.json ({meta, results}), part3.log, part3-work.tar.gz (gateway log, profile, every request's timings).
# Budget: gateway start + two engine starts: ~3.5 min with a warm compile cache (e.g. right after
# http-ways.sh on the same machine), ~7 min cold on a fresh machine (then the second reload may be
# skipped by the deadline: run it again as a second call).
# Knobs: STRATEGIES (in-place,in-place-no-prefetch,drain-swap,blue-green), CONCURRENCY (32), CALL_LIMIT_S (600), EXTRA.
set -uo pipefail
source benchmarks/device/env.sh
work=/tmp/part3-work; mkdir -p "$work"
python3 -m benchmarks.reload_under_load --device gpu --deadline-s "$deadline" \
  --strategies "${STRATEGIES:-in-place,in-place-no-prefetch,drain-swap,blue-green}" --concurrency "${CONCURRENCY:-32}" \
  --out "$OUT/part3.jsonl" --workdir "$work" --requests-out "$work/requests.json" \
  --label "H200, vLLM 0.26.0, Gemma 4 E2B (random weights from disk with in-place, else dummy) + synthetic tokenizer, gpu_memory_utilization 0.45" \
  --doc "$OUT/part3.json" ${EXTRA:-} 2>&1 | tee "$OUT/part3.log"
# One archive: a call returns at most 8 files, and loose logs beyond that were dropped silently.
tar czf "$OUT/part3-work.tar.gz" --exclude=gemma-4-e2b-synth --exclude='weights-v*' -C "$(dirname "$work")" "$(basename "$work")" 2>/dev/null
echo "part3 done after $(( SECONDS - t0 ))s"
