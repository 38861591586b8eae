#!/usr/bin/env bash
# For the next session (written in session 18, not run): block_k 64 for the unbounded gate's
# main prepare kernel (`pairwise_bk64.patch`: a `pairwise_block_k` field, 64; the bounded kernel
# keeps block_k 32). Session 18's job 4 timed the knob on the stage (667.1 against 699.5 /
# 690.3 us); ptxas 136 registers, 3 programs/SM (120 and 4 at 32). CPU tests pass with the
# patch (a new interpret-mode case at K = 128 runs the 64- and 128-column slices).
# Compiled test_chunk.py on the patched tree, the stage of both trees, then the patched core
# against FLA at the three unbounded shapes in one process.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job24a.sh          (~420 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
dir=$(tree pairwise_bk64)
run "$dir" tests_chunk 130 $T tests/test_chunk.py -k on_gpu
pack
run "$base" u_base 60 $SP --out "$OUT/u_base.json" --configs default
run "$dir" u_bk64 60 $SP --out "$OUT/u_bk64.json" --configs default
pack
run "$dir" core 250 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
grep -hE "^chunk_|^prefill_core" "$OUT"/{u_base,u_bk64,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
