#!/usr/bin/env bash
# Score modifiers on the H200: build the extension, run the score-modifier GPU tests (plus, unless
# ATTNLIB_REGRESSION=0, the dense cuDNN GPU tests as a regression check), then benchmarks/bench_score_mod.py with the
# peers. Needs the wheels of ../shared/tools/device-wheels.sh --peers in .whl and the xprof stand-in in
# .whl/xprof_standin (tokamax imports it). Everything is logged to OUT_DIR.
# Usage: bash benchmarks/run_score_mod_h200.sh OUT_DIR [tests seconds] [bench seconds]
set -uo pipefail
out=${1:?output directory}; tests_s=${2:-300}; bench_s=${3:-240}
mkdir -p "$out"
bash benchmarks/run_cudnn_h200.sh "$out" build > "$out/build_summary.log" 2>&1 || { tail -20 "$out/build_summary.log"; exit 1; }
tail -2 "$out/build_summary.log"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta:$PWD/.whl/xprof_standin" ATTNLIB_CACHE_DIR=/tmp/attnlib_cache
tests=(tests/test_score_mod_gpu.py)
[ "${ATTNLIB_REGRESSION:-1}" = 1 ] && tests+=(tests/test_cudnn_gpu.py)
if [ "$tests_s" != 0 ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 timeout "$tests_s" python3 -m pytest "${tests[@]}" \
    -p no:cacheprovider -p no:benchmark -n "${ATTNLIB_WORKERS:-8}" -v -rfE --tb=short ${ATTNLIB_PYTEST_ARGS:-} 2>&1 \
    | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40
fi
if [ "$bench_s" != 0 ]; then
  timeout "$bench_s" python3 benchmarks/bench_score_mod.py --json "$out/bench_score_mod.json" > "$out/bench.log" 2>&1
  tail -30 "$out/bench.log"
fi
