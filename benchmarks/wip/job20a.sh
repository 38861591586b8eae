#!/usr/bin/env bash
# For the next session (written in session 16, not run: the device budget was spent): the
# diagonal kernel also stores the block-local cumulative gate and the prepare kernel builds G
# from it (diag_gsum.patch: the unbounded gate's softplus and cumsum scan leave the main
# kernel; static SASS for sm_90a: its phase-1 loop 815 -> 312 instructions per slice, the
# kernel 3032 -> 2464, the diagonal kernel's row loops +2%). Compiled tests in the patched
# tree, the unbounded stage beside the committed kernels in the same job, the patched core's
# kernels, then the patched core against FLA at three shapes (unbounded; the bounded gate's
# kernels are unchanged).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job20a.sh          (~420 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
new=$(tree diag_gsum)
run "$new" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$new" new 80 $SP --kernels --out "$OUT/new.json" --configs default
pack
run "$base" old 60 $SP --out "$OUT/old.json" --configs default
pack
run "$new" core 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_core" "$OUT"/{new,old,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
