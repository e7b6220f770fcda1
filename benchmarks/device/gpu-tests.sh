#!/bin/bash
# tests/gpu on one H200, as one `run` call from the repository root on the device machine:
#   run(command="PROFILES=prefill bash benchmarks/device/gpu-tests.sh", carry=[".gpu/install.sh", ".gpu/pN"])
# (the call with the last staged part, or a later call on the same warm machine). One profile per
# call fits the 600 s limit with a cold compile (~3-4 min per engine start on a fresh machine).
# PROFILES=replicas (tests/gpu/test_replicas_gpu.py: two engines, one after the other, and a rolling
# reload of both) needs nginx, which the device lacks: carry .devtools/nginx
# (benchmarks/device/carry-nginx.sh), and run it after another engine warmed the compile cache.
# Output under $OUT (a call returns at most 8 files, so logs travel packed):
#   gpu-tests-<profiles>.txt     pytest's report (-rA: every test's outcome, the summary line)
#   gpu-tests-<profiles>.tar.gz  every gateway log and profile pytest wrote (its basetemp; not the
#                                synthetic tokenizer, 5 MB a copy)
#   gpu.lock                     the installed closure of the gpu extra + vllm (requirements/freeze.py)
# Knobs: PROFILES (prefill,decode -> pytest -k), PYTEST_ARGS.
set -uo pipefail
source benchmarks/device/env.sh
profiles=${PROFILES:-prefill,decode}
[ -x .devtools/nginx/nginx ] && export PATH="$PWD/.devtools/nginx:$PATH"
tag=${profiles//,/-}
base=/tmp/gpu-tests-$tag; rm -rf "$base"
python3 requirements/freeze.py --extra gpu --also vllm > "$OUT/gpu.lock" 2>&1
timeout $(( deadline > 60 ? deadline : 60 )) python3 -m pytest tests/gpu -v -rA -p no:cacheprovider \
  --basetemp="$base" -k "[${profiles//,/] or [}]" ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu-tests-$tag.txt"
rc=${PIPESTATUS[0]}
tar czf "$OUT/gpu-tests-$tag.tar.gz" --exclude=model -C /tmp "$(basename "$base")" 2>/dev/null
echo "gpu-tests ($profiles) exit $rc after $(( SECONDS - t0 ))s"
exit "$rc"
