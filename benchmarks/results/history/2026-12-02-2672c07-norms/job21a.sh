#!/usr/bin/env bash
# Session 17, after job20a (diag_gsum_noscr, now the default at e0ae689). diag_norms.patch: the
# diagonal kernel also stores each row's 1/||q|| and 1/||k|| (it forms them for its walk), and
# the prepare kernel reads them instead of walking K four times for them (unbounded gate only).
# Compiled tests of the patched tree, the unbounded stage of the committed kernels and of the
# patch in one job, the patch's kernels, its core against FLA at three shapes (unbounded), and
# test_forward_pallas.py compiled on the patched tree.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job21a.sh          (~540 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
nrm=$(tree diag_norms)
run "$nrm" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" base 60 $SP --out "$OUT/base.json" --configs default
pack
run "$nrm" norms 80 $SP --kernels --out "$OUT/norms.json" --configs default
pack
run "$nrm" core 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
run "$nrm" tests_fwd 100 $T -x tests/test_forward_pallas.py
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_core" "$OUT"/{base,norms,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_{chunk,fwd}.log | cut -c1-200
