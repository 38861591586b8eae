#!/usr/bin/env bash
# Session 14, job 2: job 1 put the row-walk diagonal kernel at the old one's time (424.9 us at
# B=1 T=8192), so its rows' loads now go one row ahead. Timed here: that kernel at diag_warps 1
# and 2, the loops unrolled (diag_unroll.patch), the old kernel (olddiag.patch), each in the
# core's kernel list; then the unbounded core against FLA 0.6.0 at B=1 T=8192.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job16b.sh          (~480 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
P="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded --scan-configs none"
old=$(tree olddiag)
unroll=$(tree diag_unroll)
run "$base" pre 150 $P --kernels --configs default,diag_warps=2 --out "$OUT/pre.json"
pack
run "$unroll" unroll 90 $P --kernels --configs default --out "$OUT/unroll.json"
pack
run "$old" old 90 $P --kernels --configs default --out "$OUT/old.json"
pack
run "$base" core_unb 150 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192 --gates unbounded --out "$OUT/core_unb.json"
pack
grep -hE "busy|kda_chunk_diag|^prefill_|^chunk_" "$OUT"/pre.log "$OUT"/unroll.log \
  "$OUT"/old.log "$OUT"/core_unb.log | cut -c1-190
