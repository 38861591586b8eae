#!/usr/bin/env bash
# For the next session (written in session 17, not run: the device budget was spent). Three
# candidates for chunk_prepare, each a patch on the committed tree, all CPU-tested
# (test_chunk.py, test_ptxas_report.py, test_forward_pallas.py), none run on a GPU:
# - stages2.patch: the main kernel at num_stages 2 for the unbounded gate (`pairwise_stages`;
#   session 17's job 3 sweep: the stage 749.9 against 778.0 us; ptxas 108 registers, not 122);
# - diag_tinv.patch: the diagonal kernel forms the diagonal T blocks by forward substitution,
#   the prepare kernel no longer inverts them (unbounded; static SASS for sm_90a at C = 32: the
#   prepare kernel 2088 -> 1200 instructions, the diagonal kernel's row loops 587 / 752 -> 650
#   / 804);
# - exp2.patch: e^x as exp2(x log2 e) in the three kernels (both gates; libdevice's expf costs
#   ~8 instructions: unbounded phase-1 loop 310 -> 189 per slice, scores 316 -> 259, w/u 399 ->
#   285; bounded 627 -> 507, 284 -> 226, 369 -> 259). On the CPU XLA folds exp2(x log2 e) back
#   to exp(x), so only these compiled tests see its rounding (<= 8 ulp for |x| <= 10);
# - all3.patch: the three together (prepare kernel 1072 instructions, 104 registers).
# Compiled tests of the combined tree, then the prepare stage of every tree in one job
# (unbounded; bounded for exp2, the one candidate that changes it), and the combined tree's
# kernels. job22b.sh then times the chosen tree's core against FLA.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job22a.sh          (~330 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none"
declare -A dir=([base]=$base)
for p in stages2 diag_tinv exp2 all3; do dir[$p]=$(tree $p); done
run "${dir[all3]}" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
for p in base stages2 diag_tinv exp2 all3; do
  run "${dir[$p]}" "u_$p" 60 $SP --gates unbounded --out "$OUT/u_$p.json" --configs default
done
pack
for p in base exp2; do
  run "${dir[$p]}" "b_$p" 60 $SP --gates bounded --out "$OUT/b_$p.json" --configs default
done
pack
run "${dir[all3]}" kernels 120 $SP --kernels --out "$OUT/kernels.json" --configs default
pack
grep -hE "busy|kda_chunk|^chunk_" "$OUT"/{u_,b_}*.log "$OUT"/kernels.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
