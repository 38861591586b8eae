#!/usr/bin/env bash
# For the next session (written in session 17, not run: the device budget was spent).
# stages2.patch: the main prepare kernel at num_stages 2 when the diagonal kernel supplies its
# diagonal blocks, G and norms (unbounded gate; session 17's job 3 sweep: the stage 749.9
# against 778.0 us; ptxas 108 registers against 122). Compiled tests in the patched tree, the
# unbounded stage at its knobs in one process (block_k 64 measured 749.1 beside it), the
# core against FLA at three shapes (unbounded), the core at C = 64 at B=1 T=8192 (C = 32 was
# chosen in session 13, before the unbounded gate's diagonal kernel took G and the norms), and
# test_forward_pallas.py compiled.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job22a.sh          (~480 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
st2=$(tree stages2)
run "$st2" tests_chunk 150 $T -x tests/test_chunk.py -k on_gpu
pack
run "$st2" sweep 90 python3 benchmarks/stage_profile.py --skip-core --chunk 32 \
  --scan-configs none --gates unbounded --out "$OUT/sweep.json" \
  --configs default,pairwise_stages=1,block_k=64,block_k=64+pairwise_stages=1
pack
run "$st2" core 200 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 \
  --shapes 1x8192,4x4096,1x32768 --gates unbounded --out "$OUT/core.json"
pack
run "$st2" core64 90 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 64 \
  --shapes 1x8192 --gates unbounded --out "$OUT/core64.json"
pack
run "$st2" tests_fwd 100 $T -x tests/test_forward_pallas.py
pack
grep -hE "^chunk_|^prefill_core" "$OUT"/{sweep,core,core64}.log | cut -c1-190
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_{chunk,fwd}.log | cut -c1-200
