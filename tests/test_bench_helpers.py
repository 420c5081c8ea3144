"""CPU checks of benchmark helpers whose results feed a decision (the per-kernel profile of `kernel_profile.py`)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import pytest


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
