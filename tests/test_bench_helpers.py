"""CPU checks of benchmark helpers whose results feed a decision (candidates for library code)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlib._src.backends.cudnn import varlen


def _bench_ragged():
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_cudnn_ragged.py"
    spec = importlib.util.spec_from_file_location("bench_cudnn_ragged", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(37, 3, 6), (37, 5, 3)], ids=["even_row", "odd_row"])
def test_row_scatter_in_words_is_bit_identical(dtype, shape):
    """The 32-bit-word candidate sets exactly the rows `varlen._set_rows` sets, to the same bits (0 or NaN)."""
    a, b, c = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(a, shape).astype(dtype)
    zero = jax.random.bernoulli(b, 0.3, shape[:1])
    nan = jax.random.bernoulli(c, 0.2, shape[:1]) & ~zero
    expected = varlen._set_rows(x, zero, nan)
    actual = jax.jit(_bench_ragged().set_rows_in_words)(x, zero, nan)
    assert actual.dtype == x.dtype and actual.shape == x.shape
    as_bits = lambda y: np.asarray(jax.lax.bitcast_convert_type(y, {2: jnp.uint16, 4: jnp.uint32}[y.dtype.itemsize]))
    np.testing.assert_array_equal(as_bits(actual), as_bits(expected))
    assert np.isnan(np.asarray(actual, np.float32)[np.asarray(nan)]).all()
    assert (np.asarray(actual, np.float32)[np.asarray(zero)] == 0).all()
    untouched = ~np.asarray(zero | nan)
    np.testing.assert_array_equal(as_bits(actual)[untouched], as_bits(x)[untouched])
