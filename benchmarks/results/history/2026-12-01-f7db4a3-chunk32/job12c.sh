#!/usr/bin/env bash
# Session 12, job 3: the core at C = 64 and 32 beside FLA's, all three shapes, both gates
# (bench_prefill --chunks), then test_chunk.py's compiled cases (now at C = 32 and 64).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12c.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" bench_core 330 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 64,32 \
  --out "$OUT/bench_core.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" tests_chunk 190 $T -s tests/test_chunk.py -k on_gpu
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^prefill_core" "$OUT"/bench_core.log | cut -c1-170
grep -hE "passed|failed|FAILED|ERROR|rel RMS" "$OUT"/tests_chunk.log | cut -c1-200
