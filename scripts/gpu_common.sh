# Sourced by the GPU job scripts (scripts/gpu_job.sh, benchmarks/wip/*.sh), repo root as the
# working directory, on the device machine: $OUT, the environment, fla-core from a carried
# .whl/ (FLA baselines), PYTHONPATH, and the step helpers.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
base=$PWD
export PYTHONPATH=$base
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$base
fi

run() {  # run DIR LABEL SECONDS CMD...: one step in a tree, its own time limit, log in $OUT
  local dir=$1 label=$2 limit=$3; shift 3
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "$limit" "$@") > "$OUT/$label.log" 2>&1
  local rc=$?
  echo "$label: rc=$rc $(tail -n 1 "$OUT/$label.log")"
  return $rc
}

tree() {  # tree NAME: a copy of this tree with benchmarks/wip/NAME.patch applied; prints its path
  local dir=/tmp/tree_$1
  rm -rf "$dir"; cp -r "$base" "$dir"
  (cd "$dir" && patch -s -p1 < "benchmarks/wip/$1.patch") || return 1
  echo "$dir"
}

pack() {  # pack: every log and JSON under $OUT into $OUT/all.tgz (few files come back per call)
  (cd "$OUT" && tar czf all.tgz ./*.log ./*.json 2>/dev/null)
}
