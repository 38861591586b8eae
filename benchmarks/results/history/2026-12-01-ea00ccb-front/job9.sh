#!/usr/bin/env bash
# Session 9's GPU jobs (repo root on the device machine; results in $OUT, packed into all.tgz).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9.sh front  # compiled test_front, test_conv,
#       # test_forward_pallas; decode profiles of this tree (conv and f_b | g_b in one launch)
#       # against base_fec28ad.patch (the tree before it); bench_decode --quick
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9.sh ab  # decode profiles of this tree against
#       # w_in64.patch (w_in in 64 x 128 tiles at every M <= 8); bench_gemv --sweep --deep at
#       # M = 1, 8; compiled test_gemv
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9.sh rec  # decode profiles (B=1, 8, k=8) of this
#       # tree against rec_w8.patch / rec_v16.patch (the recurrent tile below 1024
#       # sequence-heads: [128, 32] at 8 warps, [128, 16] at 4); bench_decode --quick again
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9.sh onered  # compiled test_recurrent and
#       # test_forward_pallas; decode profiles of this tree (one dependent reduction per row in
#       # the recurrent kernel) against rec_tworeds.patch (the tree before); bench_decode --quick
#   KDA_COMMIT=abc1234 bash <this script> core  # the decode core's device time against FLA's
#       # (decode_profile core:1,8,64, the records of 2026-12-01_h200_decode_core_device_s9.json);
#       # compiled test_o_norm
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9.sh again  # bench_decode --quick again (the
#       # spread between jobs); compiled test_gemv, test_forward_pallas
set -uo pipefail
what=${1:?front or again}
: "${KDA_COMMIT:?pass the commit as a literal: git on the device reads stale metadata}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
cases=decode:1,decode_k:8,decode:64
if [ "$what" = front ]; then
  run "$base" tests_front 170 $T tests/test_front.py tests/test_conv.py tests/test_forward_pallas.py
  run "$base" prof_new 90 $prof --cases $cases --out "$OUT/prof_new.json"
  d=$(tree base_fec28ad) && run "$d" prof_old 90 $prof --cases $cases --out "$OUT/prof_old.json"
  run "$base" bench_decode 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
  grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-160
  grep -hE "^decode |^decode_k|^decode_core" "$OUT"/bench_*.log | cut -c1-160
fi
if [ "$what" = ab ]; then
  run "$base" prof_base 90 $prof --cases $cases --out "$OUT/prof_base.json"
  d=$(tree w_in64) && run "$d" prof_w_in64 90 $prof --cases $cases --out "$OUT/prof_w_in64.json"
  run "$base" gemv_deep 170 python3 benchmarks/bench_gemv.py --sweep --deep --sweep-rows 1,8 \
    --out "$OUT/gemv_deep.json"
  run "$base" tests_gemv 180 $T tests/test_gemv.py
  grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-160
  grep -E "^(w_in|o_proj)" "$OUT/gemv_deep.log" | cut -c1-100
fi
if [ "$what" = rec ]; then
  c=decode:1,decode:8,decode_k:8
  run "$base" prof_base 80 $prof --cases $c --out "$OUT/prof_base.json"
  for p in rec_w8 rec_v16; do
    d=$(tree $p) && run "$d" prof_$p 80 $prof --cases $c --out "$OUT/prof_$p.json"
  done
  run "$base" bench_decode2 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode2.json"
  grep -hE '^\{|^ +1.00 x +[0-9.]+ us +kda_rec' "$OUT"/prof_*.log | cut -c1-120
  grep -hE "^decode |^decode_k" "$OUT"/bench_*.log | cut -c1-160
fi
if [ "$what" = onered ]; then
  run "$base" tests_onered 200 $T tests/test_recurrent.py tests/test_forward_pallas.py
  run "$base" prof_onered 80 $prof --cases $cases --out "$OUT/prof_onered.json"
  d=$(tree rec_tworeds) && run "$d" prof_tworeds 80 $prof --cases $cases --out "$OUT/prof_tworeds.json"
  run "$base" bench_decode3 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode3.json"
  grep -hE '^\{|^ +1.00 x +[0-9.]+ us +kda_rec' "$OUT"/prof_*.log | cut -c1-120
  grep -hE "^decode |^decode_k|^decode_core" "$OUT"/bench_*.log | cut -c1-160
fi
if [ "$what" = core ]; then
  run "$base" prof_core 120 $prof --cases core:1,core:8,core:64 --out "$OUT/prof_core.json"
  run "$base" tests_o_norm 100 $T tests/test_o_norm.py
  grep -hE '^\{' "$OUT"/prof_core.log | cut -c1-400
fi
if [ "$what" = again ]; then
  run "$base" bench_decode2 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode2.json"
  run "$base" tests_again 300 $T tests/test_gemv.py tests/test_forward_pallas.py
  grep -hE "^decode |^decode_k" "$OUT"/bench_*.log | cut -c1-160
fi
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log 2>/dev/null | cut -c1-300
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
