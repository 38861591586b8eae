#!/usr/bin/env bash
# Session 10, job 2: the CUDA-core GEMV form (GemvBlockSizes(mma=False)). Decode profiles of this
# tree and of fma_all.patch (that form, [4, 256] tiles, for every M <= 8), compiled tests of
# both, then bench_gemv's --fma sweep.   KDA_COMMIT=abc1234 bash benchmarks/wip/job11b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
cases=decode:1,decode_k:8,decode:64
d=$(tree fma_all) || exit 1
run "$base" prof_base 80 $prof --cases $cases --out "$OUT/prof_base.json"
run "$d" prof_fma 80 $prof --cases $cases --out "$OUT/prof_fma.json"
run "$base" tests_fma 120 $T tests/test_gemv.py -k fma
run "$d" tests_fma_all 200 $T tests/test_forward_pallas.py tests/test_front.py -k "decode or front"
run "$base" sweep_fma 200 python3 benchmarks/bench_gemv.py --sweep --fma --sweep-rows 1,8 --out "$OUT/sweep_fma.json"
grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
tail -n 70 "$OUT/sweep_fma.log"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
