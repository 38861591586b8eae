#!/usr/bin/env bash
# Session 7's GPU jobs (repo root on the device machine; results in $OUT, packed into all.tgz).
#   bash benchmarks/wip/job7.sh decode   # gemv sweep at M = 64; decode profiles: this tree (the
#                                        # kernel for 9..64 projection rows) against xla_rows.patch
#                                        # (XLA's dot above 8 rows), rec_v16.patch, conv_hb1.patch
#   bash benchmarks/wip/job7.sh tests    # the unbounded prepare stage: this tree against
#                                        # diag_v3.patch (also at 2 warps) and diag_v1.patch; compiled
#                                        # test_chunk.py with diag_v3, the decode test files here
#   bash benchmarks/wip/job7.sh bench    # bench_decode --quick, compiled test_conv.py and
#                                        # test_forward_pallas.py, bench_prefill --quick --core-only
set -uo pipefail
what=${1:?decode}
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
if [ "$what" = decode ]; then
  run "$base" sweep64 200 python3 benchmarks/bench_gemv.py --sweep --sweep-rows 64 \
    --out "$OUT/sweep64.json"
  run "$base" prof_base 120 $prof --cases decode:64,decode:1,decode_k:8 --out "$OUT/prof_base.json"
  d=$(tree xla_rows) && run "$d" prof_xla_rows 80 $prof --cases decode:64 --out "$OUT/prof_xla_rows.json"
  d=$(tree rec_v16) && run "$d" prof_rec_v16 90 $prof --cases decode:1,decode_k:8 \
    --out "$OUT/prof_rec_v16.json"
  d=$(tree conv_hb1) && run "$d" prof_conv_hb1 100 $prof --cases decode:1,decode_k:8,decode:64 \
    --out "$OUT/prof_conv_hb1.json"
  grep -hE '^\{|^ +1.00 x|xla dot' "$OUT"/prof_*.log | cut -c1-160
  sort -t'|' -k1 "$OUT/sweep64.log" | grep -E "M=64" | head -80
elif [ "$what" = tests ]; then
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
  stage="python3 benchmarks/stage_profile.py --skip-core --scan-configs none --gates unbounded --kernels"
  run "$base" diag_base 90 $stage --out "$OUT/diag_base.json"
  v3=$(tree diag_v3) && run "$v3" diag_v3 100 $stage --configs default,diag_warps=2 --out "$OUT/diag_v3.json"
  d=$(tree diag_v1) && run "$d" diag_v1 90 $stage --out "$OUT/diag_v1.json"
  run "$v3" tests_chunk_v3 200 $T tests/test_chunk.py
  run "$base" tests_decode 330 $T tests/test_gemv.py tests/test_recurrent.py tests/test_conv.py \
    tests/test_forward_pallas.py
  grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/diag_*.log
  grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
elif [ "$what" = bench ]; then
  T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
  run "$base" bench_decode 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
  run "$base" tests_decode2 130 $T tests/test_conv.py tests/test_forward_pallas.py
  run "$base" bench_prefill_core 175 python3 benchmarks/bench_prefill.py --quick --core-only \
    --out "$OUT/bench_prefill_core.json"
  grep -hE "^decode|^prefill" "$OUT"/bench_*.log | cut -c1-220
  grep -hE "passed|failed" "$OUT"/tests_*.log | cut -c1-300
fi
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
