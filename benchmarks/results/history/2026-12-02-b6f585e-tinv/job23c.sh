#!/usr/bin/env bash
# Session 18, at diag_tinv's default: the main prepare kernel's knobs for the unbounded gate in
# one job (num_stages 2 and block_k 64 had each taken ~3.6% off the stage in session 17's job 3,
# before diag_tinv), then the stages2.patch tree (num_stages 2 for the pairwise path only)
# compiled: test_chunk.py and the core at B=1 T=8192 against FLA.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job23c.sh          (~320 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" sweep 110 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --scan-configs none --gates unbounded --out "$OUT/sweep.json" \
  --configs default,num_stages=2,block_k=64,default
pack
dir=$(tree stages2)
run "$dir" tests_chunk 130 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x \
  tests/test_chunk.py -k on_gpu
pack
run "$dir" core 100 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192 --gates unbounded --out "$OUT/core.json"
pack
grep -hE "^chunk_|^prefill_core" "$OUT"/{sweep,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
