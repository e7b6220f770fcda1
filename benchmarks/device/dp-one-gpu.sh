#!/bin/bash
# Issue 36, experiment 1 (docs/design/replicas.md): does vLLM's own data parallelism place two engine
# cores on one GPU (CUDA_VISIBLE_DEVICES=0,0), and what does `vllm serve` give that way against one
# engine, by vLLM's own client, c = 256 and 512, 512 in / 256 out.
#   run(command="DP=2 bash benchmarks/device/dp-one-gpu.sh")    then DP=1 for the one-engine anchor
# Knobs: DEVICES (CUDA_VISIBLE_DEVICES: "0" repeated DP times), DP (2), MEM (0.42: each engine's share), CONC ("256 512"), PROMPTS_PER_C (4: prompts = C x it)
set -uo pipefail
source benchmarks/device/env.sh
dp=${DP:-2}; mem=${MEM:-0.42}; port=$((8200 + dp))
python3 -m benchmarks.fixtures.synth_tokenizer "$GPU_MODEL_DIR" > /dev/null
devices=${DEVICES:-$(python3 -c "print(','.join(['0'] * $dp))")}
log=$OUT/dp$dp-serve.log
echo "==> vllm serve, data parallel $dp on CUDA_VISIBLE_DEVICES=$devices, $mem each"
CUDA_VISIBLE_DEVICES=$devices setsid nohup python3 benchmarks/vllm_cli.py serve "$GPU_MODEL_DIR" \
  --served-model-name gemma --load-format dummy --data-parallel-size "$dp" --gpu-memory-utilization "$mem" \
  --max-model-len 32768 --max-num-seqs 1024 --max-num-batched-tokens 8192 --seed 0 --port "$port" \
  > "$log" 2>&1 < /dev/null &
pid=$!
up=0
while [ $(( SECONDS - t0 )) -lt $(( deadline - 100 )) ]; do
  if curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; then up=1; break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 3
done
echo "==> up=$up after $(( SECONDS - t0 )) s"
if [ $up = 1 ]; then
  for c in ${CONC:-256 512}; do
    n=$(( c * ${PROMPTS_PER_C:-4} ))
    [ $(( SECONDS - t0 )) -lt $(( deadline - 60 )) ] || { echo "deadline before c=$c"; break; }
    python3 benchmarks/vllm_cli.py bench serve --backend vllm --base-url "http://127.0.0.1:$port" \
      --endpoint /v1/completions --model gemma --tokenizer "$GPU_MODEL_DIR" --dataset-name random \
      --random-input-len 512 --random-output-len 256 --num-prompts "$n" --max-concurrency "$c" --ignore-eos \
      --save-result --result-dir "$OUT" --result-filename "dp$dp-c$c.json" 2>&1 \
      | grep -E "Output token throughput|Median TTFT|Median TPOT|Failed|Successful"
  done
fi
kill -- -$pid 2>/dev/null; sleep 5; kill -9 -- -$pid 2>/dev/null
grep -E "Error|error|device|CUDA_VISIBLE|DP rank|data.parallel|KV cache|Available" "$log" | cut -c1-250 | head -30
echo "dp$dp done after $(( SECONDS - t0 ))s"
