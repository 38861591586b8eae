#!/usr/bin/env bash
# Session 11, job 4: the Mosaic GPU GEMV at M rows (benchmarks/wip/mgpu_rows_check.py).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12d.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" mgpu_rows 150 python3 benchmarks/wip/mgpu_rows_check.py
grep -vi warn "$OUT/mgpu_rows.log" | cut -c1-300 | tail -20
