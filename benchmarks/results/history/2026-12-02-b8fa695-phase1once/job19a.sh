#!/usr/bin/env bash
# Session 16, job 2: chunk_prepare's phase 1 computing the gate and its cumsum once (G stored,
# fenced, read back; Triton had recomputed the whole gate + scan chain in a second layout),
# compiled tests, then the prepare stage of both gates beside the previous phase 1
# (phase1_old.patch) in the same job, and the new kernels' list.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job19a.sh          (~480 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none"
run "$base" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
old=$(tree phase1_old)
run "$base" new 190 $SP --kernels --out "$OUT/new.json" --configs default,num_stages=1
pack
run "$old" old 110 $SP --out "$OUT/old.json" --configs default
pack
grep -hE "busy|kda_chunk|^chunk_" "$OUT"/{new,old}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
