#!/usr/bin/env bash
# Session 24, call 1: programmatic dependent launch (PDL). jaxlib 0.11.2 knows the XLA flags
# xla_gpu_enable_pdl (griddepcontrol.wait at kernel entry) and xla_gpu_enable_pdl_launch (the
# launch attribute that lets a kernel start while the one before drains). The B=1 decode step is
# 7 launches with ~2.6 us of gaps between them: time main's decode with both flags off and on,
# by device time (decode_profile) and by wall clock (stack_decode, 1 and 4 blocks), then run the
# compiled block tests under the flags on.
#   KDA_COMMIT=abc1234 bash benchmarks/wip/job36a.sh          (~520 s of one call)
set -uo pipefail
: "${KDA_COMMIT:?pass the commit as a literal}"
export KDA_COMMIT
source scripts/gpu_common.sh
OFF="--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"
ON="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
run "$base" probe_on 60 env XLA_FLAGS="$ON" python3 -c "import jax, jax.numpy as jnp; print(jax.__version__, jax.devices(), float(jnp.ones(4).sum()))"
PROF="python3 benchmarks/decode_profile.py --cases decode:1,decode_k:8,decode:64"
run "$base" prof_off 100 env XLA_FLAGS="$OFF" $PROF --out "$OUT/prof_off.json"
run "$base" prof_on 100 env XLA_FLAGS="$ON" $PROF --out "$OUT/prof_on.json"
pack
ST="python3 benchmarks/wip/stack_decode.py --layers 1,4 --batches 1,64 --n 128 --reps 7"
run "$base" stack_off 90 env XLA_FLAGS="$OFF" $ST --out "$OUT/stack_off.json"
run "$base" stack_on 90 env XLA_FLAGS="$ON" $ST --out "$OUT/stack_on.json"
pack
run "$base" t_fwd_on 120 env XLA_FLAGS="$ON" python3 -m pytest -q -x tests/test_forward_pallas.py
pack
cat "$OUT/probe_on.log" | tail -n 2
grep -hE "busy|x " "$OUT"/prof_off.log "$OUT"/prof_on.log | cut -c1-150
grep -hE "per block" "$OUT"/stack_off.log "$OUT"/stack_on.log
tail -n 3 "$OUT/t_fwd_on.log"
