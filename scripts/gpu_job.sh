#!/usr/bin/env bash
# One H200 job: compiled GPU tests and/or the benchmarks; logs and JSON records land in $OUT.
#   bash scripts/gpu_job.sh tests|bench|all   (repo root, on the device machine)
# Every step has its own time limit and writes as it goes, so a job cut short still returns
# what finished. fla-core 0.6.0 (FLA baselines) is installed from a carried .whl/ if present.
set -uo pipefail
what=${1:-all}
source scripts/gpu_common.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  # One pytest per file (a slow file cannot starve the others), all logged to one file: the
  # device tool returns at most 8 files.
  for f in tests/test_*.py; do
    echo "=== $f" >> "$OUT/gpu_tests.log"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:warnings --tb=short -rfE "$f" \
      > /tmp/one.log 2>&1 || rc=1
    cat /tmp/one.log >> "$OUT/gpu_tests.log"
    echo "$f: $(tail -n 1 /tmp/one.log)"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in prefill decode gemv; do
    timeout 360 python3 benchmarks/bench_$b.py --quick --out "$OUT/bench_$b.json" \
      > "$OUT/bench_$b.log" 2>&1 || rc=1
    grep -E "^(prefill|decode|chunk|gemv)" "$OUT/bench_$b.log" | head -40
  done
fi
exit $rc
