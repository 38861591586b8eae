#!/usr/bin/env bash
# Session 10, job 4: bench_decode --quick on the default path (its kernels are those of
# session 9), a same-session figure for the closing note.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job11d.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" bench_decode 200 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
grep -vE "^\s*$|Warning|warn" "$OUT/bench_decode.log" | tail -n 30 | cut -c1-200
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
