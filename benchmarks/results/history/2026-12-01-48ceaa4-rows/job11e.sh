#!/usr/bin/env bash
# Session 10, job 5: conv_decode's rows as programs of their own (this tree) against the rows
# walked in order in one program (conv_serial.patch: the tree before). Decode profiles of both,
# then this tree's compiled conv, front and forward tests.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job11e.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
cases=decode:1,decode_k:8,decode:64,decode:8
d=$(tree conv_serial) || exit 1
run "$base" prof_rows 90 $prof --cases $cases --out "$OUT/prof_rows.json"
run "$d" prof_serial 90 $prof --cases $cases --out "$OUT/prof_serial.json"
run "$base" tests_rows 240 $T tests/test_conv.py tests/test_front.py tests/test_forward_pallas.py
grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
