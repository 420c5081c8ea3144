"""Test configuration: strict promotion, the `gpu` marker and its skip / require logic.

Never import attnlib at the top of this file (the jaxtyping pytest hook must see it first).
"""

import os

import jax
import pytest


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


def pytest_collection_modifyitems(config, items):
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
