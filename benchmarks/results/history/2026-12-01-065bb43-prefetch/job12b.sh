#!/usr/bin/env bash
# Session 12, job 2: chunk_scan loading each chunk's u and exp(G_last) one iteration ahead,
# against the scan before it (old_scan.patch), at C = 64 and 32: the core against FLA's in the
# same run, chunk_prepare and chunk_scan alone (B=1, T=8192, both gates).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
stage="python3 benchmarks/stage_profile.py --scan-configs 16x4x2,32x4x2"
old=$(tree old_scan) || { echo "old_scan: does not apply"; exit 1; }
run "$old" old64 170 $stage --chunk 64 --out "$OUT/old64.json"
run "$base" new64 170 $stage --chunk 64 --out "$OUT/new64.json"
run "$base" new32 170 $stage --chunk 32 --out "$OUT/new32.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^chunk_" "$OUT"/old64.log "$OUT"/new64.log "$OUT"/new32.log | cut -c1-150
