"""GPU tests of `implementation="cudnn"`: every feature, forward and backward, against the `xla` reference.

The reference is `attnlib.attention(..., implementation="xla")` evaluated in float32 (full-precision matmuls) on the
same float16/bfloat16 values the cuDNN path gets. Tolerances follow from the dtype's machine epsilon `eps` (never
tuned):
- out: cuDNN rounds the probabilities and the output to the io dtype, `atol = 2 eps`, `rtol = eps`;
- lse: logits and log-sum-exp run in float32 from rounded inputs, `atol = 2 eps`;
- gradients: sums of products of rounded probabilities / `dS`, compared with `atol = 8 eps * max|expected|` plus
  `rtol = eps`.
Dropout uses cuDNN's own generator (a different mask than the xla path), so it is tested by extracting cuDNN's mask
and checking forward and backward against a reference that applies that same mask, plus keep-rate statistics.
"""

import ast
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest


pytestmark = pytest.mark.gpu

DTYPES = [jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["bf16", "f16"]


def _eps(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


def _assert_close(actual, expected, atol, rtol, what, scale_by_max=False):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), f"{what}: NaN in the cuDNN result"
    both_inf = np.isinf(actual) & np.isinf(expected) & (np.sign(actual) == np.sign(expected))
    assert np.array_equal(np.isinf(actual), np.isinf(expected)) and both_inf.sum() == np.isinf(expected).sum(), (
        f"{what}: infinities differ"
    )
    finite = ~np.isinf(expected)
    a, e = actual[finite], expected[finite]
    if scale_by_max and e.size:
        atol = atol * max(float(np.max(np.abs(e))), 1e-30)
    err = np.abs(a - e)
    bound = atol + rtol * np.abs(e)
    if err.size and not np.all(err <= bound):
        i = int(np.argmax(err - bound))
        raise AssertionError(
            f"{what}: max |err| {err.max():.3g}; worst at flat index {i}: actual {a[i]:.6g}, expected {e[i]:.6g}, "
            f"bound {bound[i]:.3g} (atol {atol:.3g}, rtol {rtol:.3g})"
        )


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _run(impl, q, k, v, kw, cotangent, lse_cotangent=None, diff_bias=False, diff_sinks=False):
    """(out, lse, grads) of `attnlib.attention` with a random cotangent on `out` (and optionally on `lse`)."""
    import attnlib

    kw = dict(kw)
    bias = kw.pop("bias", None)
    sinks = kw.pop("sinks", None)

    def f(q, k, v, bias, sinks):
        return attnlib.attention(q, k, v, bias, sinks=sinks, implementation=impl, return_residual=True, **kw)

    def loss(q, k, v, bias, sinks):
        out, lse = f(q, k, v, bias, sinks)
        total = jnp.sum(out.astype(jnp.float32) * cotangent)
        if lse_cotangent is not None:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * lse_cotangent)
        return total

    argnums = (0, 1, 2) + ((3,) if diff_bias else ()) + ((4,) if diff_sinks else ())
    with jax.default_matmul_precision("highest"):
        out, lse = jax.jit(f)(q, k, v, bias, sinks)
        grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias, sinks)
    return out, lse, grads


def _upcast(x):
    return None if x is None else jnp.asarray(x, jnp.float32)


def _compare(q, k, v, kw, *, dtype, seed=0, lse_grad=False, names=("dq", "dk", "dv")):
    e = _eps(dtype)
    ko, kl = jax.random.split(jax.random.key(seed + 1000))
    out_shape = q.shape[:-1] + (v.shape[-1],)
    cot = jax.random.normal(ko, out_shape, jnp.float32)
    lse_cot = jax.random.normal(kl, q.shape[:-1], jnp.float32) if lse_grad else None
    diff_bias = kw.get("bias") is not None
    diff_sinks = kw.get("sinks") is not None
    out, lse, grads = _run("cudnn", q, k, v, kw, cot, lse_cot, diff_bias, diff_sinks)
    ref_kw = {key: (_upcast(val) if key in ("bias",) else val) for key, val in kw.items()}
    r_out, r_lse, r_grads = _run(
        "xla", _upcast(q), _upcast(k), _upcast(v), ref_kw, cot, lse_cot, diff_bias, diff_sinks
    )
    assert out.dtype == dtype and lse.dtype == jnp.float32
    _assert_close(out, r_out, 2 * e, e, "out")
    _assert_close(lse, r_lse, 2 * e, 0.0, "lse")
    names = names + (("dbias",) if diff_bias else ()) + (("dsinks",) if diff_sinks else ())
    for name, g, rg in zip(names, grads, r_grads):
        _assert_close(g, rg, 8 * e, e, name, scale_by_max=True)
    return out, lse, grads


def _qkv(seed, batch, t, s, n, kh, h, hv, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        _normal(kq, batch + (t, n, h), dtype),
        _normal(kk, batch + (s, kh, h), dtype),
        _normal(kv, batch + (s, kh, hv), dtype),
    )


# (id, batch, T, S, N, K, H, Hv, kwargs)
CASES = [
    ("mha", (2,), 128, 128, 4, 4, 64, 64, {}),
    ("mha_odd_lengths", (2,), 77, 131, 4, 4, 64, 64, {}),
    ("gqa_causal", (2,), 96, 96, 8, 2, 64, 64, {"is_causal": True}),
    ("mqa", (2,), 64, 80, 4, 1, 128, 128, {}),
    ("mla_causal", (2,), 96, 96, 4, 4, 192, 128, {"is_causal": True}),
    ("causal_bottom_right_t_lt_s", (2,), 48, 160, 4, 2, 64, 64,
     {"is_causal": True, "diagonal_alignment": "bottom_right"}),
    ("causal_bottom_right_t_gt_s", (2,), 160, 48, 4, 2, 64, 64,
     {"is_causal": True, "diagonal_alignment": "bottom_right"}),
    ("causal_top_left_t_gt_s", (2,), 160, 48, 4, 2, 64, 64, {"is_causal": True}),
    ("window_causal", (2,), 128, 128, 4, 2, 64, 64, {"is_causal": True, "local_window_size": (31, 0)}),
    ("window_two_sided", (2,), 128, 128, 4, 2, 64, 64, {"local_window_size": (16, 8)}),
    ("window_bottom_right", (2,), 64, 128, 4, 2, 64, 64,
     {"local_window_size": (20, 3), "diagonal_alignment": "bottom_right"}),
    ("scale", (2,), 64, 64, 4, 4, 64, 64, {"scale": 0.3}),
    ("batch_dims", (2, 3), 40, 56, 2, 2, 64, 64, {"is_causal": True}),
    ("unbatched", (), 40, 56, 2, 2, 64, 64, {}),
    ("d256", (1,), 64, 64, 2, 2, 256, 256, {"is_causal": True}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    _, batch, t, s, n, kh, h, hv, kw = case
    q, k, v = _qkv(1, batch, t, s, n, kh, h, hv, dtype)
    _compare(q, k, v, kw, dtype=dtype)


def _lengths(values):
    return jnp.asarray(values, jnp.int32)


PADDING_CASES = [
    ("q_and_kv", {"query_seq_lengths": [100, 37], "key_value_seq_lengths": [120, 5]}),
    ("kv_only_causal", {"key_value_seq_lengths": [128, 70], "is_causal": True}),
    ("q_only", {"query_seq_lengths": [1, 128]}),
    ("causal_bottom_right", {"query_seq_lengths": [60, 20], "key_value_seq_lengths": [128, 90],
                             "is_causal": True, "diagonal_alignment": "bottom_right"}),
    ("window", {"query_seq_lengths": [128, 64], "key_value_seq_lengths": [100, 128],
                "is_causal": True, "local_window_size": (15, 0)}),
    ("empty_sequence", {"query_seq_lengths": [128, 50], "key_value_seq_lengths": [0, 77]}),
    # Rows 55.. of sequence 0 see no key (window of 15 past a 40-key sequence): the graph gets trimmed lengths.
    ("window_rows_past_keys", {"query_seq_lengths": [128, 90], "key_value_seq_lengths": [40, 128],
                               "is_causal": True, "local_window_size": (15, 0)}),
    ("two_sided_window_rows_past_keys", {"query_seq_lengths": [128, 100], "key_value_seq_lengths": [60, 128],
                                         "local_window_size": (10, 5)}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", PADDING_CASES, ids=[c[0] for c in PADDING_CASES])
def test_padding_lengths(case, dtype):
    _, kw = case
    kw = {key: (_lengths(val) if key.endswith("lengths") else val) for key, val in kw.items()}
    q, k, v = _qkv(2, (2,), 128, 128, 4, 2, 64, 64, dtype)
    out, lse, grads = _compare(q, k, v, kw, dtype=dtype)
    if "query_seq_lengths" in kw:
        ql = np.asarray(kw["query_seq_lengths"])
        for b in range(2):
            assert np.all(np.asarray(out[b, ql[b]:], np.float32) == 0)
            assert np.all(np.isneginf(np.asarray(lse[b, ql[b]:])))
            assert np.all(np.asarray(grads[0][b, ql[b]:], np.float32) == 0)
    if "key_value_seq_lengths" in kw:  # key rows past the lengths: exactly zero gradients (zero-filled results)
        kl = np.asarray(kw["key_value_seq_lengths"])
        for b in range(2):
            assert np.all(np.asarray(grads[1][b, kl[b]:], np.float32) == 0)
            assert np.all(np.asarray(grads[2][b, kl[b]:], np.float32) == 0)


BIAS_SHAPES = [("NTS", lambda B, N, T, S: (1, N, T, S)), ("BNTS", lambda B, N, T, S: (B, N, T, S)),
               ("B1TS", lambda B, N, T, S: (B, 1, T, S)), ("TS", lambda B, N, T, S: (T, S)),
               ("S", lambda B, N, T, S: (1, 1, 1, S))]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=[b[0] for b in BIAS_SHAPES])
def test_bias_and_dbias(shape, dtype):
    B, T, S, N = 2, 96, 112, 4
    q, k, v = _qkv(3, (B,), T, S, N, 2, 64, 64, dtype)
    bias = _normal(jax.random.key(33), shape[1](B, N, T, S), dtype)
    _compare(q, k, v, {"bias": bias, "is_causal": True}, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_with_padding(dtype):
    q, k, v = _qkv(4, (2,), 96, 96, 4, 4, 64, 64, dtype)
    bias = _normal(jax.random.key(44), (1, 4, 96, 96), dtype)
    kw = {"bias": bias, "query_seq_lengths": _lengths([96, 40]), "key_value_seq_lengths": _lengths([70, 96])}
    _compare(q, k, v, kw, dtype=dtype)


SINK_CASES = [
    ("learnable", {}),
    ("off_by_one", {"zero_sinks": True}),
    ("padding_window", {"query_seq_lengths": [96, 30], "key_value_seq_lengths": [80, 96], "is_causal": True,
                        "local_window_size": (20, 0)}),
    ("gqa_causal", {"is_causal": True, "gqa": True}),
    ("padding_window_rows_past_keys", {"query_seq_lengths": [96, 30], "key_value_seq_lengths": [40, 96],
                                       "is_causal": True, "local_window_size": (20, 0)}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", SINK_CASES, ids=[c[0] for c in SINK_CASES])
def test_sinks(case, dtype):
    _, kw = case
    kw = dict(kw)
    zero = kw.pop("zero_sinks", False)
    gqa = kw.pop("gqa", False)
    kw = {key: (_lengths(val) if key.endswith("lengths") else val) for key, val in kw.items()}
    q, k, v = _qkv(5, (2,), 96, 96, 4, 2 if gqa else 4, 64, 64, dtype)
    sinks = jnp.zeros((4,), jnp.float32) if zero else jax.random.normal(jax.random.key(55), (4,), jnp.float32) + 1.0
    kw["sinks"] = sinks
    _compare(q, k, v, kw, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lse_gradient(dtype):
    q, k, v = _qkv(6, (2,), 64, 96, 4, 2, 64, 64, dtype)
    kw = {"is_causal": True, "key_value_seq_lengths": _lengths([96, 50])}
    _compare(q, k, v, kw, dtype=dtype, lse_grad=True)


def test_deterministic_backward_is_bitwise_reproducible():
    import attnlib

    q, k, v = _qkv(7, (2,), 256, 256, 8, 2, 128, 128, jnp.bfloat16)

    def loss(q, k, v):
        out = attnlib.attention(q, k, v, is_causal=True, implementation="cudnn", deterministic_backward=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = g(q, k, v)
    for _ in range(3):
        again = g(q, k, v)
        for a, b in zip(first, again):
            assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    _compare(q, k, v, {"is_causal": True, "deterministic_backward": True}, dtype=jnp.bfloat16)


# ------------------------------------------------------------------------------------------------------------------
# dropout


def _dropout_attention(q, k, v, key, rate, **kw):
    import attnlib

    return attnlib.attention(q, k, v, implementation="cudnn", dropout_rate=rate, dropout_key=key, **kw)


def _extract_kept(key, rate, B, T, S, N, dtype, **kw):
    """cuDNN's keep mask `[B, T, N, S]` (and q, k), read off an identity value matrix.

    Where the attention mask already hides a key the probability is 0 whatever the dropout mask says; the reference
    multiplies those zeros by the extracted mask too, so the comparison stays exact.
    """
    kq, kk = jax.random.split(jax.random.key(8))
    q = _normal(kq, (B, T, N, 64), dtype)
    k = _normal(kk, (B, S, N, 64), dtype)
    eye = jnp.broadcast_to(jnp.eye(S, dtype=dtype)[None, :, None, :], (B, S, N, S))
    p_drop = jax.jit(lambda q, k, v: _dropout_attention(q, k, v, key, rate, **kw))(q, k, eye)
    return q, k, np.asarray(p_drop, np.float32) > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout_same_mask_forward_and_backward(dtype, causal):
    B, T, S, N, rate = 2, 64, 64, 2, 0.25
    key = jax.random.key(123)
    q, k, kept = _extract_kept(key, rate, B, T, S, N, dtype, is_causal=causal)
    visible = np.tril(np.ones((T, S), bool))[None, :, None, :] if causal else np.ones((1, T, 1, S), bool)
    visible = np.broadcast_to(visible, kept.shape)
    frac = kept[visible].mean()
    sigma = math.sqrt(rate * (1 - rate) / visible.sum())
    assert abs(frac - (1 - rate)) < 6 * sigma, f"kept fraction {frac:.4f} vs {1 - rate}"

    v = _normal(jax.random.key(9), (B, S, N, 64), dtype)
    cot = jax.random.normal(jax.random.key(10), (B, T, N, 64), jnp.float32)
    mask = jnp.asarray(kept, jnp.float32)  # [B, T, N, S], 1 = kept

    def cudnn_loss(q, k, v):
        return jnp.sum(_dropout_attention(q, k, v, key, rate, is_causal=causal).astype(jnp.float32) * cot)

    def ref(q, k, v):
        s = jnp.einsum("btnh,bsnh->btns", q, k, precision="highest") / math.sqrt(64)
        if causal:
            s = jnp.where(jnp.asarray(visible), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1) * mask / (1 - rate)
        return jnp.einsum("btns,bsnh->btnh", p, v, precision="highest")

    out = jax.jit(lambda q, k, v: _dropout_attention(q, k, v, key, rate, is_causal=causal))(q, k, v)
    e = _eps(dtype)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    _assert_close(out, ref(f32(q), f32(k), f32(v)), 2 * e / (1 - rate), e, "dropout out")
    grads = jax.jit(jax.grad(cudnn_loss, argnums=(0, 1, 2)))(q, k, v)
    r_grads = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * cot), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        _assert_close(g, rg, 8 * e / (1 - rate), e, f"dropout {name}", scale_by_max=True)


def test_dropout_key_changes_mask_and_is_reproducible():
    B, T, S, N = 1, 32, 64, 2
    _, _, a = _extract_kept(jax.random.key(1), 0.5, B, T, S, N, jnp.bfloat16)
    _, _, a2 = _extract_kept(jax.random.key(1), 0.5, B, T, S, N, jnp.bfloat16)
    _, _, b = _extract_kept(jax.random.key(2), 0.5, B, T, S, N, jnp.bfloat16)
    assert np.array_equal(a, a2)
    assert not np.array_equal(a, b)


def test_fp8_with_dropout_is_refused_and_small_dropout_calls_finish():
    """The README's test command on the H200 (2026-12-06) hit a CUDA illegal memory access in the worker that had
    just run an eager `fp8="current"` call with dropout on q = k = v = ones `[1, 8, 2, 16]` bfloat16: cuDNN was given
    an FP8 forward graph with dropout (on cuDNN 9.19 and 9.27 alike, at every size tried), a combination the other
    implementations refuse and docs/fp8.md lists as unsupported. Validation now refuses it for every implementation;
    here, in a child process (a fault poisons its process), the refusal comes first, then cuDNN's 16-bit dropout
    calls, eager and jitted, must finish with finite results."""
    code = (
        "import jax, jax.numpy as jnp, numpy as np, attnlib\n"
        "q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)\n"
        "key = jax.random.PRNGKey(0)\n"
        "for implementation in (None, 'cudnn'):\n"
        "    try:\n"
        "        attnlib.attention(q, q, q, fp8='current', dropout_rate=0.1, dropout_key=key,\n"
        "                          implementation=implementation)\n"
        "    except NotImplementedError as e:\n"
        "        print('REFUSED', 'dropout together with FP8' in str(e))\n"
        "def cudnn(q):\n"
        "    return attnlib.attention(q, q, q, implementation='cudnn', dropout_rate=0.1, dropout_key=key)\n"
        "outs = [cudnn(q), jax.jit(cudnn)(q)]\n"
        "print('FINITE', all(bool(np.isfinite(np.asarray(o, np.float32)).all()) for o in outs))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-4000:])
    assert run.stdout.split() == ["REFUSED", "True", "REFUSED", "True", "FINITE", "True"], run.stdout


# ------------------------------------------------------------------------------------------------------------------
# transforms, lowering, errors


def test_vmap_is_one_fused_call_and_matches():
    import attnlib

    q, k, v = _qkv(11, (3, 2), 64, 64, 4, 4, 64, 64, jnp.bfloat16)
    f = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn")
    batched = jax.jit(jax.vmap(f))
    hlo = batched.lower(q, k, v).as_text()
    assert hlo.count("custom_call @attnlib_cudnn_graph") == 1, hlo
    assert "tensor<6x64x4x64xbf16>" in hlo
    np.testing.assert_array_equal(np.asarray(batched(q, k, v), np.float32), np.asarray(jax.jit(f)(q, k, v), np.float32))
    grad = jax.jit(jax.vmap(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)))))
    hlo = grad.lower(q, k, v).as_text()
    assert hlo.count("custom_call @attnlib_cudnn_graph") == 2, "one forward and one backward call"
    g = grad(q, k, v)
    g_ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))))(q, k, v)
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32), rtol=0, atol=0)


def test_vmap_of_grad_with_bias_gives_per_example_dbias():
    import attnlib

    q, k, v = _qkv(12, (3, 2), 48, 48, 2, 2, 64, 64, jnp.bfloat16)
    bias = _normal(jax.random.key(13), (1, 2, 48, 48), jnp.bfloat16)
    loss = lambda q, k, v, b: jnp.sum(attnlib.attention(q, k, v, b, implementation="cudnn").astype(jnp.float32) ** 2)
    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=3), in_axes=(0, 0, 0, None)))(q, k, v, bias)
    one_by_one = jnp.stack([jax.jit(jax.grad(loss, argnums=3))(q[i], k[i], v[i], bias) for i in range(3)])
    _assert_close(per_example, one_by_one, 2 * _eps(jnp.bfloat16), _eps(jnp.bfloat16), "dbias", scale_by_max=True)


def test_jit_retrace_reuses_cached_graph():
    import attnlib
    from attnlib._src.backends.cudnn import executor as cudnn_attention

    q, k, v = _qkv(14, (1,), 32, 32, 2, 2, 64, 64, jnp.bfloat16)
    f = lambda q, k, v: attnlib.attention(q, k, v, implementation="cudnn")
    jax.jit(f)(q, k, v).block_until_ready()
    builds = cudnn_attention.CACHE.stats["builds"]
    jax.jit(lambda q, k, v: f(q, k, v) * 1)(q, k, v).block_until_ready()
    assert cudnn_attention.CACHE.stats["builds"] == builds


INFERENCE_CASES = [c for c in CASES if c[0] in ("gqa_causal", "mla_causal", "causal_bottom_right_t_gt_s",
                                                 "window_two_sided", "batch_dims")]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", INFERENCE_CASES + [
    ("padding_sinks_bias", (2,), 72, 88, 4, 2, 64, 64, {"is_causal": True, "padding": True, "sinks": True,
                                                         "bias": True}),
], ids=[c[0] for c in INFERENCE_CASES] + ["padding_sinks_bias"])  # fmt: skip
def test_inference_forward_without_stats_matches_reference(case, dtype):
    """Without `return_residual` and without a gradient, cuDNN runs a forward graph that writes no softmax stats."""
    import attnlib

    _, batch, t, s, n, kh, h, hv, kw = case
    q, k, v = _qkv(31, batch, t, s, n, kh, h, hv, dtype)
    kw = dict(kw)
    if kw.pop("padding", False):
        kw.update(query_seq_lengths=jnp.asarray([t, t - 9]), key_value_seq_lengths=jnp.asarray([s - 5, s]))
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
    if kw.pop("bias", False):
        kw["bias"] = _normal(jax.random.key(5), (1, n, t, s), dtype)
    run = lambda impl, *a, **extra: jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, **kw,
                                                                             **extra))(*a)  # fmt: skip
    text = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation="cudnn", **kw)).lower(q, k, v).as_text()
    assert "fwd_nostats" in text, "the inference graph did not run"
    out = run("cudnn", q, k, v)
    ref_kw = {key: (_upcast(val) if key == "bias" else val) for key, val in kw.items()}
    reference = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation="xla", **ref_kw))(
        _upcast(q), _upcast(k), _upcast(v))
    e = _eps(dtype)
    _assert_close(out, reference, 2 * e, e, "out")
    with_stats, _ = run("cudnn", q, k, v, return_residual=True)
    _assert_close(out, with_stats, 2 * e, e, "out vs the forward with stats")


def test_plan_autotuning_times_candidates_and_records_the_choice(monkeypatch):
    from attnlib._src.backends.cudnn import autotune, ffi, graphs

    spec = graphs.GraphSpec(direction="bwd", dtype="bfloat16", b=2, t=520, s=392, n=6, k=2, h=128, hv=64,
                            scale=0.09, right_bound=0)  # fmt: skip
    monkeypatch.setenv("ATTNLIB_CUDNN_AUTOTUNE", "1")
    entry = graphs.build(spec)
    assert "autotuned:" in entry.plan or "the only backend plan that builds" in entry.plan, entry.plan
    assert "timing failed" not in entry.plan
    ms = ffi.extension().time_graph(entry.blob, autotune.timing_tensors(spec), entry.workspace_bytes)
    assert 0.0 < ms < 1000.0
    monkeypatch.setenv("ATTNLIB_CUDNN_AUTOTUNE", "0")
    assert "heuristics' first" in graphs.build(spec).plan


def test_command_buffers_capture_the_graph_call(tmp_path):
    """XLA captures the graph call into a command buffer (CUDA graph) with the layer loop's fusions when the loop
    body is allowed to form one (`xla_gpu_graph_min_graph_size=1`; XLA's default minimum is more commands than this
    body has); with ATTNLIB_CUDNN_COMMAND_BUFFER=0 it does not. Both give the same result. XLA reports what it puts
    into each command buffer in its log (`command_buffer_conversion_pass`), and the extension counts the calls it
    recorded into XLA's capture."""
    code = (
        "import sys, jax, jax.numpy as jnp, numpy as np, attnlib\n"
        "q = (jax.random.normal(jax.random.key(0), (2, 64, 4, 64))).astype(jnp.bfloat16)\n"
        "def layer(x, _):\n"
        "    y = attnlib.attention(x, q, q, is_causal=True, implementation='cudnn')\n"
        "    return (y.astype(jnp.float32) * 0.5 + x.astype(jnp.float32)).astype(x.dtype), None\n"
        "options = {'xla_gpu_graph_min_graph_size': 1}\n"
        "f = jax.jit(lambda x: jax.lax.scan(layer, x, None, length=4)[0], compiler_options=options)\n"
        "f(q); np.save(sys.argv[1], np.asarray(f(q), np.float32))\n"
        "from attnlib import _attnlib_ffi; print('COUNTS', _attnlib_ffi.graph_replay_counts())\n"
    )
    results, captured, counts = [], [], []
    for flag in ("1", "0"):
        path = tmp_path / f"out{flag}.npy"
        env = dict(os.environ, ATTNLIB_CUDNN_COMMAND_BUFFER=flag, ATTNLIB_CACHE_DIR=str(tmp_path / "cache"),
                   TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_conversion_pass=2")  # fmt: skip
        argv = [sys.executable, "-c", code, str(path)]
        run = subprocess.run(argv, check=True, env=env, capture_output=True, text=True)
        created = [line for line in run.stderr.splitlines() if "Creating command buffer thunk with" in line]
        captured.append(any("ffi_call" in line or "attnlib" in line for line in created))
        results.append(np.load(path))
        line = next(line for line in run.stdout.splitlines() if line.startswith("COUNTS"))
        counts.append(ast.literal_eval(line.removeprefix("COUNTS ")))  # the dict the child printed
    assert captured == [True, False], captured
    recorded, not_recorded = counts
    assert recorded["xla_records"] >= 1 and recorded["failures"] == 0, recorded
    assert recorded["reissued"] == recorded["xla_records"], recorded  # cuDNN's launches issued again by attnlib
    assert not_recorded["xla_records"] == 0, not_recorded
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("window", [None, (20, 0)], ids=["causal", "causal_window"])
def test_dense_decode_matches_reference(window):
    """One query row per sequence, bottom-right causal against a dense cache with lengths (decoding): the float64
    reference of tests/reference.py, written from the definition."""
    from reference import reference_attention

    import attnlib

    q, k, v = _qkv(23, (3,), 1, 77, 8, 2, 64, 64, jnp.bfloat16)
    kw = dict(key_value_seq_lengths=jnp.asarray([77, 30, 1], jnp.int32), is_causal=True,
              diagonal_alignment="bottom_right", local_window_size=window)  # fmt: skip
    got = jax.jit(lambda *a: attnlib.attention(*a, implementation="cudnn", return_residual=True, **kw))(q, k, v)
    ref_out, ref_lse = reference_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), **kw)
    e = _eps(jnp.bfloat16)
    _assert_close(got[0], ref_out, 2 * e, e, "out")
    _assert_close(got[1], ref_lse, 2 * e, 0.0, "lse")


def test_decline_reasons_on_gpu():
    import attnlib

    q = jnp.zeros((1, 16, 2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="float32"):
        attnlib.attention(q, q, q, implementation="cudnn")
    q = jnp.zeros((1, 16, 2, 36), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        attnlib.attention(q, q, q, implementation="cudnn")
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="atan2"):
        attnlib.attention(q, q, q, implementation="cudnn", score_mod=lambda s, b, h, i, j: jnp.arctan2(s, 2.0))


def test_auto_dispatch_picks_cudnn():
    import attnlib

    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    assert attnlib.explain(q, q, q).implementation == "cudnn"


@pytest.mark.parametrize(
    "kw",
    [{"is_causal": True}, {"query_seq_lengths": [300, 17], "key_value_seq_lengths": [200, 333], "is_causal": True},
     {"is_causal": True, "diagonal_alignment": "bottom_right"}, {"local_window_size": (64, 0), "is_causal": True}],
    ids=["causal", "padding", "bottom_right_t_gt_s", "window"],
)  # fmt: skip
def test_max_logit_from_the_forward_graph(kw):
    """`return_max_logit` on cuDNN reads the forward graph's `score_max` (cuDNN 9.19: instead of Stats); it equals
    the float32 plain pass on the same bf16 inputs to float32 rounding, and `lse` (rebuilt as max + log sum_exp)
    keeps the usual tolerance."""
    import attnlib

    q, k, v = _qkv(21, (2,), 300, 333 if "diagonal_alignment" not in kw else 200, 8, 2, 128, 128, jnp.bfloat16)
    kw = {key: (jnp.asarray(val, jnp.int32) if key.endswith("lengths") else val) for key, val in kw.items()}
    attend = lambda impl, *a: attnlib.attention(  # noqa: E731
        *a, implementation=impl, return_residual=True, return_max_logit=True, **kw)
    out, lse, max_logit = jax.jit(lambda *a: attend("cudnn", *a))(q, k, v)
    with jax.default_matmul_precision("highest"):
        r_out, r_lse, r_max = attend("xla", *(_upcast(x) for x in (q, k, v)))
    e = _eps(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(max_logit), np.asarray(r_max), rtol=1e-5, atol=1e-4)
    _assert_close(out, r_out, 2 * e, e, "out")
    _assert_close(lse, r_lse, 2 * e, 0.0, "lse")
