#!/usr/bin/env bash
# Session 22, call 3, on this tree (main): bench_decode --quick again (a second sample of job29a's
# wall clock figures, same commit), then the unbounded prefill core against FLA at B=1 T=8192
# (session 19's block_k 64 default, not timed against FLA then), within ~420 s.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job30a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
S=$SECONDS
lim() { local left=$((420 - (SECONDS - S))); echo $(( left < $1 ? (left > 5 ? left : 5) : $1 )); }
run "$base" bench_decode "$(lim 150)" python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
run "$base" bench_prefill "$(lim 260)" python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 --shapes 1x8192 --gates unbounded --out "$OUT/bench_prefill.json"
pack
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
grep -vE "^ *$" "$OUT/bench_prefill.log" | tail -8 | cut -c1-200
