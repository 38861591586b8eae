#!/usr/bin/env bash
# Session 19, job 2: (1) w_in GEMV variants by CUPTI (benchmarks/wip/mgpu_bench2.py); (2) job24a's
# first half: compiled test_chunk.py with pairwise_bk64.patch, the unbounded stage of both trees.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job25b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" mgpu2 200 python3 benchmarks/wip/mgpu_bench2.py --out "$OUT/mgpu2.json"
pack
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE -x"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates unbounded"
dir=$(tree pairwise_bk64)
run "$dir" tests_chunk 130 $T tests/test_chunk.py -k on_gpu
pack
run "$base" u_base 60 $SP --out "$OUT/u_base.json" --configs default
run "$dir" u_bk64 60 $SP --out "$OUT/u_bk64.json" --configs default
pack
grep -v Warning "$OUT/mgpu2.log" | grep -v '^\s*$' | cut -c1-260 | tail -20
grep -hE "^chunk_|^prefill_core" "$OUT"/{u_base,u_bk64}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
