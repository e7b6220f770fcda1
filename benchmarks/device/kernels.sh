#!/bin/bash
# The engine's own flags on one H200 (issue 37): benchmarks/profiles.py over FP8 weights, FP8 KV cache,
# CUDA graph modes and async scheduling, on both shipped profiles, as a sweep that outlives one call.
#   run(command="bash benchmarks/device/kernels.sh start", carry=[".gpu/install.sh", ".gpu/pN"])
#       the call with the last staged part (or any later one): starts the sweep in its own session
#       (it survives the call while the machine stays warm), then waits like `wait`
#   run(command="bash benchmarks/device/kernels.sh wait")
#       waits until the sweep ends or this call's deadline, then packs what it has under $OUT:
#       kernels.jsonl (one line per profile x workload x repeat), kernels-steps.jsonl (the traced
#       single streams: GPU kernel time against wall time), kernels.log (the driver's output),
#       kernels-work.tar.gz (every engine's log, the machine samples)
# Knobs: PROFILES, TRACE (profiles that also trace a single stream and a 256-stream decode), REPEATS (3),
# SWEEP_S (the sweep's own deadline, 1150), WORKLOADS (all five), INTERLEAVE=1 (every profile's engine up
# at once on an equal share of the memory, cells interleaved: --interleave), KV_GIB (each engine's KV
# cache then, 12).
set -uo pipefail
source benchmarks/device/env.sh
source benchmarks/device/detach.sh
if [ "${1:-}" = start ]; then
  # one model path for every engine: vLLM's compile cache is keyed by it
  mkdir -p "$GPU_MODEL_DIR"; cp benchmarks/fixtures/models/gemma-4-e2b-text/*.json "$GPU_MODEL_DIR/"
  detach_start kernels python3 -m benchmarks.profiles \
    --profiles "${PROFILES:-defaults,defaults_fp8,defaults_fp8kv,defaults_full_decode_only,fast_prefill_32k,fast_prefill_32k_fp8_fp8kv,defaults_fp8_fp8kv,defaults_piecewise,defaults_no_async}" \
    --trace-profiles "${TRACE-defaults,defaults_fp8,defaults_full_decode_only}" --repeats "${REPEATS:-3}" \
    ${WORKLOADS:+--workloads "$WORKLOADS"} ${INTERLEAVE:+--interleave --kv-cache-gib "${KV_GIB:-12}"} --model "$GPU_MODEL_DIR" --out /tmp/kernels/kernels.jsonl \
    --log /tmp/kernels/children.log --deadline-s "${SWEEP_S:-1150}"
fi
detach_wait kernels
cp "$DETACH_DIR/run.log" "$OUT/kernels.log"; cp "$DETACH_DIR"/kernels*.jsonl "$OUT/" 2>/dev/null
tar czf "$OUT/kernels-work.tar.gz" -C "$DETACH_DIR" children.log machine.csv 2>/dev/null
grep -E "engine up|#[0-9]:|step trace|exit|Error|error" "$DETACH_DIR/run.log" | cut -c1-300 | tail -40
echo "kernels ${1:-wait} done after $(( SECONDS - t0 ))s"
