#!/usr/bin/env bash
# Session 21, job 2: job26a's split o_proj hung at its first compiled launch. The three
# cross-CTA reductions of split_modes.py, each in a subprocess with a 45 s limit; then the first
# that runs and is right (store_sync, else load) as gemv_mgpu's form (split_<mode>.patch) through
# the compiled test_gemv_mgpu.py and the decode profile.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job26b.sh
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
T="python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE"
run "$base" modes 200 python3 benchmarks/wip/split_modes.py --all "$OUT/modes.json"
pack
pick=$(python3 - "$OUT/modes.json" <<'PY'
import json, sys
recs = {r["mode"]: r for r in json.load(open(sys.argv[1])) if r.get("split") == 4}
for mode in ("store_sync", "load"):
    r = recs.get(mode, {})
    if "error" not in r and r.get("m1_max_rel_err", 1) < 1e-2 and r.get("m8_max_rel_err", 1) < 1e-2:
        print(mode); break
PY
)
echo "picked: ${pick:-none}"
if [ -n "$pick" ]; then
  d=$(tree split_$pick)
  run "$d" tests_mgpu 150 $T tests/test_gemv_mgpu.py
  pack
  run "$d" prof_split 80 python3 benchmarks/decode_profile.py --cases decode:1,decode_k:8 --out "$OUT/prof_split.json"
  pack
fi
cat "$OUT/modes.log" | cut -c1-400
grep -hE "passed|failed|FAILED|ERROR" "$OUT"/tests_*.log 2>/dev/null | cut -c1-200
grep -E "^ +[0-9.]+ x|busy" "$OUT/prof_split.log" 2>/dev/null | cut -c1-200
