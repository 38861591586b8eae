#!/usr/bin/env bash
# Session 23, call 2, on main: the bounded stage through the pairwise pipeline (job24b's two
# steps), then main's decode step by device time (decode_profile) and bench_decode --quick with
# room to finish (job31a's run stopped at 110 s in call 1).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job34a.sh          (~450 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates bounded"
dir=$(tree force_pairwise)
run "$base" b_base 60 $SP --out "$OUT/b_base.json" --configs default
run "$dir" b_pairwise 90 $SP --out "$OUT/b_pairwise.json" --configs default,pairwise_block_k=32
pack
run "$base" prof_decode 100 python3 benchmarks/decode_profile.py --cases decode:1,decode:8,decode:64,decode_k:8 --out "$OUT/prof_decode.json"
pack
run "$base" bench_decode 170 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
grep -hE "^chunk_" "$OUT"/{b_base,b_pairwise}.log | cut -c1-190
grep -E "busy" "$OUT/prof_decode.log" | cut -c1-160
grep -E "^decode" "$OUT/bench_decode.log" | cut -c1-150
