#!/usr/bin/env bash
# Session 12, job 4: the core at C = 32 beside FLA's at B=1, T=32768, both gates (the
# shape job 3 ran out of time on).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12d.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" bench_core32k 150 python3 benchmarks/bench_prefill.py --quick --core-only \
  --chunks 32 --shapes 1x32768 --out "$OUT/bench_core32k.json"
grep -hE "^prefill_core" "$OUT"/bench_core32k.log | cut -c1-170
