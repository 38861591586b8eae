#!/usr/bin/env bash
# GPU jobs of session 5 (repo root on the device machine; results in $OUT).
#   bash benchmarks/wip/next_gpu_job.sh knobs   # the prepare knobs of 7d24179 (.gpu/base.tar,
#                                               # `git archive 7d24179`), alone and with
#                                               # prepare_latency.patch
#   bash benchmarks/wip/next_gpu_job.sh final   # this tree: compiled test_chunk, the core
#                                               # records against FLA, then bench_decode --quick
set -uo pipefail
what=${1:?knobs or final}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
run() {  # run DIR LABEL SECONDS CMD...: one step in a tree, with its own time limit
  local dir=$1 label=$2 limit=$3; shift 3
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$OUT/$label.log" 2>&1
  echo "$label: rc=$? $(tail -n 1 "$OUT/$label.log")"
}
if [ "$what" = knobs ]; then
  base=/tmp/base_tree; wip=/tmp/wip_tree
  rm -rf "$base" "$wip"; mkdir -p "$base"; tar -xf .gpu/base.tar -C "$base" || exit 1
  cp -r "$base" "$wip"
  (cd "$wip" && patch -s -p1 < "$OLDPWD/benchmarks/wip/prepare_latency.patch") || exit 1
  run "$base" knobs 300 python3 benchmarks/stage_profile.py --scan-configs none \
    --configs default,num_warps=2,num_stages=2,wu_block_k=32,wu_block_k=64,diag_warps=2 \
    --out "$OUT/knobs.json"
  run "$wip" latency 170 python3 benchmarks/stage_profile.py --scan-configs none \
    --configs default,num_warps=2,num_warps=2+diag_warps=2+wu_block_k=32 --out "$OUT/latency.json"
  grep -hE "^chunk" "$OUT"/knobs.log "$OUT"/latency.log
else
  run "$PWD" tests_chunk 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE \
    tests/test_chunk.py
  run "$PWD" bench_prefill 230 python3 benchmarks/bench_prefill.py --quick --core-only \
    --out "$OUT/bench_prefill.json"
  grep -E "^prefill" "$OUT/bench_prefill.log"
  run "$PWD" bench_decode 150 python3 benchmarks/bench_decode.py --quick \
    --out "$OUT/bench_decode.json"
  grep -E "^decode" "$OUT/bench_decode.log"
fi
