#!/usr/bin/env bash
# One H200 job: compiled GPU tests, then the benchmarks; results land under $OUT.
# Usage (device machine, repo root): bash scripts/gpu_job.sh [tests|bench|all] [pytest args...]
# Needs fla-core 0.6.0 as a wheel in .whl/ for the FLA baselines (see benchmarks/README.md).
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -p no:cacheprovider --timeout=300 "$@" tests 2>&1 | tee "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in gemv decode prefill; do
    [ -f benchmarks/bench_$b.py ] || continue
    timeout 240 python3 benchmarks/bench_$b.py --out "$OUT/bench_$b.json" 2>&1 | tee "$OUT/bench_$b.log" | grep -v Warning
  done
fi
exit $rc
