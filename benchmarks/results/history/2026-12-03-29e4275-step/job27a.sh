#!/usr/bin/env bash
# Session 21's untimed lead (device time ran out): the decode step kernel
# (`decode_step.patch`: pallas_kernels/step.py, conv + f_b | g_b + gate + recurrence + RMSNorm
# in one launch, used by forward._rows) against this tree, in one job: compiled tests of the
# patched tree, decode profiles of both trees (B = 1, 8, 64 and decode_k k = 8: at large B
# every V tile re-reads its head's 32 KB f_b block, which may lose), bench_decode --quick on the
# patched tree. ~450 s.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job27a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
d=$(tree decode_step) || { echo "patch failed"; exit 1; }
run "$d" tests_step 120 $T tests/test_step.py tests/test_forward_pallas.py
pack
P="python3 benchmarks/decode_profile.py --cases decode:1,decode:8,decode:64,decode_k:8"
run "$d" prof_step 90 $P --out "$OUT/prof_step.json"
run "$base" prof_base 90 $P --out "$OUT/prof_base.json"
pack
run "$d" bench_decode 140 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-200
for f in prof_step prof_base; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy" "$OUT/$f.log" | cut -c1-160; done
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
