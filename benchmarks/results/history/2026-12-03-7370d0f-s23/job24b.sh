#!/usr/bin/env bash
# For the next session (written in session 18, not run): would the bounded gate gain from the
# unbounded gate's pipeline (the diagonal kernel's row walk forms the diagonal blocks of A and
# T, G and the norms; the main kernel then forms no gate, no norms and inverts nothing)? In
# session 18's job 1 the bounded stage took 657.7 us and the unbounded 755.6 -> 704.1 with T
# moved; the bounded gate's sigmoid is cheaper in the row walk than the softplus. A timing
# experiment: `force_pairwise.patch` sends every gate through the pairwise path. With it,
# test_chunk.py -k prepare passes on the CPU but for test_prepare_lowers_for_h200[bounded],
# which asserts that the bounded gate has no diagonal kernel. If it wins, the factorised path
# could go (one path fewer) after compiled tests. Rebased in session 19 on b8b3005: the pairwise
# path now reads `pairwise_block_k` (64 by default), so the forced tree's default runs 64-column
# slices and `pairwise_block_k=32` is the bounded kernel's old width.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job24b.sh          (~200 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
SP="python3 benchmarks/stage_profile.py --skip-core --chunk 32 --scan-configs none --gates bounded"
dir=$(tree force_pairwise)
run "$base" b_base 60 $SP --out "$OUT/b_base.json" --configs default
run "$dir" b_pairwise 90 $SP --out "$OUT/b_pairwise.json" --configs default,pairwise_block_k=32
pack
grep -hE "^chunk_" "$OUT"/{b_base,b_pairwise}.log | cut -c1-190
