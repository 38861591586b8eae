#!/usr/bin/env bash
# The next GPU session's first job (repo root on the device machine; results in $OUT): where
# chunk_prepare's time goes, by leaving phases out, and two candidate precisions of its T phase.
# Each patch of benchmarks/wip/ is applied to a copy of this tree; every tree's prepare stage is
# timed by stage_profile.py in its own process, the same way, in one job (~6 min). The
# leave_out_* trees compute wrong outputs: they are for timing only, never tested or kept.
#   bash benchmarks/wip/next_gpu_job.sh stages   # base + 5 patched trees, both gates
#   bash benchmarks/wip/next_gpu_job.sh tests    # compiled test_chunk.py in the inverse_* trees
set -uo pipefail
what=${1:?stages or tests}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
base=$PWD
tree() {  # tree NAME: a copy of this tree with benchmarks/wip/NAME.patch applied; prints its path
  local dir=/tmp/tree_$1
  rm -rf "$dir"; cp -r "$base" "$dir"
  (cd "$dir" && patch -s -p1 < "benchmarks/wip/$1.patch") || return 1
  echo "$dir"
}
run() {  # run DIR LABEL SECONDS CMD...: one step in a tree, with its own time limit
  local dir=$1 label=$2 limit=$3; shift 3
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$OUT/$label.log" 2>&1
  echo "$label: rc=$? $(tail -n 1 "$OUT/$label.log")"
}
if [ "$what" = stages ]; then
  run "$base" base 90 python3 benchmarks/stage_profile.py --kernels --scan-configs none \
    --out "$OUT/base.json"
  for p in leave_out_inverse leave_out_scores leave_out_norms inverse_bf16x6 inverse_tf32x3; do
    dir=$(tree "$p") || { echo "$p: does not apply"; continue; }
    run "$dir" "$p" 60 python3 benchmarks/stage_profile.py --scan-configs none \
      --out "$OUT/$p.json"
  done
  grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/*.log
else
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE tests/test_chunk.py"
  for p in inverse_bf16x6 inverse_tf32x3; do
    dir=$(tree "$p") || { echo "$p: does not apply"; continue; }
    run "$dir" "tests_$p" 200 $T
  done
fi
