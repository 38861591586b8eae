#!/usr/bin/env bash
# Session 11, job 1: chunk_prepare split into three kernels (decay, scores per sub-block, T + w/u)
# against the one-kernel tree before it (old_prepare.patch), the stage alone at B=1, T=8192,
# both gates, with a sweep of the new kernels' knobs; compiled test_chunk, test_conv, test_front.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job12a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
stage="python3 benchmarks/stage_profile.py --skip-core --scan-configs none"
old=$(tree old_prepare) || { echo "old_prepare: does not apply"; exit 1; }
run "$old" old 120 $stage --kernels --out "$OUT/old.json"
run "$base" new 260 $stage --kernels --configs "${CONFIGS:-default,block_k=16,block_k=16+num_stages=1,num_warps=2,num_warps=2+block_k=16,decay_block_k=16,decay_warps=8}" --out "$OUT/new.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/old.log "$OUT"/new.log | cut -c1-120
run "$base" tests_chunk 200 $T tests/test_chunk.py
run "$base" tests_conv 120 $T tests/test_conv.py tests/test_front.py
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
