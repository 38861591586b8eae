#!/usr/bin/env bash
# Session 9's last GPU job (repo root on the device machine; results in $OUT, packed into all.tgz).
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job9b.sh  # decode profiles (decode:1, decode_k:8,
#       # decode:64) of this tree against front_fb64.patch (decode_front's f_b | g_b sweep in
#       # 64-row tiles: 128 programs instead of 512) and front_sweep_first.patch (the sweep's
#       # programs first in the grid, the conv's after them)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal: git on the device reads stale metadata}"
export KDA_COMMIT
source scripts/gpu_common.sh
prof="python3 benchmarks/decode_profile.py"
cases=decode:1,decode_k:8,decode:64
run "$base" prof_base 70 $prof --cases $cases --out "$OUT/prof_base.json"
for p in front_fb64 front_sweep_first; do
  d=$(tree $p) && run "$d" prof_$p 70 $prof --cases $cases --out "$OUT/prof_$p.json"
done
grep -hE '^\{|^ +1.00 x +[0-9.]+ us +kda_decode_front' "$OUT"/prof_*.log | cut -c1-110
(cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
