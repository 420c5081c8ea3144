"""`return_max_logit=True` (docs/semantics.md) on every plain-JAX implementation against the float64 reference
(`tests/reference.py::reference_max_logit`): dense, GQA, masks, segments, THD, paged, modifiers, soft cap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, Tol
from reference import reference_attention, reference_max_logit

import attnlib


N, K = 6, 2
TOL = Tol(atol=2e-5, rtol=2e-6)


def _qkv(r, batch=(2,), t=11, s=14):
    f = lambda shape, scale=1.0: jnp.asarray(scale * r.standard_normal(shape), jnp.float32)  # noqa: E731
    return f(batch + (t, N, 8), 2.0), f(batch + (s, K, 8)), f(batch + (s, K, 8))


CASES = {
    "full": {},
    "causal_padding": dict(is_causal=True, query_seq_lengths=[11, 4], key_value_seq_lengths=[14, 0]),
    "softcap_window_bias": dict(logits_soft_cap=3.0, local_window_size=(3, 1), bias="random"),
    "segments": dict(
        q_segment_ids=[[1] * 5 + [2] * 6, [1] * 8 + [0] * 3], kv_segment_ids=[[1] * 6 + [2] * 8, [1] * 14]
    ),
    "score_mod_mask_mod": dict(
        score_mod=lambda s, b, h, i, j: s + 0.5 * h.astype(s.dtype), mask_mod=lambda b, h, i, j: j >= i
    ),
    "mask_hides_a_head": dict(mask="head1"),
}


def _kwargs(r, case, q, k):
    kw = dict(CASES[case])
    for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids", "kv_segment_ids"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    bias = mask = None
    if kw.pop("bias", None) == "random":
        bias = jnp.asarray(r.standard_normal((1, N, q.shape[1], k.shape[1])), jnp.float32)
    if kw.pop("mask", None) == "head1":
        mask = jnp.broadcast_to((jnp.arange(N) != 1)[:, None, None], (N, q.shape[1], k.shape[1]))
    return bias, mask, kw


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_reference(case, impl):
    r = np.random.default_rng(0)
    q, k, v = _qkv(r)
    bias, mask, kw = _kwargs(r, case, q, k)
    out, lse, max_logit = attnlib.attention(
        q, k, v, bias, mask, implementation=impl, return_residual=True, return_max_logit=True, **kw
    )
    assert max_logit.shape == (2, N) and max_logit.dtype == jnp.float32
    numpy_kw = {n: (np.asarray(x) if hasattr(x, "shape") else x) for n, x in kw.items()}
    args = (q, k, v, None if bias is None else np.asarray(bias), None if mask is None else np.asarray(mask))
    assert_close(max_logit, reference_max_logit(*args, **numpy_kw), TOL, what="max_logit")
    r_out, _ = reference_attention(*args, **numpy_kw)
    assert_close(out, r_out, Tol(atol=1e-5, rtol=1e-5), what="out")  # the other results are unchanged
    only = attnlib.attention(q, k, v, bias, mask, implementation=impl, return_max_logit=True, **kw)
    assert len(only) == 2 and np.array_equal(np.asarray(only[1]), np.asarray(max_logit))


def test_thd_gives_one_row_per_sequence(impl):
    r = np.random.default_rng(1)
    q = jnp.asarray(r.standard_normal((20, N, 8)), jnp.float32)
    kv = jnp.asarray(r.standard_normal((20, K, 8)), jnp.float32)
    cu = jnp.asarray([0, 7, 7, 16], jnp.int32)  # the second sequence is empty
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, is_causal=True)
    _, max_logit = attnlib.attention(q, kv, kv, implementation=impl, return_max_logit=True, **kw)
    expected = reference_max_logit(q, kv, kv, cu_seqlens_q=np.asarray(cu), cu_seqlens_kv=np.asarray(cu), is_causal=True)
    assert max_logit.shape == (3, N)
    assert_close(max_logit, expected, TOL, what="max_logit")
    assert np.all(np.isneginf(np.asarray(max_logit[1])))


def test_paged_and_unbatched():
    r = np.random.default_rng(2)
    cache = attnlib.PagedKVCache.create(2, 6, 4, K, 8, dtype=jnp.float32)
    new = lambda: jnp.asarray(r.standard_normal((2, 9, K, 8)), jnp.float32)  # noqa: E731
    cache = cache.append(new(), new(), lengths=jnp.asarray([9, 5], jnp.int32))
    q = jnp.asarray(r.standard_normal((2, 3, N, 8)), jnp.float32)
    kw = dict(is_causal=True, diagonal_alignment="bottom_right")
    _, max_logit = attnlib.attention(q, cache, None, return_max_logit=True, **kw)
    expected = reference_max_logit(
        q, cache.k_pages, cache.v_pages, page_table=np.asarray(cache.page_table),
        key_value_seq_lengths=np.asarray(cache.lengths), **kw,
    )  # fmt: skip
    assert_close(max_logit, expected, TOL, what="paged max_logit")
    q1, k1 = (
        jnp.asarray(r.standard_normal((5, N, 8)), jnp.float32),
        jnp.asarray(r.standard_normal((7, K, 8)), jnp.float32),
    )
    _, unbatched = attnlib.attention(q1, k1, k1, return_max_logit=True)
    assert unbatched.shape == (N,)
    assert_close(unbatched, reference_max_logit(q1[None], k1[None], k1[None])[0], TOL, what="unbatched")


def test_not_differentiable_and_jit_vmap():
    r = np.random.default_rng(3)
    q, k, v = _qkv(r)

    def loss(q):
        out, max_logit = attnlib.attention(q, k, v, return_max_logit=True)
        return jnp.sum(out) + jnp.sum(max_logit)

    plain = jax.grad(lambda q: jnp.sum(attnlib.attention(q, k, v)))(q)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(q)), np.asarray(plain), rtol=1e-6, atol=1e-6)
    eager = attnlib.attention(q, k, v, return_max_logit=True)[1]
    jitted = jax.jit(lambda q: attnlib.attention(q, k, v, return_max_logit=True)[1])(q)
    mapped = jax.vmap(lambda q, k, v: attnlib.attention(q, k, v, return_max_logit=True)[1])(q, k, v)
    for other in (jitted, mapped):
        np.testing.assert_allclose(np.asarray(other), np.asarray(eager), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"`return_max_logit` must be .*Got 1"):
        attnlib.attention(q, k, v, return_max_logit=1)
