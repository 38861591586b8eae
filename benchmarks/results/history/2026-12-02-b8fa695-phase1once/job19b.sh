#!/usr/bin/env bash
# Session 16, job 3: the core against FLA 0.6.0 at B=1 T=8192, B=4 T=4096 and B=1 T=32768,
# both gates, in one process, with chunk_prepare's phase 1 forming the gate once (job 2) at num_stages 1
# (the faster stage in job 2), its compiled tests first.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job19b.sh          (~480 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" tests_chunk 140 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x \
  tests/test_chunk.py -k on_gpu
pack
run "$base" core 340 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --out "$OUT/core.json"
pack
grep -hE "^prefill_core" "$OUT"/core.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
