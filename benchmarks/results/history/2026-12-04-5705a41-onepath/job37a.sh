#!/usr/bin/env bash
# Session 24, call 3: chunk_prepare with one path for both gates (the factorised bounded path
# removed; force_pairwise.patch made the default): compiled test_chunk.py, then the prefill
# core of both gates against FLA at B=1 T=8192 and B=4 T=4096, in one process.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job37a.sh          (~450 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
run "$base" t_chunk 230 python3 -m pytest -q -x tests/test_chunk.py -k "not lowers_for_h200"
pack
run "$base" pf_core 230 python3 benchmarks/bench_prefill.py --quick --core-only --chunks 32 --shapes 1x8192,4x4096 --out "$OUT/pf_core.json"
pack
tail -n 3 "$OUT/t_chunk.log"
grep -hE "^prefill_core" "$OUT"/pf_core.log | cut -c1-170
