#!/usr/bin/env bash
# The next GPU session's first job: each wip patch timed against the tree it applies to, in one
# job, and its compiled tests (run from the repo root on the device machine; results in $OUT).
#   bash benchmarks/wip/next_gpu_job.sh prefill|decode
set -uo pipefail
what=${1:?prefill or decode}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
base=$PWD; wip=/tmp/wip_tree
rm -rf "$wip"; cp -r "$base" "$wip"
run() {  # run DIR LABEL CMD...: one step in a tree, with its own time limit
  local dir=$1 label=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 300 "$@") > "$OUT/$label.log" 2>&1
  echo "$label: rc=$? $(tail -n 1 "$OUT/$label.log")"
}
if [ "$what" = prefill ]; then
  (cd "$wip" && git apply benchmarks/wip/prefill_both.patch) || exit 1
  run "$base" stages_base python3 benchmarks/stage_profile.py --configs 16x4 \
    --scan-configs 32x4x2 --out "$OUT/stages_base.json"
  run "$wip" stages_wip python3 benchmarks/stage_profile.py --configs 16x4,16x4x4 \
    --scan-configs 32x4x2+split,16x4x2,16x4x2+split,16x4x3+split --out "$OUT/stages_wip.json"
  run "$wip" tests_wip python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE \
    tests/test_chunk.py
else
  (cd "$wip" && git apply benchmarks/wip/onorm_in_oproj.patch) || exit 1
  run "$base" profile_base python3 benchmarks/decode_profile.py --out "$OUT/profile_base.json"
  run "$wip" profile_wip python3 benchmarks/decode_profile.py --out "$OUT/profile_wip.json"
  run "$wip" tests_wip python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE \
    tests/test_gemv.py tests/test_forward_pallas.py
fi
