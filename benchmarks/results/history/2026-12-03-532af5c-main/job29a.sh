#!/usr/bin/env bash
# Session 22, call 2, on this tree (main): bench_decode --quick, the decode core against FLA by
# device time (CUPTI, core:1/8/64), the compiled test_forward_pallas.py, then the B=1 step with
# XLA command buffers for the while loop beside the default, each step limited to what is left
# of ~560 s.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job29a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
S=$SECONDS
lim() { local left=$((560 - (SECONDS - S))); echo $(( left < $1 ? (left > 5 ? left : 5) : $1 )); }
P="python3 benchmarks/decode_profile.py"
run "$base" bench_decode "$(lim 150)" python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
run "$base" prof_core "$(lim 130)" $P --cases core:1,core:8,core:64 --out "$OUT/prof_core.json"
pack
run "$base" tests_fwd "$(lim 150)" python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE tests/test_forward_pallas.py
pack
run "$base" prof_b1 "$(lim 50)" $P --cases decode:1 --out "$OUT/prof_b1.json"
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
  run "$base" prof_b1_cmdbuf "$(lim 50)" $P --cases decode:1 --out "$OUT/prof_b1_cmdbuf.json"
pack
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
grep -hE "passed|failed" "$OUT/tests_fwd.log" | tail -2
for f in prof_core prof_b1 prof_b1_cmdbuf; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy|rror" "$OUT/$f.log" | cut -c1-200; done
