#!/usr/bin/env bash
# Session 7's GPU jobs (repo root on the device machine; results in $OUT, packed into all.tgz).
#   bash benchmarks/wip/job7.sh decode   # gemv sweep at M = 64; decode profiles: this tree (the
#                                        # kernel for 9..64 projection rows) against xla_rows.patch
#                                        # (XLA's dot above 8 rows), rec_v16.patch, conv_hb1.patch
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
fi
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
