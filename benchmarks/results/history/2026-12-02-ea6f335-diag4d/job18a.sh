#!/usr/bin/env bash
# Session 15, job 1: the diagonal kernel as one pass over K slices with every pair at once
# ([block_k, 2, 8, 8] tiles, K inside each thread), compiled tests, its knobs beside the
# session 14 row walk (diag_rowwalk.patch) in the same job: the chunk_prepare stage alone and the
# core's kernel list (unbounded gate, B=1 T=8192, C = 32).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job18a.sh          (~450 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded --scan-configs none"
run "$base" tests_chunk 170 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" new 150 $SP --kernels --out "$OUT/new.json" --configs \
  default,diag_block_k=8,diag_block_k=8+diag_warps=2,diag_block_k=16+diag_warps=2,diag_block_k=32+diag_warps=8,diag_block_k=16+diag_warps=8
pack
old=$(tree diag_rowwalk) && run "$old" old 90 $SP --kernels --configs default --out "$OUT/old.json"
pack
grep -hE "busy|kda_chunk|^chunk_" "$OUT"/new.log "$OUT"/old.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
