#!/usr/bin/env bash
# Session 22, call 4, on this tree: the decode core as FLA's work made explicit (no RMSNorm, the
# read-out carried through the loop: `_decode_core(norm=False)`), by device time (core:1/8/64)
# and by bench_decode's wall clock (its core cases come first; the rest as time allows).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job31a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" prof_core 80 python3 benchmarks/decode_profile.py --cases core:1,core:8,core:64 --out "$OUT/prof_core.json"
pack
run "$base" bench_decode 110 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
grep -E "busy|rror|^ +[0-9.]+ x" "$OUT/prof_core.log" | cut -c1-220
grep -E "^decode_core" "$OUT/bench_decode.log" | cut -c1-150
