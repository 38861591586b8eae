#!/usr/bin/env bash
# Session 14, job 3: the diagonal kernel as a halving (each level's pairs one product through
# the group's reference row, no pairwise loop; job 2: row walks at the old kernel's ~430 us).
# test_chunk.py compiled (the diagonal's products now take TF32), the core's kernel list beside
# the old kernel's (olddiag.patch), then the unbounded core against FLA 0.6.0 at B=1 T=8192
# and B=4 T=4096.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job16c.sh          (~540 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
P="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --gates unbounded --scan-configs none"
old=$(tree olddiag)
run "$base" tests_chunk 140 $T -x tests/test_chunk.py -k on_gpu
pack
run "$base" new 100 $P --kernels --configs default --out "$OUT/new.json"
pack
run "$old" old 80 $P --kernels --configs default --out "$OUT/old.json"
pack
run "$base" core_unb 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096 --gates unbounded --out "$OUT/core_unb.json"
pack
grep -hE "busy|kda_chunk|^prefill_|^chunk_" "$OUT"/new.log "$OUT"/old.log "$OUT"/core_unb.log \
  | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_chunk.log | cut -c1-200
