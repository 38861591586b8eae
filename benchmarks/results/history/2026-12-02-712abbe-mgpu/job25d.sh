#!/usr/bin/env bash
# Session 19, job 4: compiled tests after job 3's fix (mgpu_fits: D and part widths that Mosaic
# GPU's swizzled TMA copies accept), on this tree (block_k 64 for the pairwise prepare kernel
# applied too: its test_chunk.py passed compiled in job 2).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job25d.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" tests_gemv 140 $T tests/test_gemv_mgpu.py tests/test_gemv.py
pack
run "$base" tests_fwd 120 $T tests/test_forward_pallas.py
pack
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-200
