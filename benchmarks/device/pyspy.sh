#!/bin/bash
# Issue 14, goal 3: py-spy on the gateway process at c = 256 on one H200 (benchmarks/experiments/pyspy_gateway.py).
# Run from the repository root on the device machine, as one `run` call on a machine that already
# has the vLLM bundle installed (a call that carried the .gpu parts, e.g. http-ways.sh, came first):
#   run(command="bash benchmarks/device/pyspy.sh", carry=[".gpu/py-spy"])
# or, on a fresh machine, with the bundle's parts as well: carry=[".gpu/install.sh", ".gpu/pN", ".gpu/py-spy"].
# The device has no network: py-spy comes from the wheel in .gpu/py-spy (fetched here with
#   pip download py-spy --only-binary=:all: --platform manylinux2014_x86_64 --python-version 312 -d .gpu/py-spy);
# its binary is unpacked from the wheel, no pip needed.
# Prefill profile (configs/gemma4-e2b-h200.yaml) with the synthetic model, token-id prompts 512 in / 256 out,
# c = 256 from 4 loadtest processes for ~60 s (15 s warm-up and settle, 25 s recording at 100 Hz, dump).
# Duration: ~150 s warm (engine ~60-90 s, load ~60 s, stop), ~330 s on a fresh machine (cold compile).
# Under $OUT: pyspy-summary.txt (notes + top functions + module groups), pyspy.jsonl (the loadtest's
# result line, profiled), pyspy.log (driver output), pyspy-work.tar.gz (collapsed stacks, speedscope file,
# dump, profile, gateway and loadtest logs). If py-spy cannot attach (ptrace), it retries with --nonblocking
# and the summary says what failed; the loadtest result is still written.
# Knobs: CONCURRENCY (256), INPUT_TOKENS (512), OUTPUT_TOKENS (256), WORKERS (4), RECORD_S (25), SETTLE_S (15),
# RATE (100), CALL_LIMIT_S (600), EXTRA (more pyspy_gateway flags).
# DEVICE=cpu: a tiny run here with the embedded model (no env.sh; .venv's python, py-spy from
# PY_SPY or .gpu/py-spy), to check the script end to end.
set -uo pipefail
t0=$SECONDS
if [ "${DEVICE:-gpu}" = cpu ]; then
  OUT=${OUT:-/tmp/pyspy-out}; mkdir -p "$OUT"
  py=.venv/bin/python
  deadline=$(( ${CALL_LIMIT_S:-600} - 35 ))
  defaults=(--device cpu --concurrency "${CONCURRENCY:-4}" --input-tokens "${INPUT_TOKENS:-32}"
            --output-tokens "${OUTPUT_TOKENS:-64}" --loadtest-workers "${WORKERS:-1}"
            --settle-s "${SETTLE_S:-6}" --record-s "${RECORD_S:-6}")
else
  source benchmarks/device/env.sh  # OUT, PYTHONPATH, GPU_MODEL_DIR, $deadline; exits if vLLM is missing
  py=python3
  defaults=(--device gpu --concurrency "${CONCURRENCY:-256}" --input-tokens "${INPUT_TOKENS:-512}"
            --output-tokens "${OUTPUT_TOKENS:-256}" --loadtest-workers "${WORKERS:-4}"
            --settle-s "${SETTLE_S:-15}" --record-s "${RECORD_S:-25}")
fi
work=/tmp/pyspy-work; rm -rf "$work"; mkdir -p "$work/out"  # a second call on the machine starts clean
# py-spy: an explicit PY_SPY, else the binary inside the carried wheel (a zip), else one on PATH
spy=${PY_SPY:-}
if [ -z "$spy" ]; then
  whl=$(ls .gpu/py-spy/py_spy-*manylinux*x86_64*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    "$py" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [m for m in z.namelist() if m.endswith('/scripts/py-spy')][0]; open('/tmp/py-spy-bin', 'wb').write(z.read(n))" "$whl" \
      && chmod +x /tmp/py-spy-bin && spy=/tmp/py-spy-bin
  fi
fi
spy=${spy:-$(command -v py-spy || echo py-spy)}
echo "py-spy: $spy ($("$spy" --version 2>&1 | head -1))"
"$py" -m benchmarks.experiments.pyspy_gateway "${defaults[@]}" --rate "${RATE:-100}" --py-spy "$spy" \
  --deadline-s "$deadline" --out-dir "$work/out" --workdir "$work" \
  --label "${DEVICE:-gpu} py-spy of the gateway, prefill profile, token-id prompts" ${EXTRA:-} 2>&1 | tee "$OUT/pyspy.log"
cp "$work/out/summary.txt" "$OUT/pyspy-summary.txt" 2>/dev/null
cp "$work/out/pyspy.jsonl" "$OUT/pyspy.jsonl" 2>/dev/null
# One archive: a call returns at most 8 files.
tar czf "$OUT/pyspy-work.tar.gz" --exclude=gemma-4-e2b-synth --exclude='*.csv' --exclude='vllm-cache' \
  --exclude='*-run' --exclude='*-tmp' -C "$(dirname "$work")" "$(basename "$work")" 2>/dev/null
echo "pyspy done after $(( SECONDS - t0 ))s"
