"""Test configuration: strict promotion, the `gpu` and `tpu` markers and their skip / require logic, the `full` tier
of sweeps.

Never import attnlib at the top of this file (the jaxtyping pytest hook must see it first).
"""

import importlib.metadata
import importlib.util
import os

import jax
import pytest


# Tiny CPU programs: LLVM's optimisation dominates their compile time and changes nothing a test checks (as in the
# simulated-device subprocesses, `helpers.run_pytest_on_simulated_devices`). Set before JAX starts a backend.
_XLA_FLAGS = " --xla_backend_optimization_level=0"
# And XLA:CPU's elemental emitters compile them in about half the time of its MLIR fusion emitters (measured on the
# conformance suite with jaxlib 0.10.2: 93 -> 47 CPU-s); the code they emit computes the same HLO. jaxlib 0.12 removed
# the flag with the elemental route (an unknown flag aborts JAX's start), so only where it is known to exist.
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    _XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + _XLA_FLAGS).strip()
# On a GPU machine `-n auto` starts one worker per core on one GPU: none may take most of its memory up front
# (JAX's default), and each cuDNN graph builds the heuristics' first plan (autotuning's own tests turn it on).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("ATTNLIB_CUDNN_AUTOTUNE", "0")

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


IMPLS = ["xla", "xla_chunked-bk5"]


@pytest.fixture(params=IMPLS)
def impl(request):
    """Each plain-JAX implementation; `xla_chunked` with 5-key blocks, so several (and ragged) blocks run."""
    if request.param == "xla":
        return "xla"
    import attnlib

    return attnlib.XlaChunked(block_k=5)


@pytest.fixture(autouse=True)
def _host_tests_run_on_the_cpu(request):
    """On a GPU or TPU machine the tests without a device marker (the plain-JAX implementations, the CPU emulation of
    cuDNN, interpret-mode kernels) run on its CPU, as on a CPU-only machine: under `jax.default_device`, which
    attnlib's dispatch follows (`attnlib/_src/backends/placement.py`)."""
    if jax.default_backend() == "cpu" or "gpu" in request.keywords or "tpu" in request.keywords:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _gpu_unavailable_reason() -> str | None:
    try:
        if not any(d.platform == "gpu" for d in jax.devices()):
            return "no CUDA GPU visible to JAX"
    except RuntimeError as e:  # pragma: no cover - backend init failure
        return f"JAX could not initialise a GPU backend: {e}"
    try:
        from attnlib._src.backends.cudnn import ffi
    except ImportError as e:  # pragma: no cover
        return f"attnlib's FFI module failed to import: {e}"
    reason = ffi.unavailable_reason()
    if reason is not None:
        return reason
    return None


def _tpu_unavailable_reason() -> str | None:
    try:
        if not any(d.platform == "tpu" for d in jax.devices()):
            return "no TPU visible to JAX"
    except RuntimeError as e:  # pragma: no cover - backend init failure
        return f"JAX could not initialise a TPU backend: {e}"
    return None


def _libtpu_unavailable_reason() -> str | None:
    if importlib.util.find_spec("libtpu") is None:
        return 'libtpu is not installed (`pip install "jax[tpu]"`: JAX then compiles for a TPU without one)'
    if _tpu_unavailable_reason() is None:
        return "a TPU is attached: the `tpu` tests run the kernels themselves"
    return None


def _skip_without(items, marker: str, reason_fn, require_env: str) -> None:
    """Skip the `marker` tests when `reason_fn()` says the device is missing; `require_env=1` makes that an error."""
    marked = [item for item in items if marker in item.keywords]
    if not marked:
        return
    reason = reason_fn()
    if reason is None:
        return
    if os.environ.get(require_env) == "1":
        raise pytest.UsageError(f"{require_env}=1 but {marker.upper()} tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=f"{marker} test: {reason}")
    for item in marked:
        item.add_marker(skip)


SWEEP_FILES = frozenset({
    "test_cudnn_ragged.py", "test_cudnn_dense_emulated.py", "test_score_mod_emulated.py", "test_fp8_cudnn_emulated.py",
    "test_dropout.py", "test_score_mod.py", "test_equinox.py", "test_haiku.py", "test_transforms.py",
    "test_fp8.py", "test_row_fill.py", "test_max_logit.py", "test_paged_cache.py", "test_xla_chunked.py",
    "test_debug_nans.py", "test_traced_scale.py",
})  # fmt: skip
"""Files of parametrized sweeps: the first case of each sweep runs in the fast tier, the others in the full matrix
(`-m full`). `test_conformance.py` runs every feature on every implementation in the fast tier."""


def _mark_sweeps_full(items) -> None:
    seen = set()
    for item in items:
        if item.path.name not in SWEEP_FILES or getattr(item, "callspec", None) is None:
            continue
        sweep = (item.path.name, item.originalname)
        if sweep in seen:
            item.add_marker(pytest.mark.full)
        seen.add(sweep)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _mark_sweeps_full(items)
    _skip_without(items, "gpu", _gpu_unavailable_reason, "ATTNLIB_REQUIRE_GPU")
    _skip_without(items, "tpu", _tpu_unavailable_reason, "ATTNLIB_REQUIRE_TPU")
    _skip_without(items, "tpu_compile", _libtpu_unavailable_reason, "ATTNLIB_REQUIRE_LIBTPU")
