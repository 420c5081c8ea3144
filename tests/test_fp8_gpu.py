"""GPU tests of FP8 attention on cuDNN (`fp8=` with `implementation="cudnn"`, Hopper or newer).

cuDNN's FP8 kernel quantizes the probabilities block by block against a running row max, where docs/fp8.md's
emulation rounds them against the final max, so the two differ by FP8 rounding, not by a fixed tolerance. The
checks are therefore accuracy classes against the independent float64 reference (`tests/reference.py`) of
attention on the same dequantized inputs (`q̂ = e4m3(q / d_q) · d_q`, no probability or output rounding; the inputs'
amaxes are pinned so that every `d` is a power of two, see `_pinned`):
- out: cuDNN's error is at most 1.5x the rms and 2x the max error of the float64 FP8 reference
  (`reference_fp8_attention`, docs/fp8.md's rounding of inputs, probabilities and output) — a wrong scale, axis or
  mask is far outside; the plain-JAX emulation (`xla`) on the GPU must match that reference as on the CPU
  (test_fp8.py's criterion: XLA's GPU pipeline would otherwise drop its float8 round trips);
- lse: from unrounded probabilities, `atol = 2 eps` of bfloat16 against the emulation's lse;
- rows past the query lengths and rows that see no key: exactly 0 and `-inf`;
- gradients: the 16-bit backward at q̂, k̂, v̂ given the FP8 forward's output and statistics, against that math
  in float64 (bfloat16 gradient tolerances).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_fp8_attention, visibility
from test_fp8 import _quantized, _ref_kwargs, assert_fp8_close

import attnlib


pytestmark = pytest.mark.gpu

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
CASES = {
    "gqa_full_d128": dict(t=200, s=328, n=8, k=2, h=128),
    "causal_d64": dict(t=256, s=256, n=6, k=3, h=64, kw=dict(is_causal=True)),
    "mqa_causal": dict(t=192, s=192, n=4, k=1, h=128, kw=dict(is_causal=True)),
    "bottom_right_t_lt_s": dict(t=97, s=300, n=8, k=2, h=128,
                                kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "bottom_right_t_gt_s": dict(t=300, s=97, n=8, k=2, h=64,
                                kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "padding": dict(t=160, s=224, n=8, k=2, h=128,
                    kw=dict(query_seq_lengths=[160, 71], key_value_seq_lengths=[200, 0])),
    "padding_causal": dict(t=160, s=224, n=8, k=2, h=128,
                           kw=dict(is_causal=True, query_seq_lengths=[99, 160], key_value_seq_lengths=[224, 37])),
    "window": dict(t=256, s=256, n=8, k=2, h=128, kw=dict(is_causal=True, local_window_size=(40, 0))),
}  # fmt: skip


def _pinned(x, amax, dtype):
    """`x` clipped to `±amax` with one element exactly `amax`: with `amax = 448 · 2**-k` the current scale is a power
    of two, so `x / scale` is exact however XLA divides (by a runtime scalar, or times a constant's reciprocal, which
    differ by an ulp and then round E4M3 midpoints apart) and the test's quantization is attnlib's bit for bit."""
    return jnp.clip(x, -amax, amax).at[0, 0, 0, 0].set(amax).astype(dtype)


def _inputs(case, dtype, seed=0):
    c = CASES[case]
    keys = jax.random.split(jax.random.key(seed), 3)
    q = _pinned(1.5 * jax.random.normal(keys[0], (2, c["t"], c["n"], c["h"]), jnp.float32), 7.0, dtype)
    k = _pinned(jax.random.normal(keys[1], (2, c["s"], c["k"], c["h"]), jnp.float32), 3.5, dtype)
    v = _pinned(3.0 * jax.random.normal(keys[2], (2, c["s"], c["k"], c["h"]), jnp.float32), 14.0, dtype)
    kw = {n: (jnp.asarray(x, jnp.int32) if n.endswith("lengths") else x) for n, x in c.get("kw", {}).items()}
    return q, k, v, kw


def _dequantized(q, k, v):
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    return q8 * dq, k8 * dk, v8 * dv


def _errors(actual, expected):
    err = np.abs(np.asarray(jnp.asarray(actual, jnp.float32), np.float64) - expected)
    return float(np.sqrt(np.mean(err**2))), float(err.max())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [c for c in CASES if c != "bottom_right_t_lt_s"])
def test_forward_is_as_accurate_as_the_fp8_reference(case, dtype):
    q, k, v, kw = _inputs(case, DTYPES[dtype])
    explanation = attnlib.explain(q, k, v, fp8="current", implementation="cudnn", **kw)
    assert explanation.implementation == "cudnn", str(explanation)
    out, lse = jax.jit(lambda q, k, v: attnlib.attention(
        q, k, v, fp8="current", implementation="cudnn", return_residual=True, **kw))(q, k, v)  # fmt: skip
    e_out, e_lse = attnlib.attention(q, k, v, fp8="current", implementation="xla", return_residual=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    fp8_reference, _ = reference_fp8_attention(q8, k8, v8, scales=(dq, dk, dv), **_ref_kwargs(kw))
    assert_fp8_close(e_out, fp8_reference, v8, dv, q.dtype)  # the emulation rounds on the GPU too
    exact, _ = reference_attention(q8 * dq, k8 * dk, v8 * dv, **_ref_kwargs(kw))
    rms, worst = _errors(out, exact)
    r_rms, r_worst = _errors(fp8_reference, exact)
    assert rms <= 1.5 * r_rms and worst <= 2 * r_worst, (
        f"cuDNN FP8 error rms {rms:.3g} / max {worst:.3g}; the FP8 reference's {r_rms:.3g} / {r_worst:.3g}"
    )
    lse, e_lse = np.asarray(lse), np.asarray(e_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(e_lse)), "rows that see no key differ"
    finite = np.isfinite(e_lse)
    np.testing.assert_allclose(lse[finite], e_lse[finite], atol=2 * 2.0**-7, rtol=0)
    empty = np.isneginf(e_lse)  # rows past the lengths, rows that see no key: exact zeros
    assert np.all(np.asarray(out, np.float32)[empty] == 0)


def test_prequantized_inputs_equal_current_with_the_same_scales():
    q, k, v, kw = _inputs("causal_d64", jnp.bfloat16)
    scales = [jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0 for x in (q, k, v)]
    q8, k8, v8 = ((x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn) for x, s in zip((q, k, v), scales, strict=True))
    given = attnlib.Fp8Scales(q=scales[0], k=scales[1], v=scales[2], output_dtype=jnp.bfloat16)
    out = attnlib.attention(q8, k8, v8, fp8=given, implementation="cudnn", **kw)
    current = attnlib.attention(q, k, v, fp8="current", implementation="cudnn", **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(current, np.float32))


def _backward_model(q_hat, k_hat, v_hat, out, lse, d_out, kw):
    """float64 gradients of attention's backward at `q̂, k̂, v̂` given the stored output and statistics — the math of
    a 16-bit backward graph fed cuDNN's FP8 forward results: `P = exp(S - lse)`, `D = rowsum(dO ∘ out)`,
    `dS = P (dO v̂ᵀ - D)`."""
    q64, k64, v64, o64, do64 = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q_hat, k_hat, v_hat,
                                                                                            out, d_out))  # fmt: skip
    seen = visibility(q64, k64, v64, **_ref_kwargs(kw))  # [B, N, T, S]
    g = q64.shape[2] // k64.shape[2]
    kr, vr = np.repeat(k64, g, axis=2), np.repeat(v64, g, axis=2)
    scale = 1 / np.sqrt(q64.shape[-1])
    s = np.einsum("btnh,bsnh->bnts", q64, kr) * scale
    stats = np.transpose(np.asarray(lse, np.float64), (0, 2, 1))[..., None]  # [B, N, T, 1]
    p = np.where(seen, np.exp(np.where(seen, s, 0) - np.where(np.isfinite(stats), stats, 0)), 0.0)
    dp = np.einsum("btnh,bsnh->bnts", do64, vr)
    d = np.transpose(np.sum(do64 * o64, axis=-1), (0, 2, 1))[..., None]
    ds = p * (dp - d)
    fold = lambda x: x.reshape(x.shape[:2] + (k64.shape[2], g, x.shape[-1])).sum(axis=3)
    return (np.einsum("bnts,bsnh->btnh", ds, kr) * scale, fold(np.einsum("bnts,btnh->bsnh", ds, q64) * scale),
            fold(np.einsum("bnts,btnh->bsnh", p, do64)))  # fmt: skip


@pytest.mark.parametrize("case", ["gqa_full_d128", "causal_d64", "padding_causal", "window", "bottom_right_t_gt_s"])
def test_gradients_are_the_16_bit_backward_at_the_dequantized_inputs(case):
    """The backward graph is attention's 16-bit backward at q̂, k̂, v̂ (as bfloat16) with the FP8 forward's own
    output and statistics; checked against that math in float64 with test_cudnn_gpu.py's gradient tolerance
    (`8 eps · max|expected|`, `rtol = eps`). How far that is from the exact gradient (E4M3's output rounding enters
    `D`) is measured by benchmarks/bench_score_mod.py --suite fp8, not asserted here."""
    q, k, v, kw = _inputs(case, jnp.bfloat16, seed=3)
    d_out = jax.random.normal(jax.random.key(4), q.shape, jnp.float32).astype(jnp.bfloat16)
    attend = lambda q, k, v: attnlib.attention(  # noqa: E731
        q, k, v, fp8="current", implementation="cudnn", return_residual=True, **kw
    )
    (out, lse), vjp = jax.vjp(attend, q, k, v)
    grads = jax.jit(vjp)((d_out, jnp.zeros_like(lse)))
    q_hat, k_hat, v_hat = (jnp.asarray(x, jnp.float32).astype(jnp.bfloat16) for x in _dequantized(q, k, v))
    expected = _backward_model(q_hat, k_hat, v_hat, out, lse, d_out, kw)
    eps = 2.0**-7
    for name, g, e in zip(("dquery", "dkey", "dvalue"), grads, expected, strict=True):
        assert g.dtype == jnp.bfloat16
        g = np.asarray(jnp.asarray(g, jnp.float32), np.float64)
        bound = 8 * eps * np.max(np.abs(e)) + eps * np.abs(e)
        err = np.abs(g - e)
        assert np.all(err <= bound), f"{name}: max |err| {err.max():.3g} (bound {bound.max():.3g})"


@pytest.mark.parametrize("alignment_case", ["bottom_right_t_lt_s"])
def test_what_hopper_cannot_run_in_fp8_runs_in_16_bits_with_a_warning(alignment_case, caplog):
    """cuDNN 9.19 runs a bottom-right FP8 graph only on Blackwell: on Hopper `implementation="cudnn"` declines with
    that reason and automatic dispatch runs the call on cuDNN in 16 bits, logged."""
    q, k, v, kw = _inputs(alignment_case, jnp.bfloat16)
    if jax.devices()[0].compute_capability.startswith("1"):
        pytest.skip("a Blackwell GPU runs bottom-right FP8 graphs")
    reason = attnlib.explain(q, k, v, fp8="current", implementation="cudnn", **kw).declined["cudnn"]
    assert "Blackwell" in reason
    assert attnlib.explain(q, k, v, fp8="current", **kw).without_fp8 is not None
    with caplog.at_level("WARNING", logger="attnlib"):
        out = attnlib.attention(q, k, v, fp8="current", **kw)
    assert any("without FP8 quantization" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(attnlib.attention(q, k, v, implementation="cudnn", **kw), np.float32))


def test_automatic_dispatch_runs_fp8_on_cudnn():
    q, k, v, kw = _inputs("causal_d64", jnp.bfloat16)
    assert attnlib.explain(q, k, v, fp8="current", **kw).implementation == "cudnn"
