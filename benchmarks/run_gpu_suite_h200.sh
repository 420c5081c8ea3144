#!/usr/bin/env bash
# Every GPU-marked test on the H200 in one go: build the extension, run the self-check (`python -m attnlib`), then
# `pytest -m gpu` over the whole test suite in parallel (pytest-xdist; pytest-benchmark is disabled, it aborts the
# session under xdist), verbose so that a run cut short still reports each finished test.
# Usage: bash benchmarks/run_gpu_suite_h200.sh OUT_DIR [pytest seconds] [pytest args...]
set -uo pipefail
out=${1:?output directory}; seconds=${2:-420}; shift 2 || true
bash benchmarks/run_cudnn_h200.sh "$out" build > "$out/build_summary.log" 2>&1 || { tail -20 "$out/build_summary.log"; exit 1; }
tail -3 "$out/build_summary.log"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta"  # attnlib's metadata, installed by the build step
timeout 90 python3 -m attnlib 2>&1 | tee "$out/selfcheck.log"
# Plan autotuning only picks among plans that compute the same function (its own test turns it on); off here, each
# graph builds one plan and the suite spends its time on the checks.
XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CACHE_DIR=/tmp/attnlib_cache \
  ATTNLIB_CUDNN_AUTOTUNE="${ATTNLIB_CUDNN_AUTOTUNE:-0}" timeout "$seconds" \
  python3 -m pytest tests -m gpu -p no:benchmark -p no:cacheprovider -n "${ATTNLIB_WORKERS:-8}" --dist load -v -rfE \
  --tb=short "$@" 2>&1 | tee "$out/gpu_tests.log" | grep -v " PASSED " | tail -80
echo "PASSED: $(grep -c " PASSED " "$out/gpu_tests.log")"
