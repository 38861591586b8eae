#!/usr/bin/env bash
# Session 10, job 1: job10.sh (oproj_reduce.patch compiled and profiled) and the L2 touch
# micro-benchmark (l2_touch.py).   KDA_COMMIT=abc1234 bash benchmarks/wip/job11a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" l2_touch 120 python3 benchmarks/wip/l2_touch.py --out "$OUT/l2_touch.json"
cat "$OUT/l2_touch.log" | cut -c1-400
bash benchmarks/wip/job10.sh
