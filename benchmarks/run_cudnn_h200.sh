#!/usr/bin/env bash
# Builds the native extension and runs the cuDNN GPU tests and benchmark on a GPU machine (the H200 device).
# Usage: bash benchmarks/run_cudnn_h200.sh OUT_DIR [tests|bench|all|smoke|ragged] [pytest or benchmark args...]
# ragged: the dense and ragged/paged GPU tests in parallel (pytest-xdist, ATTNLIB_WORKERS, default 8; extra args go
# to pytest; pytest-benchmark is disabled, it aborts the session under xdist), then benchmarks/bench_cudnn_ragged.py.
# ATTNLIB_CXX=default keeps the image's compiler (to check the libstdc++ link guard); ATTNLIB_BUILD_TYPE sets the build.
set -uo pipefail
out=${1:?output directory}; what=${2:-all}; shift 2 || true
mkdir -p "$out"
root=$(pwd)
if [ ! -e attnlib/_attnlib_ffi*.so ] || [ native/src/cudnn_graph.cc -nt attnlib/_attnlib_ffi*.so ]; then
  start=$(date +%s)
  rm -rf /tmp/attnlib_wheel build/cp3*-linux_x86_64
  # The device image's default /opt/gcc/bin/g++ links libstdc++ statically, and iostreams inside the cuDNN frontend
  # then crash in the JAX process (measured). Use the system compiler, which links the process's libstdc++.so.
  if [ "${ATTNLIB_CXX:-system}" = system ]; then
    for cxx in /usr/bin/g++-13 /usr/bin/g++; do
      if [ -x "$cxx" ]; then export CXX=$cxx; break; fi
    done
  fi
  echo "compiler: ${CXX:-default}"; ls -la /usr/bin/g++* /opt/gcc/bin/g++ 2>/dev/null | head -5
  if ! python3 -m pip wheel -v --no-build-isolation --no-deps \
       -C cmake.build-type="${ATTNLIB_BUILD_TYPE:-Release}" . -w /tmp/attnlib_wheel > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; exit 1
  fi
  python3 - "$root" <<'PY'
import glob, sys, zipfile
z = zipfile.ZipFile(glob.glob("/tmp/attnlib_wheel/attnlib*.whl")[0])
for name in z.namelist():
    if "_attnlib_ffi" in name and name.endswith(".so"):
        z.extract(name, sys.argv[1]); print("extracted", name)
PY
  echo "build: $(( $(date +%s) - start )) s"; grep "attnlib:" "$out/build.log" | head -8
fi
# attnlib's metadata (its __version__) from the wheel; the code itself is imported from this tree.
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/attnlib_meta /tmp/attnlib_wheel/attnlib*.whl || exit 1
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/attnlib_meta"
python3 -c "import attnlib._attnlib_ffi as m; print('extension FE version', m.frontend_version())" || exit 1
if [ "$what" = smoke ]; then
  timeout 200 cuda-gdb -q -batch -ex run -ex "bt 14" --args python3 benchmarks/smoke_cudnn.py 2>&1 \
    | grep -v "^\[New Thread\|^\[Thread\|libthread_db\|^$\|Detaching" | tail -24 | cut -c1-300
fi
ldd attnlib/_attnlib_ffi*.so | grep "libstdc++" || echo "WARNING: the extension links libstdc++ statically"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 100 python3 benchmarks/smoke_cudnn.py || exit 1
  ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CACHE_DIR=/tmp/attnlib_cache timeout 400 python3 -m pytest tests/test_cudnn_gpu.py \
    -q -rfE --tb=short -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  [ "$what" = bench ] && bench_args=("$@") || bench_args=()
  ATTNLIB_CACHE_DIR=/tmp/attnlib_cache timeout 300 python3 benchmarks/bench_cudnn.py --json "$out/bench_cudnn.json" \
    "${bench_args[@]}" 2>&1 | tee "$out/bench.log" | tail -30
fi
if [ "$what" = ragged ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false ATTNLIB_REQUIRE_GPU=1 ATTNLIB_CACHE_DIR=/tmp/attnlib_cache \
    timeout "${ATTNLIB_TEST_TIMEOUT:-400}" python3 -m pytest tests/test_cudnn_ragged_gpu.py tests/test_cudnn_gpu.py \
    -v -rfE --tb=short -p no:cacheprovider -p no:benchmark -n "${ATTNLIB_WORKERS:-8}" "$@" 2>&1 | tee "$out/gpu_tests.log" \
    | grep -v " PASSED " | tail -120
  grep -c " PASSED " "$out/gpu_tests.log"
  ATTNLIB_CACHE_DIR=/tmp/attnlib_cache timeout "${ATTNLIB_BENCH_TIMEOUT:-300}" python3 benchmarks/bench_cudnn_ragged.py \
    --json "$out/bench_cudnn_ragged.json" --table "$out/bench_cudnn_ragged.txt" 2>&1 | tee "$out/bench_ragged.log" \
    | tail -30
fi
