#!/usr/bin/env bash
# Session 14, job 1: the row-walk diagonal kernel (unbounded gate). test_chunk.py compiled, the
# core's kernel list and the prepare stage at diag_warps 1/2/4, the old kernel (olddiag.patch)
# in the same job, then the unbounded core against FLA 0.6.0 at B=1 T=8192.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job16a.sh          (~540 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
old=$(tree olddiag)
run "$base" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" diag_new 170 python3 benchmarks/stage_profile.py --kernels --skip-core --chunk 32 \
  --gates unbounded --configs default,diag_warps=2,diag_warps=4 --scan-configs none \
  --out "$OUT/diag_new.json"
pack
run "$old" diag_old 60 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --gates unbounded --configs default --scan-configs none --out "$OUT/diag_old.json"
pack
run "$base" core_unb 80 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192 --gates unbounded --out "$OUT/core_unb.json"
pack
grep -hE "busy|kda_|^prefill_|^chunk_" "$OUT"/diag_*.log "$OUT"/core_unb.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
