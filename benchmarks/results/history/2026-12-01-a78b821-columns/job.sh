#!/usr/bin/env bash
# This session's GPU jobs (run from the repo root on the device machine; results in $OUT):
# the column-block chunk_prepare (design="columns", one kernel) and the row-loop diagonal kernel
# of this tree against the tree of the last commit before them (.gpu/base.tar, `git archive`),
# in one job, with their compiled tests.
#   bash benchmarks/wip/next_gpu_job.sh tests    # compiled test_chunk + test_forward_pallas, base stages
#   bash benchmarks/wip/next_gpu_job.sh stages   # this tree's stages over block sizes
set -uo pipefail
what=${1:?tests or stages}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
tree=$PWD; base=/tmp/base_tree
rm -rf "$base"; mkdir -p "$base"; tar -xf .gpu/base.tar -C "$base" || exit 1
run() {  # run DIR LABEL SECONDS CMD...: one step in a tree, with its own time limit
  local dir=$1 label=$2 limit=$3; shift 3
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$OUT/$label.log" 2>&1
  echo "$label: rc=$? $(tail -n 1 "$OUT/$label.log")"
}
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
if [ "$what" = tests ]; then
  run "$tree" tests_chunk 220 $T tests/test_chunk.py
  run "$tree" tests_forward 100 $T tests/test_forward_pallas.py -k prefill
  run "$base" stages_base 200 python3 benchmarks/stage_profile.py --kernels \
    --scan-configs none --out "$OUT/stages_base.json"
else
  run "$tree" stages 540 python3 benchmarks/stage_profile.py --kernels --scan-configs none \
    --configs default,num_stages=2,num_warps=8,num_warps=8+num_stages=2,diag_warps=2,design=slices \
    --out "$OUT/stages.json"
fi
grep -hE "^(chunk|ours|FLA un)|kda_|x .*us" "$OUT"/stages*.log 2>/dev/null | head -60
