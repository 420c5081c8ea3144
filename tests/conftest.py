"""Test configuration: strict promotion, the `gpu` marker and its skip / require logic, the `full` tier of sweeps.

Never import attnlib at the top of this file (the jaxtyping pytest hook must see it first).
"""

import os

import jax
import pytest


# Tiny CPU programs: LLVM's optimisation dominates their compile time and changes nothing a test checks (as in the
# simulated-device subprocesses, `helpers.run_pytest_on_simulated_devices`). Set before JAX starts a backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

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
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("ATTNLIB_REQUIRE_GPU") == "1":
        raise pytest.UsageError(f"ATTNLIB_REQUIRE_GPU=1 but GPU tests cannot run: {reason}")
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
