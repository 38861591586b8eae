#!/usr/bin/env bash
# Session 10, job 6: bench_decode --quick on the default path (conv_decode rows as
# programs of their own), the records of session 10.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job11d.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" bench_decode 200 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
grep -vE "^\s*$|Warning|warn" "$OUT/bench_decode.log" | tail -n 30 | cut -c1-200
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
