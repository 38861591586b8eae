#!/usr/bin/env bash
# The next GPU session's first job (repo root on the device machine; results in $OUT): where
# chunk_prepare's time goes, by leaving phases out, and two candidate precisions of its T phase.
# Each patch of benchmarks/wip/ is applied to a copy of this tree; every tree's prepare stage is
# timed by stage_profile.py in its own process, the same way, in one job (~6 min). The
# leave_out_* trees compute wrong outputs: they are for timing only, never tested or kept.
#   bash benchmarks/wip/next_gpu_job.sh stages   # base + 4 patched trees, bounded gate
#   bash benchmarks/wip/next_gpu_job.sh tests    # compiled test_chunk.py in the inverse_* trees
#   bash benchmarks/wip/next_gpu_job.sh final    # this tree: compiled decode tests, bench_decode,
#                                                # the whole-block prefill, the decode profile
#   bash benchmarks/wip/next_gpu_job.sh knobs    # prepare block-size knobs, compiled test_conv
set -uo pipefail
what=${1:?stages, tests, final or knobs}
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
  # The prepare stage alone (--skip-core: no chunk_kda or FLA timing, whose autotuning took
  # the first try's 60-90 s limits), bounded gate, the base first and again last (its spread).
  stage="python3 benchmarks/stage_profile.py --skip-core --gates bounded --scan-configs none"
  run "$base" base 240 $stage --kernels --out "$OUT/base.json"
  for p in leave_out_inverse leave_out_scores leave_out_norms inverse_bf16x6; do
    dir=$(tree "$p") || { echo "$p: does not apply"; continue; }
    run "$dir" "$p" 150 $stage --out "$OUT/$p.json"
  done
  run "$base" base_again 150 $stage --out "$OUT/base_again.json"
  grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/*.log
elif [ "$what" = final ]; then
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
  run "$base" tests_decode 170 $T tests/test_recurrent.py tests/test_forward_pallas.py
  run "$base" bench_decode 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
  run "$base" bench_prefill 200 python3 benchmarks/bench_prefill.py --quick --block-only \
    --out "$OUT/bench_prefill_block.json"
  run "$base" profile 60 python3 benchmarks/decode_profile.py --cases decode:1,decode:64,decode_k:8 \
    --out "$OUT/profile.json"
  grep -hE "^(decode|prefill|core)|passed|failed" "$OUT"/*.log | cut -c1-220
elif [ "$what" = knobs ]; then
  run "$base" knobs 200 python3 benchmarks/stage_profile.py --skip-core --gates bounded \
    --scan-configs none --out "$OUT/knobs.json" --configs \
    default,block_k=32,num_stages=3,wu_stages=2,wu_warps=8,wu_block_k=128,num_stages=3+wu_stages=2
  run "$base" tests_conv 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE \
    tests/test_conv.py
  grep -hE "^chunk_prepare|passed|failed" "$OUT"/*.log
else
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE tests/test_chunk.py"
  for p in inverse_bf16x6 inverse_tf32x3; do
    dir=$(tree "$p") || { echo "$p: does not apply"; continue; }
    run "$dir" "tests_$p" 200 $T
  done
fi
