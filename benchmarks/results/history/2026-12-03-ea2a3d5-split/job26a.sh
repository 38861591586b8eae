#!/usr/bin/env bash
# Session 21, job 1: o_proj through the Mosaic GPU kernel with D split across a cluster
# (gemv_mgpu.py on this tree) against the Triton sweep + XLA's partial-sum add (the base tree:
# this tree with oproj_split.patch reversed). Compiled test_gemv_mgpu.py, o_proj alone at each
# split, decode profiles of both trees.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job26a.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
rm -rf /tmp/tree_base && cp -r "$base" /tmp/tree_base
(cd /tmp/tree_base && patch -s -R -p1 < benchmarks/wip/oproj_split.patch) || echo "reverse patch failed"
run "$base" tests_mgpu 170 $T tests/test_gemv_mgpu.py
pack
run "$base" oproj 130 python3 benchmarks/wip/oproj_split.py --out "$OUT/oproj.json"
pack
P="python3 benchmarks/decode_profile.py --cases decode:1,decode:8,decode_k:8"
run "$base" prof_split 90 $P --out "$OUT/prof_split.json"
pack
run /tmp/tree_base prof_base 90 $P --out "$OUT/prof_base.json"
pack
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-200
python3 - "$OUT/oproj.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    ks = r.get("kernels") or []
    print(r["m"], r["variant"], r.get("max_rel_err"), r.get("run_to_run_bits_equal"), r.get("row0_bits_equal_m1"), [k[:2] for k in ks[:3]], r.get("error", "")[:300])
PY
for f in prof_split prof_base; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy" "$OUT/$f.log" | cut -c1-200; done
