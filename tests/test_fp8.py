"""FP8 attention (`fp8=`, docs/fp8.md) on the plain-JAX emulations (`xla`, and `xla_chunked` with 5-key blocks),
against the float64 reference of `tests/reference.py::reference_fp8_attention` (written from docs/fp8.md, sharing no
code with attnlib).

Comparison: the emulation computes in float32 and returns 16-bit values, the reference in float64. Where a value sits
within float32 noise of an E4M3 rounding midpoint the two round it apart: the output then lands on the neighbouring
value of its grid (`e4m3(o · c) / c`, one step), and a probability `448 p̃` on a midpoint (measured: 50.000008 in
float32, 49.99999 in float64, rounding to 52 and 48) moves its row's outputs by up to `(4 / 448) · max|v̂|`.
`assert_fp8_close` therefore requires: at least 98 % of the elements equal to the output dtype's rounding; at most
1 % more than one output grid step away; none more than one output grid step plus `0.02 · max|v̂|` away (a moved
probability can push an output across a rounding midpoint, and in the top binades one output step is up to
`16 · 1.25 / 448 ≈ 0.045 · max|v̂|`).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cudnn_emulation import emulated_cudnn
from helpers import assert_close, normal, rng, simulate_a_machine_without_a_gpu, Tol
from reference import e4m3, reference_attention_vjp, reference_fp8_attention

import attnlib
from attnlib._src import validation
from attnlib._src.backends import xla_chunked
from attnlib._src.backends.cudnn import support


def _quantized(x):
    """`(E4M3 values as float64, scale)` of `fp8="current"`: `scale = amax(|x|) / 448` and the float32 quotient
    `x / scale` as XLA divides on this platform, rounded to nearest even by the reference's `e4m3` (docs/fp8.md:
    XLA's float32 division may differ from IEEE division by one ulp, which decides exact E4M3 ties;
    `test_quantization_is_round_to_nearest_even_of_the_quotient` checks the rest of the quantizer)."""
    x32 = jnp.asarray(x, jnp.float32)
    scale = np.float32(np.max(np.abs(np.asarray(x32)))) / np.float32(448.0) if np.any(x32) else np.float32(1.0)
    return e4m3(np.asarray(x32 / jnp.float32(scale), np.float64)), float(scale)


def _grid_step(x):
    """The spacing of float8_e4m3fn values around |x| (subnormal spacing 2**-9 below 2**-6)."""
    ax = np.maximum(np.abs(x), 2.0**-6)
    return 2.0 ** (np.floor(np.log2(ax)) - 3)


def assert_fp8_close(actual, expected, value8, value_scale, dtype):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    vmax = np.max(np.abs(value8)) * value_scale
    c = 448.0 / (1.25 * vmax)
    rounding = float(ml_dtypes.finfo(dtype).eps) * np.abs(expected) + 1e-30
    err = np.abs(actual - expected)
    step = _grid_step(expected * c) / c
    excess = err - step
    worst = np.unravel_index(np.argmax(excess), err.shape)
    assert excess.max() <= 0.02 * vmax, (
        f"|err| {err[worst]:.4g} > one output step {step[worst]:.3g} + 0.02 max|v| = {0.02 * vmax:.3g} at {worst}: "
        f"actual {actual[worst]:.6g}, expected {expected[worst]:.6g}"
    )
    off_grid = np.mean(err > step + rounding)
    assert off_grid <= 0.01, f"{off_grid:.2%} of the elements are more than one output grid step away"
    agree = np.mean(err <= rounding)
    assert agree >= 0.98, f"only {agree:.1%} of the elements agree to the output dtype's rounding"


N, K = 6, 2
CASES = {
    "gqa_full": dict(t=37, s=53, h=40, hv=24),
    "causal": dict(t=48, s=48, h=32, hv=32, kw=dict(is_causal=True)),
    "bottom_right_t_lt_s": dict(t=19, s=61, h=32, hv=16, kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "padding": dict(t=40, s=56, h=32, hv=32, kw=dict(query_seq_lengths=[40, 23], key_value_seq_lengths=[50, 0])),
    "sinks_softcap": dict(t=33, s=45, h=32, hv=32, kw=dict(logits_soft_cap=7.0, sinks="random")),
    "window": dict(t=64, s=64, h=32, hv=32, kw=dict(local_window_size=(9, 2))),
}


def _inputs(case, dtype, seed=0, cases=None):
    r = rng(seed)
    c = (CASES if cases is None else cases)[case]
    q = normal(r, (2, c["t"], N, c["h"]), dtype, scale=1.5)
    k = normal(r, (2, c["s"], K, c["h"]), dtype)
    v = normal(r, (2, c["s"], K, c["hv"]), dtype, scale=3.0)
    kw = dict(c.get("kw", {}))
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    if kw.get("sinks") == "random":
        kw["sinks"] = normal(r, (N,), jnp.float32)
    return q, k, v, kw


def _ref_kwargs(kw):
    return {n: (np.asarray(x) if hasattr(x, "shape") else x) for n, x in kw.items()}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_current_matches_the_float64_reference(case, dtype, impl):
    q, k, v, kw = _inputs(case, dtype)
    out, lse = attnlib.attention(q, k, v, fp8="current", implementation=impl, return_residual=True, **kw)
    assert out.dtype == dtype and out.shape == q.shape[:-1] + (v.shape[-1],)
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    r_out, r_lse = reference_fp8_attention(q8, k8, v8, scales=(dq, dk, dv), **_ref_kwargs(kw))
    assert_fp8_close(out, r_out, v8, dv, dtype)
    assert_close(np.asarray(lse, np.float64), r_lse, Tol(atol=2e-5, rtol=2e-6), what="lse")


def test_quantization_is_round_to_nearest_even_of_the_quotient():
    """attnlib's E4M3 inputs are the round-to-nearest-even of `x / scale`; only where XLA's float32 quotient is
    within one ulp of an E4M3 midpoint (an exact tie in IEEE arithmetic) may they sit one E4M3 step away."""
    r = rng(11)
    x = jnp.concatenate([normal(r, (4096,), jnp.bfloat16, scale=3.0), jnp.asarray([-6.34375, 12.25], jnp.bfloat16)])
    dequantize, _ = attnlib._src.fp8.plan("current", x, x, x, None)
    got = np.asarray(dequantize(x, 0), np.float64)
    x32 = np.asarray(x.astype(jnp.float32))
    scale = np.float32(np.max(np.abs(x32))) / np.float32(448.0)
    assert float(dequantize.scales[0]) == scale
    quotient = (x32 / scale).astype(np.float32)  # IEEE float32 division
    expected = e4m3(quotient.astype(np.float64)) * scale
    off = np.abs(got - expected) > 1e-6 * np.abs(expected)
    below, above = np.nextafter(quotient, np.float32(-np.inf)), np.nextafter(quotient, np.float32(np.inf))
    near_tie = e4m3(below.astype(np.float64)) != e4m3(above.astype(np.float64))
    assert np.all(near_tie[off]), f"{int(np.sum(off & ~near_tie))} elements are not the rounding of x / scale"


def test_the_reference_is_not_plain_attention():
    """The check above can fail: plain 16-bit attention is outside its bounds."""
    q, k, v, kw = _inputs("gqa_full", jnp.float32)
    plain = attnlib.attention(q, k, v, implementation="xla")
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    r_out, _ = reference_fp8_attention(q8, k8, v8, scales=(dq, dk, dv))
    with pytest.raises(AssertionError):
        assert_fp8_close(plain, r_out, v8, dv, jnp.float32)


@pytest.mark.parametrize("output_dtype", [jnp.bfloat16, jnp.float32])
def test_prequantized_inputs_equal_current_with_the_same_scales(output_dtype):
    q, k, v, kw = _inputs("causal", jnp.float32)
    scales = [jnp.max(jnp.abs(x)) / 448.0 for x in (q, k, v)]
    q8, k8, v8 = ((x / s).astype(jnp.float8_e4m3fn) for x, s in zip((q, k, v), scales, strict=True))
    given = attnlib.Fp8Scales(q=scales[0], k=scales[1].reshape(1), v=scales[2], output_dtype=output_dtype)
    out = attnlib.attention(q8, k8, v8, fp8=given, **kw)
    assert out.dtype == output_dtype
    current = attnlib.attention(q, k, v, fp8="current", **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(current.astype(output_dtype), np.float32))
    r_out, _ = reference_fp8_attention(q8.astype(jnp.float32), k8.astype(jnp.float32), v8.astype(jnp.float32),
                                       scales=[float(s) for s in scales], **_ref_kwargs(kw))  # fmt: skip
    assert_fp8_close(out, r_out, np.asarray(v8.astype(jnp.float32)), float(scales[2]), output_dtype)


def _equal_up_to_output_rounding_flips(a, b):
    """`a` and `b` (two compilations of the same FP8 call) agree except where the output's E4M3 rounding flips.

    XLA orders float32 sums differently eagerly and under `jit` (measured on a CPU: the unrounded output `o` differed
    by up to 9 ulps in 80 % of its elements), so where `o · c` sits within those ulps of an E4M3 rounding boundary the
    two round to neighbouring grid points: one output step apart (at most 2**-3 of the value, E4M3 having 3 mantissa
    bits), on a handful of elements."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    differ = a != b
    assert differ.mean() <= 1e-3, f"{differ.sum()} of {differ.size} elements differ"
    step = 2.0**-3 * np.maximum(np.abs(a), np.abs(b))
    assert np.all(np.abs(a - b)[differ] <= 1.01 * step[differ]), np.abs(a - b)[differ]


def test_jit_and_vmap():
    q, k, v, kw = _inputs("causal", jnp.bfloat16)
    eager = attnlib.attention(q, k, v, fp8="current", **kw)
    jitted = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, fp8="current", **kw))(q, k, v)
    _equal_up_to_output_rounding_flips(eager, jitted)
    # vmap maps the scales too: each example is quantized with its own amax, as a separate call would be
    call = lambda q, k, v: attnlib.attention(q, k, v, fp8="current", **kw)  # noqa: E731
    mapped = jax.vmap(call)(q[:, None], k[:, None], v[:, None])
    one = attnlib.attention(q[1:], k[1:], v[1:], fp8="current", **kw)
    _equal_up_to_output_rounding_flips(mapped[1], one)


@pytest.mark.parametrize("case", ["causal", "sinks_softcap", "padding"])
def test_gradients_are_those_of_attention_at_the_dequantized_inputs(case, impl):
    """Straight-through quantizers: the gradient is attention's at q̂, k̂, v̂ up to the probability and output
    rounding (relative error of order 2**-4)."""
    q, k, v, kw = _inputs(case, jnp.float32, seed=3)
    d_out = normal(rng(4), q.shape[:-1] + (v.shape[-1],), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, fp8="current", implementation=impl, **kw) * d_out)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    ref = reference_attention_vjp(q8 * dq, k8 * dk, v8 * dv, d_out=np.asarray(d_out, np.float64), **_ref_kwargs(kw))
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        expected = ref[name]
        err = np.max(np.abs(np.asarray(g, np.float64) - expected)) / np.max(np.abs(expected))
        assert err < 2.0**-3, f"d{name}: relative error {err:.3g}"
        assert np.all(np.isfinite(np.asarray(g)))


def test_xla_chunked_gradients_equal_xla_s():
    """`xla_chunked`'s hand-written FP8 backward gives what autodiff of `xla`'s emulation gives."""
    q, k, v, kw = _inputs("sinks_softcap", jnp.float32, seed=5)
    d_out = normal(rng(6), q.shape[:-1] + (v.shape[-1],), jnp.float32)
    d_lse = normal(rng(7), q.shape[:-1], jnp.float32)

    def grads(impl):
        def loss(q, k, v, sinks):
            out, lse = attnlib.attention(
                q, k, v, fp8="current", implementation=impl, return_residual=True, **{**kw, "sinks": sinks}
            )
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, kw["sinks"])  # one compiled program each

    chunked = grads(attnlib.XlaChunked(block_k=7))
    for name, a, e in zip(("query", "key", "value", "sinks"), chunked, grads("xla"), strict=True):
        assert_close(np.asarray(a, np.float64), np.asarray(e, np.float64), Tol(atol=2e-5, rtol=2e-5),
                     what=name, scale_atol_by_max=True)  # fmt: skip


def test_validation_messages():
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    q8 = q.astype(jnp.float8_e4m3fn)
    one = jnp.float32(1.0)
    with pytest.raises(TypeError, match=r"`query` of dtype float8_e4m3fn needs `fp8=attnlib.Fp8Scales"):
        attnlib.attention(q8, q8, q8)
    with pytest.raises(TypeError, match=r"float8_e4m3fn needs .* fp8='current'"):
        attnlib.attention(q8, q8, q8, fp8="current")
    with pytest.raises(ValueError, match=r"`fp8` must be None, 'current' or an attnlib.Fp8Scales. Got fp8='delayed'"):
        attnlib.attention(q, q, q, fp8="delayed")
    with pytest.raises(TypeError, match=r"`query` must have dtype float8_e4m3fn with fp8=Fp8Scales"):
        attnlib.attention(q, q, q, fp8=attnlib.Fp8Scales(q=one, k=one, v=one))
    with pytest.raises(ValueError, match=r"`fp8.k` must be a float scalar .* Got shape \(2,\)"):
        attnlib.attention(q8, q8, q8, fp8=attnlib.Fp8Scales(q=one, k=jnp.ones(2), v=one))
    with pytest.raises(TypeError, match=r"`fp8.output_dtype` must be float16, bfloat16 or float32"):
        attnlib.attention(q8, q8, q8, fp8=attnlib.Fp8Scales(q=one, k=one, v=one, output_dtype=jnp.int8))


def test_explain_takes_shapes():
    shape = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    explanation = attnlib.explain(shape, shape, shape, fp8=attnlib.Fp8Scales(q=scale, k=scale, v=scale))
    if xla_chunked.auto_min_score_bytes() == 0:  # a CPU picks xla_chunked at every size
        assert explanation.implementation == "xla_chunked"
    else:  # small: automatic dispatch leaves it to xla, not for FP8 reasons
        assert explanation.implementation == "xla"
        assert "materialised scores" in explanation.declined["xla_chunked"]


def test_unsupported_combinations_name_the_feature():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    # Every implementation, cuDNN's included (an H200 faulted on its FP8 graph with dropout, 2026-12-06).
    for implementation in (None, emulated_cudnn(), "xla_chunked", "xla"):
        with pytest.raises(NotImplementedError, match="dropout together with FP8"):
            attnlib.attention(q, q, q, fp8="current", dropout_rate=0.1, dropout_key=jax.random.PRNGKey(0),
                              implementation=implementation)  # fmt: skip
    config, _ = validation.validate(
        q, q, q, None, None, scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=None, return_residual=False, diagonal_alignment="top_left", q_segment_ids=None,
        kv_segment_ids=None, max_segments_per_row=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
        max_seqlen_kv=None, page_table=None, logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_key=None,
        deterministic_backward=False, fp8="current",
    )  # fmt: skip
    assert "FP8 tensor cores" in support.policy_reason(config, (8, 0), 91900)


def test_context_parallelism_refuses_fp8():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="`fp8`"):
        attnlib.context_parallel.attention(q, q, q, axis_name="cp", fp8="current")


def test_e4m3_rounding_survives_xla_excess_precision():
    """XLA's GPU pipeline drops a float32 -> float8 -> float32 round trip (`xla_allow_excess_precision`; on the
    H200 every value came back unrounded, benchmarks/results/probe_fp8_rounding_h200.log): the float8 value must sit
    behind an optimization barrier, which the CPU can check in the lowered program."""
    x = jnp.linspace(-500.0, 500.0, 97, dtype=jnp.float32)
    lowered = jax.jit(attnlib._src.fp8.round_e4m3).lower(x).as_text()
    assert "optimization_barrier" in lowered and "f8E4M3FN" in lowered
    expected = np.clip(np.asarray(x), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(attnlib._src.fp8.round_e4m3)(x)), expected)


def test_an_fp8_call_without_a_gpu_names_the_missing_gpu_first(monkeypatch):
    """The first reason is the machine's (no GPU), not the native extension's."""
    simulate_a_machine_without_a_gpu(monkeypatch, nvidia_driver=False)
    q = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"cudnn: no CUDA GPU visible to JAX$"):
        attnlib.attention(q, q, q, fp8="current", implementation="cudnn")
