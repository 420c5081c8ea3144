"""The matrix-product precision a call asks for: JAX's `jax_default_matmul_precision` (config or context manager),
read when the call is traced, as `jnp.matmul` reads it.

JAX's convention: a float32 product runs at the device's default precision unless the user asks for more. On a TPU
the default is one bfloat16 pass; `"highest"` / `"float32"` ask for full float32 products, `"high"` /
`"bfloat16_3x"` for three passes. attnlib's fused TPU kernels run float32 at the default; a call asking for more is
served where it can be (docs/semantics.md, "Precision").
"""

import jax


DEFAULT_NAMES = frozenset({"default", "fastest", "bfloat16"})
"""The values of `jax_default_matmul_precision` that ask for no more than the device's default precision."""


def requested() -> str | None:
    """The caller's `jax_default_matmul_precision` now: None for the device's default, else its name (lower case,
    e.g. `"highest"`, `"float32"`, `"high"`, `"tensorfloat32"`)."""
    value = jax.config.jax_default_matmul_precision
    if value is None:
        return None
    name = str(getattr(value, "name", value)).lower()
    return None if name in DEFAULT_NAMES else name
