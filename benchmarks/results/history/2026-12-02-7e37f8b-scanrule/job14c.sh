#!/usr/bin/env bash
# Session 13, job 3: the scan's default now depends on the program count (BV 64 with 2 stages
# where that fills the GPU, as at B=4; else BV 32 with 3 stages at C <= 32, job 2). The core
# against FLA 0.6.0 chunk_kda at B=4 T=4096 and B=1 T=32768 (both gates), test_forward_pallas.py
# compiled, then the whole block's prefill against the xla backend (cut by its limit if need be:
# every finished case is on disk).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job14c.sh          (~560 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
pack() { (cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null); }
run "$base" core 300 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 4x4096,1x32768 --out "$OUT/core.json"
pack
run "$base" tests_fwd 110 $T -s tests/test_forward_pallas.py
pack
run "$base" block 150 python3 benchmarks/bench_prefill.py --quick --block-only \
  --out "$OUT/block.json"
pack
grep -hE "^prefill_" "$OUT"/core.log "$OUT"/block.log | cut -c1-200
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_fwd.log | cut -c1-200
