"""Property-based tests (hypothesis) over random attention configurations.

* Random dense configurations (sizes, heads, masks, windows, alignment, padding, bias broadcast shapes, soft cap,
  sinks, xla / xla_chunked with random key blocks) match the float64 reference, forward and backward.
* Metamorphic properties that need no reference: padding invariance, per-row bias shifts, THD = separate calls,
  packed segments = separate calls, key permutation invariance.

The default profile is derandomized (a fixed sequence of examples: CI never flakes); set
`HYPOTHESIS_PROFILE=explore` to search new examples locally.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    lengths,
    normal,
    to_f64,
)
from hypothesis import given, HealthCheck, Phase, settings, strategies as st
from reference import reference_attention, reference_attention_vjp

import attnlib


pytestmark = pytest.mark.full  # hypothesis sweeps: the full matrix (`-m full`), not the fast tier

# no `explain` phase: it re-runs a failing example many times, slow on CPU
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, phases=PHASES, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


implementations = st.sampled_from(["xla", "xla_chunked", *(attnlib.XlaChunked(block_k=b) for b in (1, 2, 3, 7))])


@st.composite
def configs(draw):
    b = draw(st.integers(1, 2))
    t = draw(st.integers(1, 9))
    s = draw(st.integers(1, 11))
    k = draw(st.integers(1, 3))
    n = k * draw(st.integers(1, 3))
    h = draw(st.sampled_from([1, 3, 4, 8]))
    hv = draw(st.sampled_from([h, 2, 5]))
    cfg = dict(b=b, t=t, s=s, n=n, k=k, h=h, hv=hv, seed=draw(st.integers(0, 2**31 - 1)))
    static = {}
    if draw(st.booleans()):
        static["is_causal"] = True
    if draw(st.booleans()):
        static["diagonal_alignment"] = "bottom_right"
    window = draw(st.one_of(st.none(), st.integers(0, 4), st.tuples(st.integers(0, 5), st.integers(0, 5))))
    if window is not None:
        static["local_window_size"] = window
    if draw(st.booleans()):
        static["logits_soft_cap"] = draw(st.sampled_from([0.5, 2.0, 10.0]))
    if draw(st.booleans()):
        static["scale"] = draw(st.sampled_from([0.1, 0.7, 1.3]))
    cfg["static"] = static
    cfg["q_lengths"] = draw(st.one_of(st.none(), st.lists(st.integers(0, t), min_size=b, max_size=b)))
    cfg["kv_lengths"] = draw(st.one_of(st.none(), st.lists(st.integers(0, s), min_size=b, max_size=b)))
    full = (b, n, t, s)
    # a broadcast shape: each axis full or 1, leading axes possibly dropped
    if draw(st.booleans()):
        shape = tuple(d if draw(st.booleans()) else 1 for d in full)
        cfg["bias_shape"] = shape[draw(st.integers(0, 2)) :]
    if draw(st.booleans()):
        shape = tuple(d if draw(st.booleans()) else 1 for d in full)
        cfg["mask_shape"] = shape[draw(st.integers(0, 2)) :]
    cfg["sinks"] = draw(st.sampled_from([None, "random", "zeros"]))
    return cfg


def _build(cfg):
    r = np.random.default_rng(cfg["seed"])
    b, t, s, n, k, h, hv = (cfg[x] for x in ("b", "t", "s", "n", "k", "h", "hv"))
    arrays = dict(query=normal(r, (b, t, n, h)), key=normal(r, (b, s, k, h)), value=normal(r, (b, s, k, hv)))
    if "bias_shape" in cfg:
        arrays["bias"] = normal(r, cfg["bias_shape"])
    if "mask_shape" in cfg:
        arrays["mask"] = jnp.asarray(r.random(cfg["mask_shape"]) < 0.75)
    if cfg["q_lengths"] is not None:
        arrays["query_seq_lengths"] = lengths(cfg["q_lengths"])
    if cfg["kv_lengths"] is not None:
        arrays["key_value_seq_lengths"] = lengths(cfg["kv_lengths"])
    if cfg["sinks"] == "random":
        arrays["sinks"] = normal(r, (n,))
    elif cfg["sinks"] == "zeros":
        arrays["sinks"] = jnp.zeros((n,), jnp.float32)
    cot = normal(r, (b, t, n, hv))
    return arrays, cot


def _call(impl, arrays, static):
    a = dict(arrays)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    bias, mask = a.pop("bias", None), a.pop("mask", None)
    return attnlib.attention(q, k, v, bias, mask, implementation=impl, return_residual=True, **a, **static)


@pytest.mark.slow
@settings(max_examples=30)
@given(cfg=configs(), impl=implementations)
def test_random_configuration_matches_reference(cfg, impl):
    arrays, cot = _build(cfg)
    static = cfg["static"]
    diff_names = [x for x in ("query", "key", "value", "bias", "sinks") if x in arrays]
    diff = {x: arrays[x] for x in diff_names}
    rest = {x: a for x, a in arrays.items() if x not in diff}

    def f(diff, rest, cot):
        (out, lse), vjp = jax.vjp(lambda d: _call(impl, {**rest, **d}, static), diff)
        return out, lse, vjp((cot, jnp.zeros_like(lse)))[0]

    out, lse, grads = jax.jit(f)(diff, rest, cot)

    ref_kw = {x: to_f64(a) for x, a in arrays.items()}
    q, k, v = ref_kw.pop("query"), ref_kw.pop("key"), ref_kw.pop("value")
    bias, mask = ref_kw.pop("bias", None), ref_kw.pop("mask", None)
    ref_out, ref_lse = reference_attention(q, k, v, bias, mask, **ref_kw, **static)
    assert_out_close(out, ref_out, jnp.float32)
    assert_lse_close(lse, ref_lse, jnp.float32)
    empty = np.isneginf(ref_lse)
    assert (np.asarray(out)[empty] == 0).all()
    ref_grads = reference_attention_vjp(q, k, v, bias, mask, d_out=to_f64(cot), **ref_kw, **static)
    for x in diff_names:
        assert_grad_close(grads[x], ref_grads[x], jnp.float32, what=f"d{x}")
    assert (np.asarray(grads["query"])[empty] == 0).all()


# ------------------------------------------------------------------------------------------------------------------
# metamorphic properties


small = dict(n=st.sampled_from([(2, 1), (3, 3), (4, 2)]), h=st.sampled_from([2, 4]), seed=st.integers(0, 2**31 - 1))


@settings(max_examples=10)
@given(t=st.integers(1, 7), s=st.integers(1, 9), pad_t=st.integers(0, 4), pad_s=st.integers(1, 5),
       causal=st.booleans(), bottom_right=st.booleans(), impl=implementations, **small)  # fmt: skip
def test_padding_invariance(t, s, pad_t, pad_s, causal, bottom_right, impl, n, h, seed):
    # padded inputs with lengths = the unpadded call on the valid prefix; padding rows are 0, lse -inf
    (nq, nk), r = n, np.random.default_rng(seed)
    q, k, v = normal(r, (1, t + pad_t, nq, h)), normal(r, (1, s + pad_s, nk, h)), normal(r, (1, s + pad_s, nk, h))
    kw = dict(is_causal=causal, diagonal_alignment="bottom_right" if bottom_right else "top_left")
    out, lse = jax.jit(
        lambda q, k, v, ql, kl: attnlib.attention(q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                                  implementation=impl, return_residual=True, **kw)
    )(q, k, v, lengths([t]), lengths([s]))  # fmt: skip
    out0, lse0 = jax.jit(
        lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, return_residual=True, **kw)
    )(q[:, :t], k[:, :s], v[:, :s])
    np.testing.assert_allclose(np.asarray(out[:, :t]), np.asarray(out0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse[:, :t]), np.asarray(lse0), rtol=1e-5, atol=1e-5)
    assert (np.asarray(out[:, t:]) == 0).all() and np.isneginf(np.asarray(lse[:, t:])).all()


@settings(max_examples=10)
@given(t=st.integers(1, 7), s=st.integers(1, 9), impl=implementations, **small)
def test_row_bias_shift(t, s, impl, n, h, seed):
    # adding c[i] to every logit of row i leaves out unchanged and shifts lse by c[i]
    (nq, nk), r = n, np.random.default_rng(seed)
    q, k, v = normal(r, (2, t, nq, h)), normal(r, (2, s, nk, h)), normal(r, (2, s, nk, h))
    bias = normal(r, (2, nq, t, s))
    shift = normal(r, (2, nq, t, 1), scale=3.0)
    f = jax.jit(lambda q, k, v, b: attnlib.attention(q, k, v, b, implementation=impl, return_residual=True))
    out, lse = f(q, k, v, bias)
    out2, lse2 = f(q, k, v, bias + shift)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(out), rtol=1e-5, atol=2e-5)
    expected = np.asarray(lse) + np.transpose(np.asarray(shift)[..., 0], (0, 2, 1))
    np.testing.assert_allclose(np.asarray(lse2), expected, rtol=1e-5, atol=2e-5)


@st.composite
def packed_lengths(draw):
    num = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(0, 5), min_size=num, max_size=num))
    kv_lens = draw(st.lists(st.integers(0, 6), min_size=num, max_size=num))
    return q_lens, kv_lens, draw(st.integers(0, 3)), draw(st.integers(0, 3))


def _separate_calls(q, k, v, q_lens, kv_lens, impl, kw):
    """Concatenated per-sequence dense calls: `[sum(q_lens), N, Hv]` outputs and `[sum(q_lens), N]` lse."""
    f = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, return_residual=True, **kw))
    outs, lses = [], []
    qo = ko = 0
    for tq, tk in zip(q_lens, kv_lens, strict=True):
        if tq == 0:
            pass
        elif tk == 0:
            outs.append(np.zeros((tq,) + q.shape[1:-1] + v.shape[-1:], np.float32))
            lses.append(np.full((tq, q.shape[1]), -np.inf, np.float32))
        else:
            o, l = f(q[qo : qo + tq], k[ko : ko + tk], v[ko : ko + tk])
            outs.append(np.asarray(o))
            lses.append(np.asarray(l))
        qo += tq
        ko += tk
    return np.concatenate(outs) if outs else None, np.concatenate(lses) if lses else None


@settings(max_examples=10)
@given(lens=packed_lengths(), causal=st.booleans(), bottom_right=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 3))), impl=implementations,
       **small)  # fmt: skip
def test_thd_equals_separate_calls(lens, causal, bottom_right, window, impl, n, h, seed):
    q_lens, kv_lens, pad_q, pad_kv = lens
    (nq, nk), r = n, np.random.default_rng(seed)
    tq, tk = sum(q_lens) + pad_q, sum(kv_lens) + pad_kv
    if tq == 0 or tk == 0:
        return
    q, k, v = normal(r, (tq, nq, h)), normal(r, (tk, nk, h)), normal(r, (tk, nk, 3))
    kw = dict(is_causal=causal, diagonal_alignment="bottom_right" if bottom_right else "top_left",
              local_window_size=window)  # fmt: skip
    cu_q = lengths(np.concatenate([[0], np.cumsum(q_lens)]))
    cu_kv = lengths(np.concatenate([[0], np.cumsum(kv_lens)]))
    out, lse = jax.jit(
        lambda q, k, v, cq, ck: attnlib.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck,
                                                  implementation=impl, return_residual=True, **kw)
    )(q, k, v, cu_q, cu_kv)  # fmt: skip
    want_out, want_lse = _separate_calls(q, k, v, q_lens, kv_lens, impl, kw)
    valid = sum(q_lens)
    if want_out is not None:
        np.testing.assert_allclose(np.asarray(out[:valid]), want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse[:valid])), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(np.asarray(lse[:valid])[fin], want_lse[fin], rtol=1e-5, atol=1e-5)
    assert (np.asarray(out[valid:]) == 0).all() and np.isneginf(np.asarray(lse[valid:])).all()


@settings(max_examples=10)
@given(lens=packed_lengths(), causal=st.booleans(), bottom_right=st.booleans(), impl=implementations, **small)
def test_segments_equal_separate_calls(lens, causal, bottom_right, impl, n, h, seed):
    # the same packing as THD, expressed as one batch row with segment ids (ids 1.., 0 = padding)
    q_lens, kv_lens, pad_q, pad_kv = lens
    (nq, nk), r = n, np.random.default_rng(seed)
    tq, tk = sum(q_lens) + pad_q + 1, sum(kv_lens) + pad_kv + 1  # >= 1 padding token each
    q, k, v = normal(r, (tq, nq, h)), normal(r, (tk, nk, h)), normal(r, (tk, nk, 3))
    qs = np.zeros(tq, np.int32)
    ks = np.zeros(tk, np.int32)
    qs[: sum(q_lens)] = np.repeat(np.arange(1, len(q_lens) + 1), q_lens)
    ks[: sum(kv_lens)] = np.repeat(np.arange(1, len(kv_lens) + 1), kv_lens)
    kw = dict(is_causal=causal, diagonal_alignment="bottom_right" if bottom_right else "top_left")
    out, lse = jax.jit(
        lambda q, k, v, qs, ks: attnlib.attention(q[None], k[None], v[None], q_segment_ids=qs[None],
                                                  kv_segment_ids=ks[None], implementation=impl,
                                                  return_residual=True, **kw)
    )(q, k, v, jnp.asarray(qs), jnp.asarray(ks))  # fmt: skip
    want_out, want_lse = _separate_calls(q, k, v, q_lens, kv_lens, impl, kw)
    out, lse = np.asarray(out[0]), np.asarray(lse[0])
    valid = sum(q_lens)
    if want_out is not None:
        np.testing.assert_allclose(out[:valid], want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.isneginf(lse[:valid]), np.isneginf(want_lse))
    assert (out[valid:] == 0).all() and np.isneginf(lse[valid:]).all()


@settings(max_examples=10)
@given(t=st.integers(1, 6), s=st.integers(2, 9), impl=implementations, data=st.data(), **small)
def test_key_permutation_invariance(t, s, impl, data, n, h, seed):
    # without position-dependent masks, permuting keys/values (and the mask and bias columns) changes nothing
    (nq, nk), r = n, np.random.default_rng(seed)
    perm = np.asarray(data.draw(st.permutations(range(s))))
    q, k, v = normal(r, (1, t, nq, h)), normal(r, (1, s, nk, h)), normal(r, (1, s, nk, h))
    bias = normal(r, (1, nq, t, s))
    mask = jnp.asarray(r.random((1, 1, t, s)) < 0.7)
    f = jax.jit(lambda q, k, v, b, m: attnlib.attention(q, k, v, b, m, implementation=impl))
    out = f(q, k, v, bias, mask)
    out_p = f(q, k[:, perm], v[:, perm], bias[..., perm], mask[..., perm])
    np.testing.assert_allclose(np.asarray(out_p), np.asarray(out), rtol=1e-5, atol=1e-5)
