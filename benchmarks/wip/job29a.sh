#!/usr/bin/env bash
# Session 22, call 2, on this tree (main): the decode core against FLA by device time (CUPTI,
# core:1/8/64), the B=1 step with XLA command buffers for the while loop beside the default,
# and bench_decode --quick. ~400 s.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job_s22b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
P="python3 benchmarks/decode_profile.py"
run "$base" prof_core 150 $P --cases core:1,core:8,core:64 --out "$OUT/prof_core.json"
run "$base" prof_b1 60 $P --cases decode:1 --out "$OUT/prof_b1.json"
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
  run "$base" prof_b1_cmdbuf 60 $P --cases decode:1 --out "$OUT/prof_b1_cmdbuf.json"
pack
run "$base" bench_decode 150 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
for f in prof_core prof_b1 prof_b1_cmdbuf; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy|rror" "$OUT/$f.log" | cut -c1-200; done
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
