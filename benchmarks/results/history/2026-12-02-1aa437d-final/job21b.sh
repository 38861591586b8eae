#!/usr/bin/env bash
# Session 17's records at the final default (f07fcbb: G and the norms from the diagonal kernel,
# unbounded gate): the core against FLA at all six cases in one process, then a knob sweep of
# the unbounded stage at B=1 T=8192 (leads for the next session, not defaults: a changed knob
# needs its own compiled run).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job21b.sh          (~380 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" core 360 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --out "$OUT/core.json"
pack
run "$base" sweep 110 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --scan-configs none --gates unbounded --out "$OUT/sweep.json" \
  --configs default,num_stages=2,block_k=64,diag_warps=2,num_warps=2
pack
grep -hE "^chunk_|^prefill_core" "$OUT"/{core,sweep}.log | cut -c1-190
