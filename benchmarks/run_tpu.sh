#!/usr/bin/env bash
# The TPU runner (a TPU v5e through the device tool): install what the machine lacks, then run the steps asked for,
# in order, each under its own time limit, every JSON and log in OUT_DIR.
#
# Usage: bash benchmarks/run_tpu.sh OUT_DIR STEP [STEP ...]     (from the repository root: pyenv picks Python there)
#   tests[:SECONDS]             pytest -m tpu over the TPU test files (or the node ids / files in $ATTNLIB_TESTS),
#                               ATTNLIB_REQUIRE_TPU=1: a missing TPU fails them instead of skipping
#   bench:SCRIPT[:SECONDS]      benchmarks/SCRIPT.py --json OUT_DIR/SCRIPT.json (extra args in $ATTNLIB_ARGS_SCRIPT);
#                               SCRIPT@TAG runs SCRIPT again with $ATTNLIB_ARGS_SCRIPT_TAG into OUT_DIR/SCRIPT_TAG.json
# Example: bash benchmarks/run_tpu.sh $OUT tests:240 bench:bench_tpu_decode:120 bench:bench_tpu:400
#
# The machine has jax/jaxlib and libtpu (on a preset PYTHONPATH: this script appends to it, never replaces it) and
# no registry. The pure-Python wheels it lacks travel in .whl-tpu (carry it), fetched here with:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
#     --platform any -d .whl-tpu jaxtyping wadler-lindig beartype equinox dm-haiku jmp tabulate optax chex toolz
# absl-py comes from the machine's own wheel index (/opt/pypi), as the device tool's TPU page says.
set -uo pipefail
out=${1:?output directory}; shift
mkdir -p "$out"
site=/tmp/attnlib-site
if [ ! -d "$site" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl-tpu/*.whl || exit 1
  PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --isolated --no-deps --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target "$site" absl-py || echo "absl-py not installed (Haiku needs it)"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$(pwd)" PYTHONUNBUFFERED=1
python3 -c "import jax, attnlib; print('jax', jax.__version__, jax.devices()); print('attnlib from', attnlib.__file__)" \
  2>&1 | tee "$out/env.log" | grep -v "^WARNING"

for step in "$@"; do
  IFS=: read -r kind name seconds <<< "$step"
  case "$kind" in
    tests)
      seconds=${name:-300}
      if [ -n "${ATTNLIB_TESTS:-}" ]; then read -r -a targets <<< "$ATTNLIB_TESTS"
      else targets=(tests/test_pallas_tpu.py tests/test_pallas_tpu_paged.py tests/test_layers_tpu.py); fi
      ATTNLIB_REQUIRE_TPU=1 timeout "$seconds" python3 -m pytest -q -m tpu "${targets[@]}" -p no:cacheprovider -rfE \
        --tb=short 2>&1 | tee "$out/tpu_tests.log" | grep -E "FAILED|ERROR|passed|failed" | tail -40 ;;
    bench)
      seconds=${seconds:-300}
      script=${name%@*}; run=${name/@/_}  # SCRIPT@TAG: SCRIPT's run named SCRIPT_TAG
      extra_args="ATTNLIB_ARGS_$run"
      # shellcheck disable=SC2086
      timeout "$seconds" python3 "benchmarks/$script.py" --json "$out/$run.json" ${!extra_args:-} > "$out/$run.log" 2>&1
      grep -v "^WARNING\|^ *%\|^$" "$out/$run.log" | tail -30 ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
done
