#!/usr/bin/env bash
# Session 24, call 1: force_pairwise's compiled chunk tests and the bounded prefill core against
# FLA on both trees (B=1 T=8192, B=4 T=4096). (The stack of 4 blocks ran in job36a.)
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job35a.sh          (~460 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
dir=$(tree force_pairwise)
run "$dir" t_chunk 170 python3 -m pytest -q -x tests/test_chunk.py -k "not lowers_for_h200"
pack
PF="python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 --shapes 1x8192,4x4096 --gates bounded"
run "$base" pf_base 140 $PF --out "$OUT/pf_base.json"
run "$dir" pf_pairwise 140 $PF --out "$OUT/pf_pairwise.json"
pack
tail -n 3 "$OUT/t_chunk.log"
grep -hE "^prefill_core" "$OUT"/pf_*.log | cut -c1-170
