#!/usr/bin/env bash
# Build, re-run chosen GPU tests (pytest node ids in $ATTNLIB_TESTS, space separated), probe which rows cuDNN leaves
# unwritten (ATTNLIB_PROBE=1), then the ragged (with a per-kernel profile) and the dense cuDNN benchmarks, each under
# its own time limit (0 skips it), everything logged to OUT_DIR.
# Usage: ATTNLIB_TESTS="..." bash benchmarks/run_bench_h200.sh OUT_DIR [dense seconds] [ragged seconds]
set -uo pipefail
out=${1:?output directory}; dense_s=${2:-270}; ragged_s=${3:-150}
bash benchmarks/run_cudnn_h200.sh "$out" build > "$out/build_summary.log" 2>&1 || { tail -20 "$out/build_summary.log"; exit 1; }
tail -2 "$out/build_summary.log"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta" ATTNLIB_CACHE_DIR=/tmp/attnlib_cache
if [ -n "${ATTNLIB_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 timeout "${ATTNLIB_TESTS_S:-150}" python3 -m pytest \
    $ATTNLIB_TESTS -p no:benchmark -p no:cacheprovider -n 8 -v -rfE --tb=short 2>&1 | tee "$out/gpu_tests_rerun.log" \
    | grep -E "FAILED|ERROR|passed|failed" | tail -30
fi
if [ "${ATTNLIB_PROBE:-0}" = 1 ]; then
  timeout 120 python3 benchmarks/probe_unwritten_rows.py --json "$out/probe_unwritten_rows.json" 2>&1 | tail -40
fi
if [ "$ragged_s" != 0 ]; then
  timeout "$ragged_s" python3 benchmarks/bench_cudnn_ragged.py --json "$out/bench_cudnn_ragged.json" \
    --table "$out/bench_cudnn_ragged.txt" --dump-hlo "$out/hlo" --profile > "$out/bench_ragged.log" 2>&1
  tail -80 "$out/bench_ragged.log"
fi
if [ "$dense_s" != 0 ]; then
  timeout "$dense_s" python3 benchmarks/bench_cudnn.py --json "$out/bench_cudnn.json" --dump-hlo "$out/hlo" \
    > "$out/bench.log" 2>&1
  tail -32 "$out/bench.log"
fi
# At most 8 files come back from the device: the compiled HLO travels as one archive.
if [ -d "$out/hlo" ]; then tar czf "$out/hlo.tgz" -C "$out" hlo && rm -rf "$out/hlo"; fi
