#!/usr/bin/env bash
# For the next session, written in session 12 (not yet run): the whole block at C = 32 against
# the xla backend, then chunk_prepare's and chunk_scan's knobs at C = 32 (both were tuned at
# C = 64), B=1, T=8192, the stage alone.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job13b.sh          (~550 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" block 240 python3 benchmarks/bench_prefill.py --quick --block-only \
  --out "$OUT/block.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" knobs32 280 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --configs "default,block_k=16,num_stages=3,num_warps=2,wu_block_k=32" \
  --scan-configs 16x4x2,16x4x3,16x2x2,32x4x3 --out "$OUT/knobs32.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^prefill_block|^chunk_" "$OUT"/block.log "$OUT"/knobs32.log | cut -c1-170
