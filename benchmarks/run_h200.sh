#!/usr/bin/env bash
# The benchmarks' runner on a GPU machine (the results in benchmarks/results/ came from an H200): build the native
# extension once, then run the steps asked for, in order, each under its own time limit, every JSON and log in OUT_DIR.
#
# Usage: bash benchmarks/run_h200.sh OUT_DIR STEP [STEP ...]
#   build                       the extension only (every other step builds it first when needed)
#   selfcheck                   python -m attnlib
#   tests[:SECONDS]             pytest -m gpu over tests/ (or the node ids / files in $ATTNLIB_TESTS, or listed one
#                               per line in the file $ATTNLIB_TESTS_FILE), in parallel (ATTNLIB_WORKERS, default 12)
#   bench:SCRIPT[:SECONDS]      benchmarks/SCRIPT.py --json OUT_DIR/SCRIPT.json (extra args in $ATTNLIB_ARGS_SCRIPT,
#                               else $ATTNLIB_BENCH_ARGS)
# Example: bash benchmarks/run_h200.sh $OUT tests:300 bench:bench_peers:240 bench:bench_decode:120
#
# Needs jax with CUDA, the build requirements of the README's GPU install, and tokamax for the peers' columns (a
# directory .whl/xprof_standin, if present, goes on PYTHONPATH: tokamax imports xprof at import time).
# Plan autotuning is off for the tests (ATTNLIB_CUDNN_AUTOTUNE=0: each graph builds one plan; its own test turns it
# on) and on for the benchmarks.
set -uo pipefail
out=${1:?output directory}; shift
mkdir -p "$out"
root=$(pwd)

build() {
  if [ -e attnlib/_attnlib_ffi*.so ] && [ ! native/src/cudnn_graph.cc -nt attnlib/_attnlib_ffi*.so ] \
     && [ -d /tmp/attnlib_meta ]; then
    return 0
  fi
  local start; start=$(date +%s)
  rm -rf /tmp/attnlib_wheel build/cp3*-linux_x86_64
  # The device image's default /opt/gcc/bin/g++ links libstdc++ statically, and iostreams inside the cuDNN frontend
  # then crash in the JAX process (measured). Use the system compiler, which links the process's libstdc++.so.
  if [ "${ATTNLIB_CXX:-system}" = system ]; then
    for cxx in /usr/bin/g++-13 /usr/bin/g++; do
      if [ -x "$cxx" ]; then export CXX=$cxx; break; fi
    done
  fi
  if ! python3 -m pip wheel -v --no-build-isolation --no-deps \
       -C cmake.build-type="${ATTNLIB_BUILD_TYPE:-Release}" . -w /tmp/attnlib_wheel > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; return 1
  fi
  python3 - "$root" <<'PY'
import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob("/tmp/attnlib_wheel/attnlib*.whl")[0])
for name in z.namelist():
    if "_attnlib_ffi" in name and name.endswith(".so"):
        z.extract(name, sys.argv[1]); print("extracted", name)
PY
  # attnlib's metadata (its __version__) from the wheel; the code itself is imported from this tree.
  python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/attnlib_meta /tmp/attnlib_wheel/attnlib*.whl \
    || return 1
  echo "build: $(( $(date +%s) - start )) s (compiler ${CXX:-default})"
  python3 -c "import attnlib._attnlib_ffi as m; print('extension FE version', m.frontend_version())" || return 1
  ldd attnlib/_attnlib_ffi*.so | grep -q "libstdc++" || echo "WARNING: the extension links libstdc++ statically"
}

export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta:$root/.whl/xprof_standin"
export ATTNLIB_CACHE_DIR=${ATTNLIB_CACHE_DIR:-/tmp/attnlib_cache} XLA_PYTHON_CLIENT_PREALLOCATE=false
build 2>&1 | tee -a "$out/build_summary.log" | tail -4
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

for step in "$@"; do
  IFS=: read -r kind name seconds <<< "$step"
  case "$kind" in
    build) ;;
    selfcheck)
      timeout 90 python3 -m attnlib 2>&1 | tee "$out/selfcheck.log" ;;
    tests)
      seconds=${name:-400}
      if [ -n "${ATTNLIB_TESTS_FILE:-}" ]; then mapfile -t targets < "$ATTNLIB_TESTS_FILE"
      elif [ -n "${ATTNLIB_TESTS:-}" ]; then read -r -a targets <<< "$ATTNLIB_TESTS"
      else targets=(tests -m gpu); fi
      ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CUDNN_AUTOTUNE="${ATTNLIB_CUDNN_AUTOTUNE:-0}" timeout "$seconds" \
        python3 -m pytest "${targets[@]}" -p no:benchmark -p no:cacheprovider -n "${ATTNLIB_WORKERS:-12}" \
        --dist load -v -rfE --tb=short 2>&1 | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -60
      echo "PASSED: $(grep -c ' PASSED ' "$out/gpu_tests.log") (a run cut by its time limit lists no summary line)" ;;
    bench)
      seconds=${seconds:-300}
      args=(--json "$out/$name.json")
      # shellcheck disable=SC2086
      extra_args="ATTNLIB_ARGS_$name"
      extra_args=${!extra_args:-${ATTNLIB_BENCH_ARGS:-}}
      # shellcheck disable=SC2086
      (cd benchmarks && timeout "$seconds" python3 "$name.py" "${args[@]}" $extra_args) \
        > "$out/$name.log" 2>&1
      grep -v "^WARNING:absl\|^ *%\|^$" "$out/$name.log" | tail -40 ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
done
