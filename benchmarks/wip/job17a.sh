#!/usr/bin/env bash
# For the next session, written in session 14 (not yet run): the core against FLA 0.6.0
# chunk_kda at the kept diagonal kernel (9bcf746 or later), both gates, B=1 T=8192 and B=4
# T=4096 (FLA's first compile in a process needs more than 80 s: job 16a's core was cut), then
# B=1 T=32768 in a second call if the first leaves too little time (~100 s a case).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job17a.sh          (~560 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" core 300 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096 --out "$OUT/core.json"
pack
run "$base" core_long 250 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x32768 --out "$OUT/core_long.json"
pack
grep -hE "^prefill_" "$OUT"/core.log "$OUT"/core_long.log | cut -c1-200
