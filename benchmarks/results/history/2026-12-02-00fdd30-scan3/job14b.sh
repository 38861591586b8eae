#!/usr/bin/env bash
# Session 13, job 2: chunk_scan's new default at C = 32 (BV 32, 4 warps, 3 stages, from job 1)
# beside other tilings at B=4, T=4096 and B=1, T=8192; then the core against FLA 0.6.0
# chunk_kda at B=1 T=8192 and B=4 T=4096, both gates; then test_chunk.py's compiled cases.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job14b.sh          (~450 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
pack() { (cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null); }
run "$base" scan_b4 110 python3 benchmarks/stage_profile.py --skip-core --configs none \
  --b 4 --t 4096 --chunk 32 --scan-configs 32x4x3,64x4x2,16x4x3,64x8x3,32x8x3 \
  --out "$OUT/scan_b4.json"
pack
run "$base" scan_b1 70 python3 benchmarks/stage_profile.py --skip-core --configs none \
  --chunk 32 --scan-configs 32x4x3,32x8x3,16x2x4 --out "$OUT/scan_b1.json"
pack
run "$base" core 230 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096 --out "$OUT/core.json"
pack
run "$base" tests_chunk 170 $T -s tests/test_chunk.py -k on_gpu
pack
grep -hE "^chunk_|^prefill_core" "$OUT"/scan_b4.log "$OUT"/scan_b1.log "$OUT"/core.log | cut -c1-170
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
