"""The JAX settings a fused kernel is traced under, whatever the caller set globally.

JAX's bundled Pallas TPU kernels (splash, paged and ragged paged attention) are written for JAX's defaults: 32-bit
index arithmetic, matrix products at the default precision, standard dtype promotion and rank broadcasting. A user's
`jax_enable_x64`, `jax_default_matmul_precision` ("highest" asks Mosaic for a float32 contraction of bfloat16
operands), `jax_numpy_dtype_promotion="strict"` or `jax_numpy_rank_promotion="raise"` breaks them. Each kernel call
is traced inside `as_written()`, which sets these four locally; the caller's settings still govern everything
around the kernel.

Settings are read when a function is traced, so what must run under them is every place a kernel's Python is traced:
the call itself, and what JAX traces later, outside the call's `with` block (a `custom_vjp` backward rule, a
`custom_partitioning` rule run by XLA's partitioner, a `custom_vmap` rule). Arrays attnlib built under the caller's
settings enter the kernel through `narrowed` (under `jax_enable_x64`, an index array may be int64).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def as_written():
    """Trace the enclosed kernel under JAX's default settings (x64 off, default matmul precision, standard dtype
    promotion, rank promotion allowed)."""
    with (
        jax.enable_x64(False),
        jax.default_matmul_precision(None),
        jax.numpy_dtype_promotion("standard"),
        jax.numpy_rank_promotion("allow"),
    ):
        yield


_NARROW = {
    np.dtype("int64"): jnp.int32,
    np.dtype("uint64"): jnp.uint32,
    np.dtype("float64"): jnp.float32,
    np.dtype("complex128"): jnp.complex64,
}


def narrowed(x: jax.Array) -> jax.Array:
    """`x` with a 64-bit dtype cast to its 32-bit kind (int64 -> int32, float64 -> float32), other dtypes unchanged:
    an array attnlib built under the caller's `jax_enable_x64`, where it enters a kernel traced under `as_written()`
    (which has no 64-bit types). Callers keep 64-bit values in range (indices, lengths, scales)."""
    narrow = _NARROW.get(np.dtype(x.dtype))
    return x if narrow is None else x.astype(narrow)
