#!/usr/bin/env bash
# Session 13, job 1: chunk_scan's and chunk_prepare's knobs at C = 32 (both were tuned at
# C = 64), B=1, T=8192, each stage alone; then test_forward_pallas.py compiled (its block-level
# prefill has not run compiled at C = 32).
# ptxas (scripts/ptxas_report.py's way, sm_90a) for the scan at C = 32, BV 16, 4 warps: 2 stages
# 160 registers and 32 KB of shared memory (one buffer: the next chunk's loads are issued at the
# end of a trip and waited on at the top of the next), 3 stages 162 registers and 60 KB (two
# buffers, loads two trips ahead), 4 stages 88 KB.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job14a.sh          (~520 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" knobs32 330 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --configs "default,num_stages=3,block_k=16,block_k=64,num_warps=2,wu_stages=2,wu_block_k=32" \
  --scan-configs 16x4x2,16x4x3,16x4x4,16x2x3,32x4x3,32x4x4 --out "$OUT/knobs32.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" tests_fwd 200 $T -s tests/test_forward_pallas.py
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^chunk_" "$OUT"/knobs32.log | cut -c1-170
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_fwd.log | cut -c1-200
