#!/usr/bin/env bash
# Session 11, job 2: Mosaic GPU GEMV experiment (benchmarks/wip/mgpu_gemv_bench.py).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" mgpu 400 python3 benchmarks/wip/mgpu_gemv_bench.py --out "$OUT/mgpu.json"
cut -c1-400 "$OUT/mgpu.log" | grep -v Warning
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
