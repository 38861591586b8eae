#!/usr/bin/env bash
# For the next session (written in session 16, not run: the device budget was spent). Two
# patches, built and tested on the CPU only (benchmarks/NOTES.md, session 16):
# - diag_gsum.patch: the diagonal kernel also stores the block-local cumulative gate and the
#   prepare kernel builds G from it (the unbounded gate's softplus and cumsum scan leave the
#   main kernel; static SASS for sm_90a: its phase-1 loop 815 -> 312 instructions per slice,
#   the kernel 3032 -> 2464, the diagonal kernel's row loops +2%);
# - diag_gsum_noscr.patch: the same, and no G scratch at all (the prepare and w/u kernels
#   build G from the block sums wherever they read it: 134 MB less written at B=1 T=8192).
# Compiled tests in the second tree, the unbounded stage of the committed kernels and of both
# patches in the same job, the second's kernel list, then its core against FLA at three shapes
# (unbounded; the bounded gate's kernels are unchanged below 80 nats per block).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job20a.sh          (~520 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
gsum=$(tree diag_gsum)
noscr=$(tree diag_gsum_noscr)
run "$noscr" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" base 60 $SP --out "$OUT/base.json" --configs default
pack
run "$gsum" gsum 60 $SP --out "$OUT/gsum.json" --configs default
pack
run "$noscr" noscr 80 $SP --kernels --out "$OUT/noscr.json" --configs default
pack
run "$noscr" core 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_core" "$OUT"/{base,gsum,noscr,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
