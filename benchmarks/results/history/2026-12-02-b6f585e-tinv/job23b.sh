#!/usr/bin/env bash
# Session 18, with diag_tinv the default: the whole-block prefill at the final kernels (its last
# figures were session 13's), the unbounded core at C = 64 beside C = 32 at B=1 T=8192 (C = 32
# was chosen in session 13, before the diagonal kernel took G, the norms and T), in one job.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job23b.sh          (~320 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" block 160 python3 benchmarks/bench_prefill.py --quick --block-only \
  --out "$OUT/block.json"
pack
run "$base" core_c64 150 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32,64 \
  --shapes 1x8192 --gates unbounded --out "$OUT/core_c64.json"
pack
grep -hE "^prefill_" "$OUT"/block.log "$OUT"/core_c64.log | cut -c1-200
