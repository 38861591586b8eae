#!/usr/bin/env bash
# The next GPU session's jobs (repo root on the device machine; results in $OUT). Written in
# session 6 after its GPU time was spent; CPU-checked only (benchmarks/wip/README.md).
#   bash benchmarks/wip/next_gpu_job.sh stages   # prepare stage: this tree against score_rows.patch,
#                                                # both gates (~2 min)
#   bash benchmarks/wip/next_gpu_job.sh tests    # compiled test_chunk.py in the patched tree, then
#                                                # its core against FLA (~8 min)
#   bash benchmarks/wip/next_gpu_job.sh rest     # compiled test_gemv, test_gate, test_o_norm (~3 min)
# The device returns 8 files at most: everything is also packed into $OUT/all.tgz.
set -uo pipefail
what=${1:?stages, tests or rest}
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
if [ "$what" = stages ]; then
  stage="python3 benchmarks/stage_profile.py --skip-core --scan-configs none"
  dir=$(tree score_rows) || { echo "score_rows: does not apply"; exit 1; }
  run "$base" base 150 $stage --kernels --out "$OUT/base.json"
  run "$dir" score_rows 150 $stage --kernels --out "$OUT/score_rows.json"
  run "$base" base_again 100 $stage --out "$OUT/base_again.json"
  grep -hE "^chunk_prepare|^ours|kda_chunk" "$OUT"/*.log
elif [ "$what" = tests ]; then
  dir=$(tree score_rows) || { echo "score_rows: does not apply"; exit 1; }
  run "$dir" tests_chunk 200 $T tests/test_chunk.py
  run "$dir" bench_prefill 300 python3 benchmarks/bench_prefill.py --quick --core-only \
    --out "$OUT/bench_prefill_core.json"
  grep -hE "^prefill_core|passed|failed" "$OUT"/*.log | cut -c1-200
else
  run "$base" tests_rest 200 $T tests/test_gemv.py tests/test_gate.py tests/test_o_norm.py
  grep -hE "passed|failed" "$OUT"/*.log
fi
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
