#!/usr/bin/env bash
# Session 19, job 1: the Mosaic GPU GEMV (pallas_kernels/gemv_mgpu.py) against the Triton gemv,
# w_in and o_proj at M = 1, 8, 64, several tilings (benchmarks/wip/mgpu_bench.py).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job25a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
run "$base" mgpu 420 python3 benchmarks/wip/mgpu_bench.py --out "$OUT/mgpu.json"
cut -c1-300 "$OUT/mgpu.log" | grep -v Warning | grep -v '^\s*$' | tail -60
pack
