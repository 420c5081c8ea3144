#!/usr/bin/env bash
# The benchmarks' runner on a GPU machine (the results in benchmarks/results/ came from an H200): build the native
# extension once, then run the steps asked for, in order, each under its own time limit, every JSON and log in OUT_DIR.
#
# Usage: bash benchmarks/run_h200.sh OUT_DIR STEP [STEP ...]
#   build                       the extension only, by the README's first command (every other step builds it
#                               first when needed; $ATTNLIB_FIND_LINKS: a wheel folder for a machine without registry)
#   develop                     the README's second command's install (editable, isolated build) instead
#   sharding[:SECONDS]          tests/gpu_sharding_check.py (mocked topologies, one device, dropout, chunked; the
#                               parts named in $ATTNLIB_SHARDING_PARTS only, if set)
#   stage-cudnn / swap-cudnn    the newest cuDNN from ../shared/tools/device-cudnn.sh's parts: stage .cudnn/partaa
#                               and .cudnn/sha (one call), join .cudnn/partab and swap the libraries in (the next)
#   selfcheck                   python -P -m attnlib (the installed package, from /tmp)
#   tests[:SECONDS]             pytest -m gpu over tests/ (or the node ids / files in $ATTNLIB_TESTS, or listed one
#                               per line in the file $ATTNLIB_TESTS_FILE), in parallel (ATTNLIB_WORKERS, default 12)
#   readme-tests[:SECONDS]      the README's test command, verbatim (its failures listed at the end, also when the time
#                               limit interrupts it: SIGINT, so pytest reports what ran)
#   bench:SCRIPT[:SECONDS]      benchmarks/SCRIPT.py --json OUT_DIR/SCRIPT.json (extra args in $ATTNLIB_ARGS_SCRIPT,
#                               else $ATTNLIB_BENCH_ARGS); SCRIPT@TAG runs SCRIPT again with $ATTNLIB_ARGS_SCRIPT_TAG
#                               into OUT_DIR/SCRIPT_TAG.json
# Example: bash benchmarks/run_h200.sh $OUT tests:300 bench:bench_peers:240 bench:bench_peers@decode:120
#   (with ATTNLIB_ARGS_bench_peers_decode="--suite decode")
#
# Needs jax with CUDA, the build requirements of the README's GPU install (offline, $ATTNLIB_FIND_LINKS must hold a
# cmake wheel too: a pip-installed cmake is an entry-point script that pip's isolated build cannot import, so
# scikit-build-core asks for the wheel; with one there the build took 53 s on 2026-12-06), and tokamax for the peers'
# columns (a directory .whl/xprof_standin, if present, goes on PYTHONPATH: tokamax imports xprof at import time).
# Plan autotuning is off for the tests and the sharding check (ATTNLIB_CUDNN_AUTOTUNE=0: each graph builds one plan;
# autotuning's own test turns it on) and on for the benchmarks.
set -uo pipefail
out=${1:?output directory}; shift
mkdir -p "$out"
root=$(pwd)

# The README's commands' pip install, as pip runs it for a user: isolated build, headers from wheels, the CUDA toolkit
# hidden (CUDA_HOME names no directory). A machine without a registry gets the build requirements and the missing
# header wheels from $ATTNLIB_FIND_LINKS (and the run-time requirements already installed: --no-deps).
pip_install() {
  local how=(env CUDA_HOME=/nonexistent) deps=()
  if [ -n "${ATTNLIB_FIND_LINKS:-}" ]; then how+=(PIP_NO_INDEX=1 "PIP_FIND_LINKS=$ATTNLIB_FIND_LINKS"); deps=(--no-deps); fi
  "${how[@]}" python3 -m pip install -v "${deps[@]}" "$@"
}

build() {
  if [ -e attnlib/_attnlib_ffi*.so ] && [ ! native/src/cudnn_graph.cc -nt attnlib/_attnlib_ffi*.so ]; then
    return 0
  fi
  local start; start=$(date +%s)
  if ! pip_install . > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; return 1
  fi
  grep -E "attnlib build:|Successfully installed" "$out/build.log" | tail -8
  # Tests and benchmarks import attnlib from this tree (the same sources): give it the installed extension.
  local so; so=$(cd /tmp && python3 -P -c "import attnlib._attnlib_ffi as m; print(m.__file__)") || return 1
  cp "$so" attnlib/
  echo "build: $(( $(date +%s) - start )) s"
  (cd /tmp && python3 -P -c "import attnlib._attnlib_ffi as m; print('extension build info', m.build_info())") || return 1
  ldd attnlib/_attnlib_ffi*.so | grep -q "libstdc++" || echo "WARNING: the extension links libstdc++ statically"
}

export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root/.whl/xprof_standin"
export ATTNLIB_CACHE_DIR=${ATTNLIB_CACHE_DIR:-/tmp/attnlib_cache} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
build 2>&1 | tee -a "$out/build_summary.log" | tail -12
[ "${PIPESTATUS[0]}" = 0 ] || exit 1

for step in "$@"; do
  IFS=: read -r kind name seconds <<< "$step"
  case "$kind" in
    build) ;;
    develop)
      rm -f attnlib/_attnlib_ffi*.so
      pip_install -e . > "$out/develop.log" 2>&1 || { tail -30 "$out/develop.log"; exit 1; }
      grep -E "attnlib build:|Successfully installed" "$out/develop.log" | tail -8
      python3 -c "import attnlib, attnlib._attnlib_ffi as m; print('editable:', attnlib.__file__, m.__file__)" ;;
    sharding)
      # shellcheck disable=SC2086
      ATTNLIB_CUDNN_AUTOTUNE="${ATTNLIB_CUDNN_AUTOTUNE:-0}" timeout "${name:-400}" python3 tests/gpu_sharding_check.py \
        --timeout 240 \
        ${ATTNLIB_SHARDING_PARTS:+--only $ATTNLIB_SHARDING_PARTS} 2>&1 | tee "$out/sharding.log" \
        | grep -v "^WARNING:absl" | tail -80 ;;
    stage-cudnn)
      mkdir -p /tmp/cudnn_parts && cp .cudnn/partaa .cudnn/sha /tmp/cudnn_parts/ && echo "cuDNN part 1 staged" ;;
    swap-cudnn)
      cat /tmp/cudnn_parts/partaa .cudnn/partab > /tmp/cudnn.tar.xz
      [ "$(sha256sum /tmp/cudnn.tar.xz | cut -c1-64)" = "$(cut -c1-64 /tmp/cudnn_parts/sha)" ] || { echo "sha mismatch"; exit 4; }
      lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))")
      mkdir -p /tmp/cudnn_image /tmp/cudnn_new && tar -C /tmp/cudnn_new -xJf /tmp/cudnn.tar.xz
      # The installed libraries are kept in /tmp/cudnn_image (`cp /tmp/cudnn_image/* "$lib"/` restores them). With
      # none there, another cuDNN on the machine loads instead (9.14 once, 2026-12-06): stop rather than test that.
      ls "$lib"/libcudnn.so* > /dev/null 2>&1 || { echo "no cuDNN libraries in $lib"; exit 5; }
      mv "$lib"/* /tmp/cudnn_image/ && cp /tmp/cudnn_new/lib/* "$lib"/ || exit 5
      python3 -c "import cudnn; v = cudnn.backend_version(); print('cuDNN backend now', v); assert v >= 92700" \
        || exit 5 ;;
    selfcheck)
      (cd /tmp && timeout 120 python3 -P -m attnlib) 2>&1 | tee "$out/selfcheck.log" ;;
    tests)
      seconds=${name:-400}
      if [ -n "${ATTNLIB_TESTS_FILE:-}" ]; then mapfile -t targets < "$ATTNLIB_TESTS_FILE"
      elif [ -n "${ATTNLIB_TESTS:-}" ]; then read -r -a targets <<< "$ATTNLIB_TESTS"
      else targets=(tests -m gpu); fi
      ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CUDNN_AUTOTUNE="${ATTNLIB_CUDNN_AUTOTUNE:-0}" timeout "$seconds" \
        python3 -m pytest "${targets[@]}" -p no:benchmark -p no:cacheprovider -n "${ATTNLIB_WORKERS:-12}" \
        --dist load -v -rfE --tb=short 2>&1 | tee "$out/gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -60
      echo "PASSED: $(grep -c ' PASSED ' "$out/gpu_tests.log") (a run cut by its time limit lists no summary line)" ;;
    readme-tests)
      (unset XLA_PYTHON_CLIENT_PREALLOCATE ATTNLIB_CACHE_DIR  # as a user's shell has them: tests/conftest.py's defaults
       PYTEST_ADDOPTS="-rfE" timeout -s INT "${name:-540}" python3 -m pytest -q -n auto -m "not full" tests) 2>&1 \
        | tee "$out/readme_tests.log" | grep -v "^\[gw\|^WARNING:absl" | tail -80 ;;
    bench)
      seconds=${seconds:-300}
      script=${name%@*}; run=${name/@/_}  # SCRIPT@TAG: SCRIPT's run named SCRIPT_TAG
      args=(--json "$out/$run.json")
      extra_args="ATTNLIB_ARGS_$run"
      extra_args=${!extra_args:-${ATTNLIB_BENCH_ARGS:-}}
      # shellcheck disable=SC2086
      (cd benchmarks && timeout "$seconds" python3 "$script.py" "${args[@]}" $extra_args) \
        > "$out/$run.log" 2>&1
      grep -v "^WARNING:absl\|^ *%\|^$" "$out/$run.log" | tail -40 ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
done
