# Sourced by the scripts in benchmarks/device/ (from the repository root on the device machine): installs the
# staged vLLM bundle if this call carries its last part, checks the packages the gateway needs,
# sets the environment, and computes $deadline (seconds left for the driver in this call).
t0=$SECONDS
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f .gpu/install.sh ]; then bash .gpu/install.sh 2>&1 | tail -3; fi
[ -f /tmp/site/.installed ] || { echo "vLLM bundle not installed yet (carry the remaining .gpu parts first)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD VLLM_CACHE_ROOT=/tmp/vllm-cache PYTHONUNBUFFERED=1
# One synthetic Gemma directory for every tool: vLLM's compile cache is keyed by the model path.
export GPU_MODEL_DIR=/tmp/gemma-4-e2b
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
# Load, GPU utilisation, SM clock, power, temperature and memory every 2 s while the call runs: the
# 2026-12-02 interleaved run drifted by 1.8x between repeats of one cell, with nothing to say why.
( echo "time,loadavg_1m,gpu_util_pct,sm_clock_mhz,power_w,temp_c,mem_used_mib"
  while :; do
    echo "$(date +%T),$(cut -d' ' -f1 /proc/loadavg),$(nvidia-smi --query-gpu=utilization.gpu,clocks.sm,power.draw,temperature.gpu,memory.used --format=csv,noheader,nounits 2>&1 | head -1)"
    sleep 2
  done ) > "$OUT/machine-samples.csv" 2>&1 &
machine_sampler=$!
trap 'kill "$machine_sampler" 2>/dev/null' EXIT
python3 -c "import vllm, torch, fastapi, uvicorn, pydantic_settings, httpx, yaml, prometheus_client, psutil, tokenizers; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
  || { echo "missing packages on the device"; exit 3; }
limit=${CALL_LIMIT_S:-600}
deadline=$(( limit - 35 - (SECONDS - t0) ))
echo "deadline ${deadline}s"
