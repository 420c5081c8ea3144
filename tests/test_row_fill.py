"""`row_fill.set_rows`: chosen rows of a packed result set to 0 or NaN, every other bit untouched.

The Pallas kernel is checked on the CPU in Pallas' interpreter and on the GPU compiled (Triton), each against a
NumPy reference written from the definition, and bit for bit against the XLA scatter it replaces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlib._src.backends.cudnn import row_fill


# Odd sizes: rows not a multiple of the kernel's row block, columns not a multiple of its column block or a power of
# two; one case wider than a column block (several programs per row).
SHAPES = [(37, 3, 6), (100, 5, 3), (1, 1, 1), (53, 9, 131)]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _case(shape, dtype, seed=0):
    a, b, c = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(a, shape).astype(dtype)
    zero = jax.random.bernoulli(b, 0.3, shape[:1])
    nan = jax.random.bernoulli(c, 0.2, shape[:1])  # may overlap `zero`: NaN wins
    return x, zero, nan


def _bits(x):
    """The bits of `x`, with every NaN given one payload (XLA's and Triton's NaN constants differ on a GPU)."""
    bits = np.asarray(jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]))
    return np.where(np.isnan(np.asarray(x.astype(jnp.float32))), 0, bits)


def _check(actual, x, zero, nan):
    x, zero, nan = np.asarray(x.astype(jnp.float32)), np.asarray(zero), np.asarray(nan)
    actual32 = np.asarray(actual.astype(jnp.float32))
    assert np.isnan(actual32[nan]).all()
    assert (actual32[zero & ~nan] == 0).all() and not np.signbit(actual32[zero & ~nan]).any()
    kept = ~(zero | nan)
    np.testing.assert_array_equal(actual32[kept], x[kept])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_in_the_interpreter(shape, dtype):
    pytest.importorskip("jax.experimental.pallas.triton")  # without it `set_rows` falls back (tested below)
    x, zero, nan = _case(shape, dtype)
    actual = jax.jit(lambda *a: row_fill.set_rows_kernel(*a, interpret=True))(x, zero, nan)
    assert actual.shape == x.shape and actual.dtype == x.dtype
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), _bits(row_fill.set_rows_scatter(x, zero, nan)))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_scatter_and_default(shape):
    """The scatter (the benchmark's "before") against the definition, and `set_rows` (the scatter when JAX runs on a
    CPU) against it."""
    x, zero, nan = _case(shape, jnp.bfloat16, seed=1)
    _check(row_fill.set_rows_scatter(x, zero, nan), x, zero, nan)
    np.testing.assert_array_equal(_bits(jax.jit(row_fill.set_rows)(x, zero, nan)),
                                  _bits(row_fill.set_rows_scatter(x, zero, nan)))  # fmt: skip


def test_empty_arrays():
    for shape in [(0, 4, 8), (5, 0, 8)]:
        x = jnp.ones(shape, jnp.bfloat16)
        flags = jnp.ones(shape[:1], bool)
        assert row_fill.set_rows_kernel(x, flags, flags, interpret=True).shape == shape


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES + [(4099, 32, 128)], ids=str)
def test_kernel_on_the_gpu(shape, dtype):
    """Compiled on the GPU (`set_rows` runs the Triton kernel there), bit-identical to the scatter."""
    x, zero, nan = _case(shape, dtype, seed=2)
    lowered = jax.jit(row_fill.set_rows).lower(x, zero, nan).as_text()
    assert "__gpu$xla.gpu.triton" in lowered and "stablehlo.while" not in lowered, "not the compiled kernel"
    actual = jax.jit(row_fill.set_rows)(x, zero, nan)
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), _bits(jax.jit(row_fill.set_rows_scatter)(x, zero, nan)))


@pytest.mark.gpu
def test_kernel_on_the_gpu_writes_in_place():
    """The input buffer is donated to the kernel: no copy of the array in the compiled module."""
    x, zero, nan = _case((4099, 32, 128), jnp.bfloat16, seed=3)
    compiled = jax.jit(row_fill.set_rows, donate_argnums=0).lower(x, zero, nan).compile().as_text()
    assert " copy(" not in compiled and "copy-start" not in compiled, compiled[:2000]


def test_falls_back_to_the_scatter_without_pallas_triton(monkeypatch, caplog):
    """A JAX without Pallas' Triton backend: the scatter runs, and says so once at WARNING."""
    import sys

    from attnlib._src import logs

    import jax.experimental.pallas as pallas

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)  # import fails
    monkeypatch.delattr(pallas, "triton", raising=False)
    monkeypatch.setattr(logs, "_logged", set())
    x, zero, nan = _case((37, 3, 6), jnp.bfloat16)
    with caplog.at_level("WARNING", logger="attnlib"):
        actual = row_fill.set_rows(x, zero, nan)
        row_fill.set_rows(x, zero, nan)
    _check(actual, x, zero, nan)
    warnings = [r.getMessage() for r in caplog.records if "Triton backend is unavailable" in r.getMessage()]
    assert len(warnings) == 1, warnings
