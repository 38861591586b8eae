#!/usr/bin/env bash
# Session 13, job 4 (the device time left): the core against FLA 0.6.0 chunk_kda at B=1 T=8192
# and B=4 T=4096 again at the same commit as job 3 (FLA's own time moved by ~10% between jobs
# 2 and 3 at B=4), then two more scan tilings at B=4 beside the default.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job14d.sh          (~230 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
pack() { (cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null); }
run "$base" core 190 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096 --out "$OUT/core.json"
pack
run "$base" scan_b4 45 python3 benchmarks/stage_profile.py --skip-core --configs none \
  --b 4 --t 4096 --chunk 32 --scan-configs 64x4x2,32x4x2,64x8x2 --out "$OUT/scan_b4.json"
pack
grep -hE "^prefill_|^chunk_" "$OUT"/core.log "$OUT"/scan_b4.log | cut -c1-200
