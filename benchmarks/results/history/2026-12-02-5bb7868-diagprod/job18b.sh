#!/usr/bin/env bash
# Session 15, job 2: the diagonal kernel's decay as a running product (no exp2 per pair), key
# tiles [K/16, 8, 16] in two halves (the default here), the same over one [K/16, 16, 16] tile
# (diag_pf_full.patch) and the session 14 row walk (diag_rowwalk.patch), in one job: compiled
# tests, the chunk_prepare stage alone and the core's kernel list (unbounded gate, B=1 T=8192,
# C = 32), then the core against FLA at B=1 T=8192, both gates.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job18b.sh          (~520 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded --scan-configs none"
run "$base" tests_chunk 170 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" halves 90 $SP --kernels --out "$OUT/halves.json" --configs default,diag_warps=4,diag_warps=1
pack
full=$(tree diag_pf_full) && run "$full" full 60 $SP --configs default,diag_warps=4 --out "$OUT/full.json"
pack
old=$(tree diag_rowwalk) && run "$old" old 50 $SP --configs default --out "$OUT/old.json"
pack
run "$base" core 150 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192 --out "$OUT/core.json"
pack
grep -hE "busy|kda_chunk|^chunk_|^prefill_" "$OUT"/{halves,full,old,core}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
