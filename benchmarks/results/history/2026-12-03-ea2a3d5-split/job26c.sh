#!/usr/bin/env bash
# Session 21, job 3: o_proj's split Mosaic GPU kernel in its working form (split_load.patch, now
# gemv_mgpu.py): o_proj alone at each split and depth against the Triton sweep; decode profiles
# of this tree and of the base (no_split.patch: o_proj back on the Triton sweep); bench_decode
# --quick; compiled test_forward_pallas.py.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job26c.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
nb=$(tree no_split)
run "$base" oproj 120 python3 benchmarks/wip/oproj_split.py --out "$OUT/oproj.json"
pack
P="python3 benchmarks/decode_profile.py --cases decode:1,decode_k:8"
run "$base" prof_split 60 $P --out "$OUT/prof_split.json"
run "$nb" prof_base 60 $P --out "$OUT/prof_base.json"
pack
run "$base" bench_decode 140 python3 benchmarks/bench_decode.py --quick --out "$OUT/bench_decode.json"
pack
run "$base" tests_fwd 150 $T tests/test_forward_pallas.py
pack
python3 - "$OUT/oproj.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    ks = r.get("kernels") or []
    print(r["m"], r["variant"], r.get("max_rel_err"), r.get("run_to_run_bits_equal"), r.get("row0_bits_equal_m1"), [k[:3] for k in ks[:2]], r.get("error", "")[:200])
PY
for f in prof_split prof_base; do echo "== $f"; grep -E "^ +[0-9.]+ x|busy" "$OUT/$f.log" | cut -c1-160; done
grep -E "^decode|^core" "$OUT/bench_decode.log" | cut -c1-150
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log | cut -c1-200
