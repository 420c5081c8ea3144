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


def _kernel_profile():
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "kernel_profile.py"
    spec = importlib.util.spec_from_file_location("kernel_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_span_per_call_separates_calls_at_the_longest_gaps():
    """Three calls of two kernels each: 10 us apart inside a call, 1000 us between calls."""
    profile = _kernel_profile()
    intervals = []
    for call in range(3):
        start = call * 2000.0
        intervals += [(start, start + 5.0), (start + 15.0, start + 20.0 + call)]
    assert profile._span_per_call(intervals, 3) == pytest.approx((20.0 + 21.0 + 22.0) / 3)


def test_kernel_profile_reads_the_trace_on_the_cpu():
    """On the CPU the jitted computation shows up on the host plane; the parser finds its events."""
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    result = _kernel_profile().kernel_profile(f, (jnp.ones((128, 128)),), calls=3, plane_prefix="/host:CPU")
    assert result["launches"] > 0 and result["kernel_us"] > 0
    assert any("sin" in kernel["name"] for kernel in result["kernels"])
