#!/usr/bin/env bash
# A job prepared in session 9 for the next GPU session (repo root on the device machine; results
# in $OUT, packed into all.tgz):
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job10.sh
# oproj_reduce.patch: o_proj's split-D partial sums added by the last program of each row tile
# (an atomic count per tile, a zeroed counter per call) instead of an XLA fusion after the
# kernel. Compiled tests of the patched tree (test_gemv: the in-kernel sum repeats its bits and
# matches the reference; test_forward_pallas: decode_k == serial decode), then decode profiles of
# this tree and the patched one.
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal: git on the device reads stale metadata}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
cases=decode:1,decode_k:8,decode:64
d=$(tree oproj_reduce) || exit 1
run "$d" tests_reduce 240 $T tests/test_gemv.py tests/test_forward_pallas.py
run "$base" prof_base 80 $prof --cases $cases --out "$OUT/prof_base.json"
run "$d" prof_reduce 80 $prof --cases $cases --out "$OUT/prof_reduce.json"
grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
