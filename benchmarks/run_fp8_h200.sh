#!/usr/bin/env bash
# FP8 attention on the H200: build the extension, run the FP8 GPU tests (tests/test_fp8_gpu.py), then
# benchmarks/bench_fp8.py. Needs the wheels of ../shared/tools/device-wheels.sh in .whl. Everything is logged to OUT_DIR.
# Usage: bash benchmarks/run_fp8_h200.sh OUT_DIR [tests seconds] [bench seconds]
set -uo pipefail
out=${1:?output directory}; tests_s=${2:-240}; bench_s=${3:-300}
mkdir -p "$out"
bash benchmarks/run_cudnn_h200.sh "$out" build > "$out/build_summary.log" 2>&1 || { tail -20 "$out/build_summary.log"; exit 1; }
tail -2 "$out/build_summary.log"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta" ATTNLIB_CACHE_DIR=/tmp/attnlib_cache
if [ "$tests_s" != 0 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 timeout "$tests_s" python3 -m pytest tests/test_fp8_gpu.py \
    -p no:cacheprovider -p no:benchmark -n "${ATTNLIB_WORKERS:-8}" -v -rfE --tb=short ${ATTNLIB_PYTEST_ARGS:-} 2>&1 \
    | tee "$out/gpu_tests_fp8.log" | grep -E "FAILED|ERROR|passed|failed|Error" | tail -40
fi
if [ "$bench_s" != 0 ]; then
  timeout "$bench_s" python3 benchmarks/bench_fp8.py --json "$out/bench_fp8.json" ${ATTNLIB_BENCH_ARGS:-} \
    > "$out/bench_fp8.log" 2>&1
  grep -v "^llama\|^b[0-9]" "$out/bench_fp8.log" | tail -60
fi
