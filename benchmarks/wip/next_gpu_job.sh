#!/usr/bin/env bash
# The next GPU session's first jobs: benchmarks/wip/prepare_latency.patch and diag_rows.patch
# (both applied) timed against the tree they apply to, in one job, and their compiled tests (run
# from the repo root on the device machine; results in $OUT). The kernel lists (--kernels) give
# each patched kernel's time apart: kda_chunk_prepare for the first, kda_chunk_diag for the
# second (unbounded gate only).
#   bash benchmarks/wip/next_gpu_job.sh stages   # ~6 min: base and patched, bounded + unbounded
#   bash benchmarks/wip/next_gpu_job.sh tests    # ~5 min: compiled tests, base and patched
set -uo pipefail
what=${1:?stages or tests}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
base=$PWD; wip=/tmp/wip_tree
rm -rf "$wip"; cp -r "$base" "$wip"
(cd "$wip" && git apply benchmarks/wip/prepare_latency.patch \
  && git apply benchmarks/wip/diag_rows.patch) || exit 1
run() {  # run DIR LABEL SECONDS CMD...: one step in a tree, with its own time limit
  local dir=$1 label=$2 limit=$3; shift 3
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$OUT/$label.log" 2>&1
  echo "$label: rc=$? $(tail -n 1 "$OUT/$label.log")"
}
if [ "$what" = stages ]; then
  run "$base" stages_base 150 python3 benchmarks/stage_profile.py --kernels \
    --scan-configs none --out "$OUT/stages_base.json"
  run "$wip" stages_wip 330 python3 benchmarks/stage_profile.py --kernels --scan-configs none \
    --configs default,num_stages=2,wu_block_k=32+wu_stages=2 --out "$OUT/stages_wip.json"
else  # the patched tree's chunk tests, and the base tree's changes since its last compiled run
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
  run "$base" tests_base 300 $T tests/test_conv.py tests/test_recurrent.py \
    tests/test_forward_pallas.py
  run "$wip" tests_wip 240 $T tests/test_chunk.py
fi
