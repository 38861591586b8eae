#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from the repository root: every test file compiled, then the
# benchmarks, whose records merge into benchmarks/results/, then the results tables.
#   bash scripts/gpu_check.sh [tests|bench|all] [LOGDIR]      (defaults: all, gpu-logs)
# The FLA peers need `pip install fla-core==0.6.0`; without it their figures are null.
# Every step has its own time limit and logs as it goes, so a run cut short keeps what finished.
set -uo pipefail
what=${1:-all}
logs=${2:-gpu-logs}
mkdir -p "$logs"
py=.venv/bin/python
[ -x "$py" ] || py=python3
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # FLA shares the GPU with JAX
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
step() {  # step NAME SECONDS CMD...: one step, its log in $logs/NAME.log, its last line printed
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1 || rc=1
  echo "$name: $(tail -n 1 "$logs/$name.log")"
}
if [ "$what" = tests ] || [ "$what" = all ]; then
  for f in tests/test_*.py; do  # one pytest per file: a slow file cannot starve the others
    step "$(basename "$f" .py)" 600 "$py" -m pytest -q -p no:cacheprovider --tb=short -rfE "$f"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in prefill packed decode gemv sharding; do
    step "bench_$b" 1800 "$py" "benchmarks/bench_$b.py"
  done
  step bench_decode_pool 1800 "$py" benchmarks/bench_decode.py --pool
  step decode_profile 600 "$py" benchmarks/decode_profile.py --cases core:1,core:8,core:64
  "$py" scripts/make_results_table.py || rc=1
fi
exit $rc
