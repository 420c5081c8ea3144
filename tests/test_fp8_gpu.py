"""GPU tests of FP8 attention on cuDNN (`fp8=` with `implementation="cudnn"`, Hopper or newer).

cuDNN's FP8 kernel quantizes the probabilities block by block against a running row max, where docs/fp8.md's
emulation rounds them against the final max, so the two differ by FP8 rounding, not by a fixed tolerance. The
checks are therefore accuracy classes against the independent float64 reference (`tests/reference.py`) of
attention on the same dequantized inputs (`q̂ = e4m3(q / d_q) · d_q`, no probability or output rounding):
- out: cuDNN's error is at most 1.5x the rms and 2x the max error of the plain-JAX emulation of the same FP8
  computation (`xla`, which test_fp8.py pins to the FP8 reference) — a wrong scale, axis or mask is far outside;
- lse: from unrounded probabilities, `atol = 2 eps` of bfloat16 against the emulation's lse;
- rows past the query lengths and rows that see no key: exactly 0 and `-inf`;
- gradients (the 16-bit backward at q̂, k̂, v̂): relative max error below 2**-3 against the reference gradient,
  as test_fp8.py requires of the emulation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_attention, reference_attention_vjp
from test_fp8 import _quantized, _ref_kwargs

import attnlib


pytestmark = pytest.mark.gpu

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
CASES = {
    "gqa_full_d128": dict(t=200, s=328, n=8, k=2, h=128),
    "causal_d64": dict(t=256, s=256, n=6, k=3, h=64, kw=dict(is_causal=True)),
    "mqa_causal": dict(t=192, s=192, n=4, k=1, h=128, kw=dict(is_causal=True)),
    "bottom_right_t_lt_s": dict(t=97, s=300, n=8, k=2, h=128,
                                kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "bottom_right_t_gt_s": dict(t=300, s=97, n=8, k=2, h=64, kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "padding": dict(t=160, s=224, n=8, k=2, h=128,
                    kw=dict(query_seq_lengths=[160, 71], key_value_seq_lengths=[200, 0])),
    "padding_causal": dict(t=160, s=224, n=8, k=2, h=128,
                           kw=dict(is_causal=True, query_seq_lengths=[99, 160], key_value_seq_lengths=[224, 37])),
    "window": dict(t=256, s=256, n=8, k=2, h=128, kw=dict(is_causal=True, local_window_size=(40, 0))),
}  # fmt: skip


def _inputs(case, dtype, seed=0):
    c = CASES[case]
    keys = jax.random.split(jax.random.key(seed), 3)
    q = (1.5 * jax.random.normal(keys[0], (2, c["t"], c["n"], c["h"]), jnp.float32)).astype(dtype)
    k = jax.random.normal(keys[1], (2, c["s"], c["k"], c["h"]), jnp.float32).astype(dtype)
    v = (3.0 * jax.random.normal(keys[2], (2, c["s"], c["k"], c["h"]), jnp.float32)).astype(dtype)
    kw = {n: (jnp.asarray(x, jnp.int32) if n.endswith("lengths") else x) for n, x in c.get("kw", {}).items()}
    return q, k, v, kw


def _dequantized(q, k, v):
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    return q8 * dq, k8 * dk, v8 * dv


def _errors(actual, expected):
    err = np.abs(np.asarray(jnp.asarray(actual, jnp.float32), np.float64) - expected)
    return float(np.sqrt(np.mean(err**2))), float(err.max())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_is_as_accurate_as_the_emulation(case, dtype):
    q, k, v, kw = _inputs(case, DTYPES[dtype])
    explanation = attnlib.explain(q, k, v, fp8="current", implementation="cudnn", **kw)
    assert explanation.implementation == "cudnn", str(explanation)
    out, lse = jax.jit(lambda q, k, v: attnlib.attention(
        q, k, v, fp8="current", implementation="cudnn", return_residual=True, **kw))(q, k, v)  # fmt: skip
    e_out, e_lse = attnlib.attention(q, k, v, fp8="current", implementation="xla", return_residual=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    exact, _ = reference_attention(*_dequantized(q, k, v), **_ref_kwargs(kw))
    rms, worst = _errors(out, exact)
    e_rms, e_worst = _errors(e_out, exact)
    assert rms <= 1.5 * e_rms and worst <= 2 * e_worst, (
        f"cuDNN FP8 error rms {rms:.3g} / max {worst:.3g}; the emulation's {e_rms:.3g} / {e_worst:.3g}"
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


@pytest.mark.parametrize("case", ["gqa_full_d128", "causal_d64", "bottom_right_t_lt_s", "padding_causal", "window"])
def test_gradients_are_those_of_attention_at_the_dequantized_inputs(case):
    q, k, v, kw = _inputs(case, jnp.bfloat16, seed=3)
    d_out = jax.random.normal(jax.random.key(4), q.shape, jnp.float32)
    loss = lambda q, k, v: jnp.sum(
        attnlib.attention(q, k, v, fp8="current", implementation="cudnn", **kw).astype(jnp.float32) * d_out
    )
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = reference_attention_vjp(*_dequantized(q, k, v), d_out=np.asarray(d_out, np.float64), **_ref_kwargs(kw))
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        assert g.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(g, np.float32)))
        expected = ref[name]
        err = np.max(np.abs(np.asarray(g, np.float64) - expected)) / np.max(np.abs(expected))
        assert err < 2.0**-3, f"d{name}: relative error {err:.3g}"


def test_automatic_dispatch_runs_fp8_on_cudnn():
    q, k, v, kw = _inputs("causal_d64", jnp.bfloat16)
    assert attnlib.explain(q, k, v, fp8="current", **kw).implementation == "cudnn"
