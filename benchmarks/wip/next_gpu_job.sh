#!/usr/bin/env bash
# The next GPU session's jobs (repo root on the device machine; results in $OUT). Written in
# session 6 after its GPU time was spent; CPU-checked only (benchmarks/wip/README.md).
#   bash benchmarks/wip/next_gpu_job.sh stages   # prepare stage: this tree against score_rows.patch,
#                                                # both gates (~2 min)
#   bash benchmarks/wip/next_gpu_job.sh tests    # compiled test_chunk.py in the patched tree, then
#                                                # its core against FLA (~8 min)
#   bash benchmarks/wip/next_gpu_job.sh rest     # compiled test_gemv, test_gate, test_o_norm (~3 min)
# The device returns 8 files at most: everything is also packed into $OUT/all.tgz.
set -uo pipefail
what=${1:?stages, tests or rest}
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
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
if [ "$what" = stages ]; then
  stage="python3 benchmarks/stage_profile.py --skip-core --scan-configs none"
  dir=$(tree score_rows) || { echo "score_rows: does not apply"; exit 1; }
  run "$base" base 150 $stage --kernels --out "$OUT/base.json"
  run "$dir" score_rows 150 $stage --kernels --out "$OUT/score_rows.json"
  run "$base" base_again 100 $stage --out "$OUT/base_again.json"
  grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/*.log
elif [ "$what" = tests ]; then
  dir=$(tree score_rows) || { echo "score_rows: does not apply"; exit 1; }
  run "$dir" tests_chunk 200 $T tests/test_chunk.py
  run "$dir" bench_prefill 300 python3 benchmarks/bench_prefill.py --quick --core-only \
    --out "$OUT/bench_prefill_core.json"
  grep -hE "^prefill_core|passed|failed" "$OUT"/*.log | cut -c1-200
else
  run "$base" tests_rest 200 $T tests/test_gemv.py tests/test_gate.py tests/test_o_norm.py
  grep -hE "passed|failed" "$OUT"/*.log
fi
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
