#!/usr/bin/env bash
# Session 8's GPU jobs (repo root on the device machine; results in $OUT, packed into all.tgz).
#   bash benchmarks/wip/job8.sh profile  # decode profiles of this tree (decode:1, decode_k:8,
#                                        # decode:64) and of uniform_rows.patch; compiled
#                                        # test_forward_pallas.py here, test_gemv.py and
#                                        # test_forward_pallas.py in the patched tree
#   bash benchmarks/wip/job8.sh decode2  # decode profiles: this tree (o_norm's one-row programs,
#                                        # conv_decode's new state apart from its snapshots)
#                                        # against base_ef82cd0.patch (the tree before them),
#                                        # rec_w2 / rec_w1 (recurrent [128, 32] tile at 2 / 1
#                                        # warps); compiled test_conv, test_o_norm,
#                                        # test_forward_pallas here
#   bash benchmarks/wip/job8.sh bench    # bench_decode --quick; bench_prefill --quick --core-only
#   bash benchmarks/wip/job8.sh last     # bench_decode --quick again (the spread between jobs);
#                                        # gemv_vec.patch's sweep; bench_prefill --block-only
set -uo pipefail
what=${1:?profile}
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
if [ "$what" = profile ]; then
  run "$base" prof_base 110 $prof --cases decode:1,decode_k:8,decode:64 --out "$OUT/prof_base.json"
  u=$(tree uniform_rows) && run "$u" prof_uniform 90 $prof --cases decode_k:8,decode:64 \
    --out "$OUT/prof_uniform.json"
  run "$base" tests_fwd 110 $T tests/test_forward_pallas.py
  run "$u" tests_uniform 200 $T tests/test_gemv.py tests/test_forward_pallas.py
  grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-200
  grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
fi
if [ "$what" = decode2 ]; then
  cases=decode:1,decode_k:8,decode:64
  run "$base" prof_new 100 $prof --cases $cases --out "$OUT/prof_new.json"
  d=$(tree base_ef82cd0) && run "$d" prof_old 100 $prof --cases $cases --out "$OUT/prof_old.json"
  d=$(tree rec_w2) && run "$d" prof_rec_w2 70 $prof --cases decode:1,decode_k:8 --out "$OUT/prof_rec_w2.json"
  d=$(tree rec_w1) && run "$d" prof_rec_w1 70 $prof --cases decode:1,decode_k:8 --out "$OUT/prof_rec_w1.json"
  run "$base" tests_decode 190 $T tests/test_conv.py tests/test_o_norm.py tests/test_forward_pallas.py
  grep -hE '^\{|^ +1.00 x' "$OUT"/prof_*.log | cut -c1-140
  grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-300
fi
if [ "$what" = bench ]; then
  run "$base" bench_decode 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
  run "$base" bench_prefill_core 340 python3 benchmarks/bench_prefill.py --quick --core-only \
    --out "$OUT/bench_prefill_core.json"
  grep -hE "^decode|^prefill|^conv" "$OUT"/bench_*.log | cut -c1-200
fi
if [ "$what" = last ]; then
  run "$base" bench_decode2 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode2.json"
  d=$(tree gemv_vec) && run "$d" vec_sweep 110 python3 benchmarks/wip_vec_sweep.py "$OUT/vec_sweep.json"
  run "$base" bench_prefill_block 200 python3 benchmarks/bench_prefill.py --quick --block-only \
    --out "$OUT/bench_prefill_block.json"
  grep -hE "^decode |^decode_k|^prefill" "$OUT"/bench_*.log | cut -c1-200
  cat "$OUT/vec_sweep.log" | grep -v Warn | cut -c1-160
fi
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
