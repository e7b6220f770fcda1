#!/bin/bash
# tests/gpu on one H200, from the repository root on the device machine, in the call with the last
# staged part of the vLLM bundle or a later call on the same warm machine:
#   run(command="PROFILES=prefill bash benchmarks/device/gpu-tests.sh", carry=[".gpu/install.sh", ".gpu/pN"])
# One profile per call fits the 600 s limit with a cold compile (~3-4 min per engine start on a fresh
# machine). A run that may not (PROFILES=replicas on a fresh machine: two engine starts, then a rolling
# reload of both) can outlive the call: `... gpu-tests.sh start` starts it in its own session and waits
# like `wait`; `... gpu-tests.sh wait` in later calls waits until it ends or the call's deadline, then
# packs what it has (the machine must stay warm between the calls: issue them back to back).
# PROFILES=replicas (tests/gpu/test_replicas_gpu.py) needs nginx, which the device lacks: carry
# .devtools/nginx (benchmarks/device/carry-nginx.sh).
# Output under $OUT (a call returns at most 8 files, so logs travel packed):
#   gpu-tests-<profiles>.txt     pytest's report (-rA: every test's outcome, the summary line)
#   gpu-tests-<profiles>.tar.gz  every gateway log and profile pytest wrote (its basetemp; not the
#                                synthetic tokenizer, 5 MB a copy)
#   gpu.lock                     the installed closure of the gpu extra + vllm (requirements/freeze.py)
# Knobs: PROFILES (prefill,decode -> pytest -k; also replicas (the profile: CUDA MPS on), replicas-no-mps), PYTEST_ARGS, RUN_S (a detached run's own limit, 1500).
set -uo pipefail
source benchmarks/device/env.sh
profiles=${PROFILES:-prefill,decode}
tag=${profiles//,/-}
base=/tmp/gpu-tests-$tag
args=(tests/gpu -v -rA -p no:cacheprovider --basetemp="$base" -k "[${profiles//,/] or [}]" ${PYTEST_ARGS:-})
pack() {
  tar czf "$OUT/gpu-tests-$tag.tar.gz" --exclude=model -C /tmp "$(basename "$base")" 2>/dev/null
}
# a detached run works in its own copy of the tree (detach.sh): nginx from there
tree=$PWD; [ "${1:-}" = start ] && tree=/tmp/gpu-tests-run-$tag/src
[ -x .devtools/nginx/nginx ] && export PATH="$tree/.devtools/nginx:$PATH"
if [ "${1:-}" != wait ]; then
  rm -rf "$base"
  python3 requirements/freeze.py --extra gpu --also vllm > "$OUT/gpu.lock" 2>&1
fi
case "${1:-}" in
  start|wait)
    source benchmarks/device/detach.sh
    [ "$1" = start ] && detach_start "gpu-tests-run-$tag" timeout "${RUN_S:-1500}" python3 -m pytest "${args[@]}"
    detach_wait "gpu-tests-run-$tag"
    cp "$DETACH_DIR/run.log" "$OUT/gpu-tests-$tag.txt" 2>/dev/null
    pack
    tail -40 "$OUT/gpu-tests-$tag.txt"
    rc=$(cat "$DETACH_DIR/rc" 2>/dev/null || echo 0)
    echo "gpu-tests ($profiles) ${1} done after $(( SECONDS - t0 ))s"
    exit "$rc" ;;
esac
timeout $(( deadline > 60 ? deadline : 60 )) python3 -m pytest "${args[@]}" 2>&1 | tee "$OUT/gpu-tests-$tag.txt"
rc=${PIPESTATUS[0]}
pack
echo "gpu-tests ($profiles) exit $rc after $(( SECONDS - t0 ))s"
exit "$rc"
