#!/usr/bin/env bash
# Session 19, job 3: w_in's decode projection through the Mosaic GPU kernel (gemv_mgpu.py, on
# this tree) against the Triton sweep (the base tree: this tree with mgpu_proj.patch reversed).
# Compiled tests of this tree, decode profiles of both trees, bench_decode --quick of this one.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job25c.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
rm -rf /tmp/tree_base && cp -r "$base" /tmp/tree_base
(cd /tmp/tree_base && patch -s -R -p1 < benchmarks/wip/mgpu_proj.patch) || echo "reverse patch failed"
run "$base" tests_gemv 150 $T tests/test_gemv_mgpu.py tests/test_gemv.py
pack
P="python3 benchmarks/decode_profile.py --cases decode:1,decode_k:8"
run "$base" prof_mgpu 60 $P --out "$OUT/prof_mgpu.json"
run /tmp/tree_base prof_base 60 $P --out "$OUT/prof_base.json"
pack
run "$base" tests_fwd 150 $T tests/test_forward_pallas.py
pack
run "$base" bench_decode 140 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-200
for f in prof_mgpu prof_base; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy" "$OUT/$f.log" | cut -c1-200; done
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
