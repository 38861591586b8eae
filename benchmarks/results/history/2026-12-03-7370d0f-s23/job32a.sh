#!/usr/bin/env bash
# Session 22's untimed lead: o_norm folded into o_proj's sweep (`normed_proj.patch`:
# pallas_kernels/normed_proj.py, not wired into the block), its compiled tests and its device
# time against o_norm + proj at M = 1 and 8 (benchmarks/wip/normed_bench.py). ~150 s. Wire it
# into decode / decode_k only if it wins at both M (163 registers, 3 programs per SM: it may not).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job32a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
d=$(tree normed_proj) || { echo "patch failed"; exit 1; }
run "$d" tests_normed 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE tests/test_normed_proj.py
run "$d" normed_bench 90 python3 benchmarks/wip/normed_bench.py --out "$OUT/normed_bench.json"
pack
grep -hE "passed|failed" "$OUT/tests_normed.log" | tail -2
grep -E "busy|^ +[0-9.]+ x" "$OUT/normed_bench.log" | cut -c1-200
