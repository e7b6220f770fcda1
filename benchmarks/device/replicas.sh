#!/bin/bash
# N gateway replicas on one H200 behind nginx against one `vllm serve` (issue 36): benchmarks/replicas.py,
# every engine up at once, cells interleaved, both load clients, as a run that outlives one call.
#   run(command="bash benchmarks/device/replicas.sh start", carry=[".gpu/install.sh", ".gpu/pN", ".devtools/nginx"],
#       needs_h200=true)
#       the call with the last staged part (or any later one): starts the run in its own session
#       (it survives the call while the machine stays warm), then waits like `wait`
#   run(command="bash benchmarks/device/replicas.sh wait")
#       waits until the run ends or this call's deadline, then packs under $OUT: replicas.jsonl (one
#       line per client x way x concurrency x repeat), replicas.json (with the summary, once the run
#       ended), replicas.log, replicas-work.tar.gz (every server's and client's log, machine samples)
# Memory: each engine of the decode profile took ~24 GiB on the H100 with KV_GIB 8 (c = 512 of 512 + 256
# tokens fits one engine, no preemption), so vllm serve + 4 gateways (~120 GiB) need an H200; on a card
# under 100 GiB (an H100) REPLICAS defaults to 1,2 (vllm serve + 3 gateways ran out of memory there).
# Knobs: REPLICAS (1,2,3,4), CONCURRENCY (256,512), REPEATS (3), CLIENTS (vllm-bench,loadtest), WORKERS (8
# loadtest processes), KV_GIB (8), CONFIG (configs/gemma4-e2b-h200-decode.yaml), RUN_S (the run's own deadline,
# 1250), MPS (1: every engine a client of one CUDA MPS daemon, benchmarks/lib/mps.py), SET (one profile
# override for every engine, `vllm serve` included, e.g. "engine.extra_engine_args={stream_interval: 4}"), FILL (M:
# also a fill-first front fN per N > 1, the first gateway filled to M open requests first: server.replicas_fill_first).
set -uo pipefail
source benchmarks/device/env.sh
source benchmarks/device/detach.sh
name=replicas
DETACH_DIR=/tmp/$name
if [ "${1:-}" = start ]; then
  # the device image has no nginx: carry this machine's (benchmarks/device/carry-nginx.sh), used from the run's copy
  [ -x .devtools/nginx/nginx ] && export PATH="$DETACH_DIR/src/.devtools/nginx:$PATH"
  command -v nginx >/dev/null || [ -x .devtools/nginx/nginx ] || { echo "no nginx: carry .devtools/nginx"; exit 4; }
  gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  if [ -z "${REPLICAS:-}" ] && [ "${gib:-0}" -lt 100000 ]; then REPLICAS=1,2; fi
  detach_start "$name" python3 -m benchmarks.replicas --device gpu --config "$PWD/${CONFIG:-configs/gemma4-e2b-h200-decode.yaml}" \
    --replicas "${REPLICAS:-1,2,3,4}" --concurrency "${CONCURRENCY:-256,512}" --repeats "${REPEATS:-3}" \
    --clients "${CLIENTS:-vllm-bench,loadtest}" --loadtest-workers "${WORKERS:-8}" --kv-cache-gib "${KV_GIB:-8}" \
    --label "$card, vLLM 0.26.0, Gemma 4 E2B dummy weights + synthetic byte-level tokenizer, text prompts" \
    --workdir "$DETACH_DIR/work" --deadline-s "${RUN_S:-1250}" --out "$DETACH_DIR/replicas.jsonl" \
    --doc "$DETACH_DIR/replicas.json" ${MPS:+--mps} ${SET:+--set "$SET"} ${FILL:+--fill-first "$FILL"}
fi
detach_wait "$name"
cp "$DETACH_DIR"/replicas.json* "$DETACH_DIR/run.log" "$OUT/" 2>/dev/null
mv "$OUT/run.log" "$OUT/replicas.log" 2>/dev/null
tar czf "$OUT/replicas-work.tar.gz" -C "$DETACH_DIR" --exclude=src --exclude=raw --exclude=gemma-4-e2b-synth \
  --exclude='*-run' --exclude='*-tmp' --exclude=vllm-cache . 2>/dev/null
grep -E "ready in|rep [0-9]|stopped|Error|error|Traceback|Goal|meets|misses" "$DETACH_DIR/run.log" | cut -c1-300 | tail -45
echo "replicas ${1:-wait} done after $(( SECONDS - t0 ))s"
