#!/usr/bin/env bash
# Session 10, job 7: conv_decode in programs of W-1 rows (this tree): compiled conv, front and
# forward decode tests, decode profiles, bench_decode --quick.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job11g.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" tests_groups 120 $T tests/test_conv.py tests/test_front.py tests/test_forward_pallas.py -k "decode or front"
run "$base" prof_groups 50 python3 benchmarks/decode_profile.py --cases decode:1,decode_k:8 --out "$OUT/prof_groups.json"
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
run "$base" bench_decode 130 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
