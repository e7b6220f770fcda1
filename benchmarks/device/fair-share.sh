#!/bin/bash
# The tenants' fair share on one H200 (issue 38): benchmarks/fair_share.py with two gateways on the decode
# profile (fair queue on / first come first served), both up at once, as a run that outlives one call.
#   run(command="bash benchmarks/device/fair-share.sh start", carry=[".gpu/install.sh", ".gpu/pN"])
#       the call with the last staged part (or any later one): starts the run in its own session
#       (it survives the call while the machine stays warm), then waits like `wait`
#   run(command="bash benchmarks/device/fair-share.sh wait")
#       waits until the run ends or this call's deadline, then packs under $OUT: fair-share.json (the
#       rounds so far and their summary), fair-share.log, fair-share-work.tar.gz (both gateways' logs,
#       the machine samples)
# Knobs: SEQS (256: the engine's max_num_seqs), FLOOD (256,1024: tenant A's streams, at and past it),
# LIGHT_C (4: tenant B's streams), ROUNDS (3), WINDOW (10 s), WORKERS (4 client processes per flood),
# RUN_S (the run's own deadline for starting a round, 900), WAYS (fair,fifo; vllm adds `vllm serve`
# as the anchor), ENGINE_ARGS (JSON for engine.extra_engine_args of every server, e.g.
# '{"stream_interval": 4}').
set -uo pipefail
source benchmarks/device/env.sh
source benchmarks/device/detach.sh
name=fair-share
DETACH_DIR=/tmp/$name
if [ "${1:-}" = start ]; then
  engine_args=${ENGINE_ARGS:-"{}"}
  detach_start "$name" python3 -m benchmarks.fair_share --device gpu --config "$PWD/configs/gemma4-e2b-h200-decode.yaml" \
    --seqs "${SEQS:-256}" --flood "${FLOOD:-256,1024}" --flood-workers "${WORKERS:-4}" \
    --light-concurrency "${LIGHT_C:-4}" --light 6 --window "${WINDOW:-10}" --rounds "${ROUNDS:-3}" \
    --deadline-s "${RUN_S:-900}" --ways "${WAYS:-fair,fifo}" --engine-args "$engine_args" \
    --out "$DETACH_DIR/fair-share.json"
fi
detach_wait "$name"
cp "$DETACH_DIR/fair-share.json" "$DETACH_DIR/run.log" "$OUT/" 2>/dev/null
mv "$OUT/run.log" "$OUT/fair-share.log" 2>/dev/null
tar czf "$OUT/fair-share-work.tar.gz" -C "$DETACH_DIR" --exclude=src --exclude='*.json' . 2>/dev/null
grep -E "round|deadline|Error|error|Traceback" "$DETACH_DIR/run.log" | cut -c1-300 | tail -30
echo "fair-share ${1:-wait} done after $(( SECONDS - t0 ))s"
