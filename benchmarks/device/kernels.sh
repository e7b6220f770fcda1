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
# Knobs: PROFILES, TRACE (profiles that also trace a single stream), REPEATS (3), SWEEP_S (the
# sweep's own deadline, 1150), WORKLOADS (all five).
set -uo pipefail
source benchmarks/device/env.sh
k=/tmp/kernels
if [ "${1:-}" = start ]; then
  rm -rf "$k"; mkdir -p "$k/src"
  # a later call runs in a fresh copy of the tree: the sweep runs from its own copy
  tar cf - --exclude=results --exclude=__pycache__ benchmarks | tar xf - -C "$k/src"
  # one model path for every engine: vLLM's compile cache is keyed by it
  mkdir -p "$GPU_MODEL_DIR"; cp benchmarks/fixtures/models/gemma-4-e2b-text/*.json "$GPU_MODEL_DIR/"
  profiles=${PROFILES:-defaults,defaults_fp8,defaults_fp8kv,defaults_full_decode_only,fast_prefill_32k,fast_prefill_32k_fp8_fp8kv,defaults_fp8_fp8kv,defaults_piecewise,defaults_no_async}
  ( cd "$k/src" && PYTHONPATH=/tmp/site:$k/src setsid nohup python3 -m benchmarks.profiles \
      --profiles "$profiles" --trace-profiles "${TRACE:-defaults,defaults_fp8,defaults_full_decode_only}" \
      --repeats "${REPEATS:-3}" ${WORKLOADS:+--workloads "$WORKLOADS"} --model "$GPU_MODEL_DIR" \
      --out "$k/kernels.jsonl" --log "$k/children.log" --deadline-s "${SWEEP_S:-1150}" \
      > "$k/kernels.log" 2>&1 < /dev/null & echo $! > "$k/pid" )
  setsid nohup bash -c 'while :; do
      echo "$(date +%T),$(cut -d" " -f1 /proc/loadavg),$(nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw,memory.used --format=csv,noheader,nounits | head -1)"
      sleep 1
    done' > "$k/machine.csv" 2>&1 < /dev/null &
  echo "sweep started: $profiles"
fi
[ -f "$k/pid" ] || { echo "no sweep started on this machine"; exit 2; }
while kill -0 "$(cat "$k/pid")" 2>/dev/null && [ $(( SECONDS - t0 )) -lt "$deadline" ]; do sleep 5; done
kill -0 "$(cat "$k/pid")" 2>/dev/null && echo "sweep still running" || echo "sweep ended"
cp "$k/kernels.log" "$OUT/"; cp "$k"/kernels*.jsonl "$OUT/" 2>/dev/null
tar czf "$OUT/kernels-work.tar.gz" -C "$k" children.log machine.csv 2>/dev/null
grep -E "engine up|#[0-9]:|step trace|exit|Error|error" "$k/kernels.log" | cut -c1-300 | tail -40
echo "kernels ${1:-wait} done after $(( SECONDS - t0 ))s"
