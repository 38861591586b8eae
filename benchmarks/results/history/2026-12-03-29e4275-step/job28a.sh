S=$SECONDS
KDA_COMMIT=29e4275 bash benchmarks/wip/job27a.sh
left=$((575 - (SECONDS - S)))
echo "left=$left"
source scripts/gpu_common.sh
if [ $left -gt 120 ]; then
  run "$base" tests_gemv $left python3 -m pytest -q -p no:cacheprovider -p no:warnings -rfE tests/test_gemv.py
  grep -hE "passed|failed" "$OUT/tests_gemv.log" | tail -2
fi
pack
