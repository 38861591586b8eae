#!/usr/bin/env bash
# For the next session (written in session 17, not run: the device budget was spent), after
# job22a.sh. diag_tinv.patch: the unbounded gate's diagonal kernel forms each block's
# T = (I + L)^-1 by forward substitution during its row walk (beta loaded there), and the
# prepare kernel neither stores the diagonal L blocks nor inverts them (static SASS for sm_90a,
# C = 32: the prepare kernel 2088 -> 1200 instructions, one pass; the diagonal kernel's row
# loops 587 / 752 -> 650 / 804 per row; ptxas 120 and 168 registers). diag_tinv_stages2.patch
# is the same with stages2.patch on top (104 registers). Both pass test_chunk.py,
# test_ptxas_report.py and test_forward_pallas.py on the CPU.
# Compiled tests in the combined tree, the unbounded stage of four trees (committed, stages2,
# tinv, both) in one job, the combined tree's kernels and its core against FLA (unbounded).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job22b.sh          (~420 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
st2=$(tree stages2)
tinv=$(tree diag_tinv)
both=$(tree diag_tinv_stages2)
run "$both" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" base 60 $SP --out "$OUT/base.json" --configs default
run "$st2" stages2 60 $SP --out "$OUT/stages2.json" --configs default
run "$tinv" tinv 60 $SP --out "$OUT/tinv.json" --configs default
pack
run "$both" both 80 $SP --kernels --out "$OUT/both.json" --configs default
pack
run "$both" core 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_core" "$OUT"/{base,stages2,tinv,both,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
