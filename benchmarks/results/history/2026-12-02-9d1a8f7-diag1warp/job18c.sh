#!/usr/bin/env bash
# For the next session (written in session 15, not run: no machine free): the running-product
# diagonal kernel at 1 warp (set PrepareBlockSizes.diag_warps to 1 first): compiled tests,
# the core's kernel list and the stage beside 2 warps (unbounded gate, B=1 T=8192, C = 32),
# then the core against FLA at B=1 T=8192, B=4 T=4096 and B=1 T=32768, both gates, in one
# process (records are written case by case: a cut run keeps the finished ones).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job18c.sh          (~530 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded --scan-configs none"
run "$base" tests_chunk 140 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" kept 60 $SP --kernels --out "$OUT/kept.json" --configs default,diag_warps=2
pack
run "$base" core 330 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --out "$OUT/core.json"
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_" "$OUT"/{kept,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
