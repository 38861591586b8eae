#!/usr/bin/env bash
# Session 11, job 3: the w/u kernel reading beta k exp(G) written by phase 1 (this tree) against
# the tree before (old_kbe.patch): the chunk_prepare stage alone at B=1, T=8192 (bounded with
# CUPTI kernels), compiled test_chunk.py, then the unbounded stage in both trees.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12c.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
stage="python3 benchmarks/stage_profile.py --skip-core --scan-configs none"
old=$(tree old_kbe) || { echo "old_kbe: does not apply"; exit 1; }
run "$old" old_b 80 $stage --gates bounded --kernels --out "$OUT/old_b.json"
run "$base" new_b 80 $stage --gates bounded --kernels --out "$OUT/new_b.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" tests_chunk 150 $T tests/test_chunk.py
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$old" old_u 60 $stage --gates unbounded --out "$OUT/old_u.json"
run "$base" new_u 60 $stage --gates unbounded --out "$OUT/new_u.json"
grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/old_b.log "$OUT"/new_b.log "$OUT"/old_u.log "$OUT"/new_u.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
