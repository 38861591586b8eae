#!/usr/bin/env bash
# Session 10, job 3: onorm_oproj.patch (the gated RMSNorm applied as o_proj's GEMV loads its
# activation tile; the o_norm launch gone). Decode profiles of this tree and the patched one,
# then the patched tree's compiled decode tests.   KDA_COMMIT=abc1234 bash benchmarks/wip/job11c.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
cases=decode:1,decode_k:8,decode:64,decode:8
d=$(tree onorm_oproj) || exit 1
run "$base" prof_base 90 $prof --cases $cases --out "$OUT/prof_base.json"
run "$d" prof_onorm 90 $prof --cases $cases --out "$OUT/prof_onorm.json"
run "$d" tests_onorm 200 $T tests/test_forward_pallas.py -k "decode_k_equals_serial or decode_and_verify"
grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-120
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
