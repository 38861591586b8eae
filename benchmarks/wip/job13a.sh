#!/usr/bin/env bash
# For the next session, written in session 12 (not yet run). What the new default chunk width
# (C = 32, DEFAULT_CHUNK) still lacks on the GPU: the core at B=1, T=32768 beside FLA (both
# gates), then test_forward_pallas.py compiled (its block-level prefill takes cfg.chunk).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job13a.sh          (~500 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" core32k 300 python3 benchmarks/bench_prefill.py --quick --core-only \
  --chunks 32,64 --shapes 1x32768 --out "$OUT/core32k.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" tests_fwd 180 $T -s tests/test_forward_pallas.py
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^prefill_core" "$OUT"/core32k.log | cut -c1-170
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_fwd.log | cut -c1-200
