#!/usr/bin/env bash
# Session 14, job 4: the kept diagonal kernel (row walk, loads one row ahead, 2 warps; job 3's
# halving measured slower): test_chunk.py compiled, the core's kernel list at the default
# beside the stage at diag_warps=1 (unbounded gate, B=1 T=8192, C = 32).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job16d.sh          (~300 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" tests_chunk 200 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" kept 110 python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded \
  --scan-configs none --kernels --configs default,diag_warps=1 --out "$OUT/kept.json"
pack
grep -hE "busy|kda_chunk|^chunk_" "$OUT"/kept.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
