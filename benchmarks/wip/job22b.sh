#!/usr/bin/env bash
# For the next session, after job22a.sh: the tree job22a found fastest (TREE = a patch name
# under benchmarks/wip/, or base), its block-level paths compiled and its core against FLA
# 0.6.0 at all six cases in one process. A tree other than all3 also needs its own compiled
# test_chunk.py run before it becomes the default.
#   KDA_COMMIT=abc1234 TREE=all3 bash benchmarks/wip/job22b.sh          (~380 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}" "${TREE:?name the tree: a wip patch or base}"
export KDA_COMMIT
source scripts/gpu_common.sh
if [ "$TREE" = base ]; then dir=$base; else dir=$(tree "$TREE"); fi
run "$dir" tests_fwd 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x \
  tests/test_forward_pallas.py
pack
run "$dir" core 360 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --out "$OUT/core.json"
pack
grep -hE "^prefill_core" "$OUT"/core.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_fwd.log | cut -c1-200
