#!/usr/bin/env bash
# For the next session, written in session 13 (not yet run): the bounded core's kernel profile
# at C = 32 with session 13's scan (B=1, T=8192; CUPTI lists every kernel of the chunk_kda step;
# session 14 has the unbounded one), then the B=4 cases of the core against FLA twice in one
# job (FLA's time moved by 11% between two jobs).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job15a.sh          (~330 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
for gate in bounded; do
  run "$base" "kernels_$gate" 150 python3 benchmarks/stage_profile.py --kernels --skip-core \
    --chunk 32 --gates "$gate" --configs none --scan-configs none --out "$OUT/kernels_$gate.json"
  pack
done
for rep in 1 2; do
  run "$base" "b4_$rep" 80 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
    --shapes 4x4096 --gates bounded --out "$OUT/b4_$rep.json"
  pack
done
grep -hE "busy|kda_|^prefill_core" "$OUT"/kernels_*.log "$OUT"/b4_*.log | cut -c1-170
