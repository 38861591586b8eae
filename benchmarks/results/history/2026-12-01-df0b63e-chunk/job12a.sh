#!/usr/bin/env bash
# Session 12, job 1: the chunk width. The core (chunk_kda against FLA's in the same run),
# chunk_prepare and chunk_scan alone at C = 64 (the default), 32 and 16, B=1, T=8192, both gates.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
stage="python3 benchmarks/stage_profile.py"
run "$base" c64 170 $stage --chunk 64 --kernels --out "$OUT/c64.json"
run "$base" c32 200 $stage --chunk 32 --kernels --scan-configs 32x4x2,64x4x2 --out "$OUT/c32.json"
run "$base" c16 150 $stage --chunk 16 --scan-configs 32x4x2,64x4x2 --out "$OUT/c16.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^chunk_|^ours|kda_|FLA" "$OUT"/c*.log | cut -c1-140
