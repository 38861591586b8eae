#!/usr/bin/env bash
# Session 18, after job22a.sh (diag_tinv alone was the fastest unbounded prepare stage: 704.1
# against 755.6 us committed; exp2 slower on both gates): the diag_tinv tree's core against FLA
# 0.6.0 at all six cases in one process, then its compiled test_chunk.py and
# test_forward_pallas.py (core first: it is the step that must come back).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job23a.sh          (~590 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x"
dir=$(tree diag_tinv)
run "$dir" core 360 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --out "$OUT/core.json"
pack
run "$dir" tests_chunk 130 $T tests/test_chunk.py -k on_gpu
pack
run "$dir" tests_fwd 95 $T tests/test_forward_pallas.py
pack
grep -hE "^prefill_core" "$OUT"/core.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_{chunk,fwd}.log | cut -c1-200
