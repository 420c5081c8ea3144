"""`score_mod` / `mask_mod` / `score_mod_args` (docs/flex_attention.md) on the plain-JAX implementations.

Against the independent float64 reference (`tests/reference.py`, which calls the same user functions per element in
float64), for `xla` and multi-block `xla_chunked` (5-key blocks: S = 19 spans four blocks, the last one ragged):
forward `out` / `lse`, and the VJP with random cotangents on both outputs for query, key, value, bias, sinks and the
float `score_mod_args`. Then transformations (jit, vmap, closures over traced values), validation messages, the
structural cache key, and the reference's own backward against finite differences.

Sizes are odd and distinct: B=2, T=13, S=19, N=6, K=2 (GQA), H=16, Hv=24.
"""

import dataclasses
import functools
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_finite,
    assert_grad_close,
    assert_lse_close,
    assert_matches_finite_differences,
    assert_out_close,
    bitwise_equal,
    lengths,
    normal,
    segment_ids_from_runs,
    to_f64,
)
from hypothesis import given, HealthCheck, settings, strategies as st
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src import modifiers
from attnlib._src.dropout import dropout_keep_mask


B, T, S, N, K, H, HV = 2, 13, 19, 6, 2, 16, 24


def qkv(r, *, batch=(B,), t=T, s=S, dtype=jnp.float32):
    return (
        normal(r, tuple(batch) + (t, N, H), dtype),
        normal(r, tuple(batch) + (s, K, H), dtype),
        normal(r, tuple(batch) + (s, K, HV), dtype),
    )


# ------------------------------------------------------------------------------------------------------------------
# user functions (written for one element; dtype-generic so that the float64 reference computes in float64)


def softcap_mod(c):
    return lambda score, b, h, q_idx, kv_idx: c * jnp.tanh(score / c)


def alibi(score, b, h, q_idx, kv_idx, slope):
    return score + slope * (kv_idx - q_idx).astype(score.dtype)


def head_sin(score, b, h, q_idx, kv_idx, *args):
    return score + 0.5 * jnp.sin(score * (h + 1).astype(score.dtype))


def batch_scale(score, b, h, q_idx, kv_idx, *args):
    return score * (1.0 + 0.25 * b.astype(score.dtype)) + 0.1 * (h % 3).astype(score.dtype)


def double(score, b, h, q_idx, kv_idx, *args):
    return 2.0 * score


def prefix_lm(b, h, q_idx, kv_idx, *args):
    return (kv_idx <= q_idx) | (kv_idx < 5)


def sliding_window(b, h, q_idx, kv_idx, *args):
    return jnp.abs(q_idx - kv_idx) <= 3


def document(b, h, q_idx, kv_idx, *args):
    return q_idx // 4 == kv_idx // 4


def neg_inf_mod(score, b, h, q_idx, kv_idx, *args):
    # keys more than 2 ahead of the query, and every key of query position 4 (a fully masked row)
    return jnp.where((kv_idx > q_idx + 2) | (q_idx == 4), -jnp.inf, score)


def args_score(score, b, h, q_idx, kv_idx, w, q_doc, kv_doc, head_on, slope):
    return score + w + slope * (kv_idx - q_idx).astype(score.dtype) * (q_doc + 1).astype(score.dtype)


def args_mask(b, h, q_idx, kv_idx, w, q_doc, kv_doc, head_on, slope):
    return (q_doc == kv_doc) & (head_on | (kv_idx <= q_idx))


# ------------------------------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    arrays: dict  # query, key, value and the other array arguments (traced under jit)
    args: tuple = ()  # score_mod_args
    static: dict = dataclasses.field(default_factory=dict)
    score_mod: Callable | None = None
    mask_mod: Callable | None = None


def make(r, d=jnp.float32, *, args=(), score_mod=None, mask_mod=None, t=T, s=S, batch=(B,), **kwargs):
    q, k, v = qkv(r, batch=batch, t=t, s=s, dtype=d)
    arrays = {"query": q, "key": k, "value": v}
    static = {}
    for name, x in kwargs.items():
        (arrays if isinstance(x, jax.Array) else static)[name] = x
    return Case(arrays, tuple(args), static, score_mod, mask_mod)


def _slopes(r):
    return normal(r, (N, 1, 1), jnp.float32, 0.3)


def _segments(r, d, **kw):
    # q: ids 1, 2, 7 (no keys: fully masked rows), 5, then padding; kv: ids 1, 2, 5, then padding
    qs = np.stack([segment_ids_from_runs([(1, 4), (2, 3), (7, 2), (5, 2)], T),
                   segment_ids_from_runs([(3, 6), (4, 7)], T)])  # fmt: skip
    ks = np.stack([segment_ids_from_runs([(1, 6), (2, 4), (5, 6)], S),
                   segment_ids_from_runs([(3, 2), (4, 15)], S)])  # fmt: skip
    return make(r, d, q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks), **kw)


def _thd(r, d, **kw):
    # 4 sequences; sequence 1 empty in both; sequence 2 has queries but no keys; rows past cu[-1] are padding.
    return make(r, d, batch=(), cu_seqlens_q=lengths([0, 3, 3, 7, 11]), cu_seqlens_kv=lengths([0, 5, 5, 5, 17]),
                **kw)  # fmt: skip


def _args(r, thd=False):
    """Float `[B, 1, T, S]` (THD `[1, T, S]`), int `[T, 1]` and `[S]`, bool `[N, 1, 1]`, float `[N, 1, 1]`."""
    w = normal(r, ((1,) if thd else (B, 1)) + (T, S), jnp.float32, 0.5)
    q_doc = jnp.asarray((np.arange(T) // 5)[:, None], jnp.int32)
    kv_doc = jnp.asarray(np.arange(S) // 7, jnp.int32)
    head_on = jnp.asarray(np.arange(N)[:, None, None] % 2 == 0)
    return (w, q_doc, kv_doc, head_on, _slopes(r))


CASES: dict[str, Callable] = {
    "softcap_as_score_mod": lambda r, d: make(r, d, score_mod=softcap_mod(2.5)),
    "alibi_args": lambda r, d: make(r, d, score_mod=alibi, args=(_slopes(r),)),
    "alibi_args_causal_br": lambda r, d: make(
        r, d, score_mod=alibi, args=(_slopes(r),), is_causal=True, diagonal_alignment="bottom_right"
    ),
    "head_sin": lambda r, d: make(r, d, score_mod=head_sin),
    "prefix_lm": lambda r, d: make(r, d, mask_mod=prefix_lm),
    "sliding_window_mask_mod": lambda r, d: make(r, d, mask_mod=sliding_window),
    "document_mask": lambda r, d: make(r, d, mask_mod=document, score_mod=head_sin),
    "neg_inf": lambda r, d: make(r, d, score_mod=neg_inf_mod),
    "neg_inf_softcap_sinks": lambda r, d: make(
        r, d, score_mod=neg_inf_mod, logits_soft_cap=3.0, sinks=normal(r, (N,), jnp.float32)
    ),
    "causal_tl_prefix_lm_alibi": lambda r, d: make(
        r, d, is_causal=True, mask_mod=prefix_lm, score_mod=alibi, args=(_slopes(r),)
    ),
    "causal_br_neg_inf": lambda r, d: make(
        r, d, is_causal=True, diagonal_alignment="bottom_right", score_mod=neg_inf_mod
    ),  # fmt: skip
    "causal_br_T>S_document": lambda r, d: make(
        r, d, t=17, s=11, is_causal=True, diagonal_alignment="bottom_right", mask_mod=document, score_mod=head_sin
    ),
    "lengths_br_batch_scale": lambda r, d: make(
        r,
        d,
        query_seq_lengths=lengths([10, 13]),
        key_value_seq_lengths=lengths([15, 0]),
        is_causal=True,
        diagonal_alignment="bottom_right",
        score_mod=batch_scale,
        mask_mod=prefix_lm,
    ),  # fmt: skip
    "segments_br": lambda r, d: _segments(
        r, d, is_causal=True, diagonal_alignment="bottom_right", score_mod=batch_scale, mask_mod=document
    ),
    "segments_alibi": lambda r, d: _segments(r, d, score_mod=alibi, args=(_slopes(r),)),
    "thd": lambda r, d: _thd(r, d, score_mod=batch_scale, mask_mod=prefix_lm),
    "thd_causal_br_args": lambda r, d: _thd(
        r,
        d,
        is_causal=True,
        diagonal_alignment="bottom_right",
        score_mod=args_score,
        mask_mod=args_mask,
        args=_args(r, thd=True),
        sinks=normal(r, (N,), jnp.float32),
    ),  # fmt: skip
    "sinks": lambda r, d: make(
        r, d, score_mod=head_sin, mask_mod=sliding_window, sinks=normal(r, (N,), jnp.float32)
    ),  # fmt: skip
    "bias": lambda r, d: make(r, d, score_mod=alibi, args=(_slopes(r),), bias=normal(r, (B, N, T, S), d)),
    "softcap_order": lambda r, d: make(
        r, d, score_mod=double, logits_soft_cap=2.0, bias=normal(r, (1, N, 1, S), d)
    ),  # fmt: skip
    "args_all_dtypes": lambda r, d: make(r, d, score_mod=args_score, mask_mod=args_mask, args=_args(r)),
    "everything": lambda r, d: make(
        r,
        d,
        bias=normal(r, (B, 1, T, S), d),
        mask=jnp.asarray(r.random((1, N, T, S)) < 0.85),
        is_causal=True,
        diagonal_alignment="bottom_right",
        local_window_size=(9, 2),
        query_seq_lengths=lengths([12, 8]),
        key_value_seq_lengths=lengths([19, 10]),
        logits_soft_cap=5.0,
        sinks=normal(r, (N,), jnp.float32),
        score_mod=args_score,
        mask_mod=args_mask,
        args=_args(r),
    ),  # fmt: skip
    "paged": lambda r, d: _paged(r, d),
    "dropout": lambda r, d: make(
        r,
        d,
        dropout_rate=0.3,
        dropout_key=jax.random.key(7),
        score_mod=head_sin,
        mask_mod=prefix_lm,
        is_causal=True,
        diagonal_alignment="bottom_right",
    ),  # fmt: skip
}


def _paged(r, d):
    page_size, num_pages, t = 4, 9, 7  # 3 pages per sequence
    q = normal(r, (B, t, N, H), d)
    k = normal(r, (num_pages, page_size, K, H), d)
    v = normal(r, (num_pages, page_size, K, HV), d)
    arrays = {"query": q, "key": k, "value": v, "page_table": lengths([[5, 1, 7], [2, 8, 0]]),
              "key_value_seq_lengths": lengths([10, 7])}  # fmt: skip
    static = {"is_causal": True, "diagonal_alignment": "bottom_right"}
    return Case(arrays, (_slopes(r),), static, alibi, document)


def _seed(name: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**32


def build(name: str, dtype=jnp.float32) -> Case:
    return CASES[name](np.random.default_rng(_seed(name)), dtype)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def reference_kwargs(case: Case) -> dict:
    kw = {n: to_f64(x) for n, x in case.arrays.items() if n != "dropout_key"}
    kw.update(case.static)
    if case.static.get("dropout_rate", 0.0) > 0:
        q, k = case.arrays["query"], case.arrays["key"]
        shape = (math.prod(q.shape[:-3]), q.shape[-2], q.shape[-3], k.shape[-3])
        kw["dropout_keep"] = np.asarray(dropout_keep_mask(case.arrays["dropout_key"], kw["dropout_rate"], shape))
    kw.update(score_mod=case.score_mod, mask_mod=case.mask_mod, score_mod_args=tuple(to_f64(a) for a in case.args))
    return kw


@functools.cache
def reference_results(name: str, dtype_name: str):
    """float64 `(out, lse, grads, d_out, d_lse)` of a case (shared by the implementations)."""
    case = build(name, jnp.dtype(dtype_name))
    kw = reference_kwargs(case)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    out, lse = reference_attention(q, k, v, bias, mask, **kw)
    r = np.random.default_rng(_seed(name) + 1)
    d_out = normal(r, out.shape, jnp.dtype(dtype_name))
    d_lse = normal(r, lse.shape, jnp.float32)
    grads = reference_attention_vjp(q, k, v, bias, mask, d_out=to_f64(d_out), d_lse=to_f64(d_lse), **kw)
    return out, lse, grads, d_out, d_lse


def diff_names(case: Case) -> list[str]:
    names = ["query", "key", "value", "bias", "sinks"]
    if "page_table" in case.arrays:
        return []  # paged KV: gradients are not part of the contract
    return [n for n in names if n in case.arrays]


def library_fwd_vjp(impl: str, case: Case):
    """A jitted `(d_out, d_lse) -> (out, lse, grads)`; grads has the float `score_mod_args` under "args"."""
    float_args = [i for i, a in enumerate(case.args) if _is_float(a)]
    names = diff_names(case)

    def call(diff, rest):
        arrays = {**rest, **{n: diff[n] for n in names}}
        args = list(case.args)
        for i, a in zip(float_args, diff["args"], strict=False):  # no differentiated args for paged KV
            args[i] = a
        q, k, v = arrays.pop("query"), arrays.pop("key"), arrays.pop("value")
        bias, mask = arrays.pop("bias", None), arrays.pop("mask", None)
        return attnlib.attention(
            q, k, v, bias, mask, implementation=impl, return_residual=True, score_mod=case.score_mod,
            mask_mod=case.mask_mod, score_mod_args=tuple(args), **arrays, **case.static,
        )  # fmt: skip

    @jax.jit
    def fwd_vjp(diff, rest, d_out, d_lse):
        (out, lse), vjp = jax.vjp(lambda dd: call(dd, rest), diff)
        (g,) = vjp((d_out, d_lse))
        return out, lse, g

    diff = {n: case.arrays[n] for n in names}
    diff["args"] = tuple(case.args[i] for i in float_args) if names else ()
    rest = {n: x for n, x in case.arrays.items() if n not in names}
    return functools.partial(fwd_vjp, diff, rest), float_args


def check(impl: str, name: str, dtype=jnp.float32):
    case = build(name, dtype)
    ref_out, ref_lse, ref_grads, d_out, d_lse = reference_results(name, jnp.dtype(dtype).name)
    run, float_args = library_fwd_vjp(impl, case)
    out, lse, grads = run(d_out, d_lse)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert_out_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)

    empty = np.isneginf(ref_lse)
    if empty.any():
        assert (np.asarray(to_f64(out))[empty] == 0).all(), "out of a fully masked row is not exactly 0"
    for n in diff_names(case):
        assert grads[n].dtype == case.arrays[n].dtype
        assert_finite(grads[n], f"d{n}")
        assert_grad_close(grads[n], ref_grads[n], dtype, what=f"d{n}")
    if "query" in grads and empty.any():
        assert (np.asarray(to_f64(grads["query"]))[empty] == 0).all(), "dq of a fully masked row is not 0"
    if diff_names(case):
        for i, g in zip(float_args, grads["args"], strict=True):
            assert g.shape == case.args[i].shape and g.dtype == case.args[i].dtype
            assert_finite(g, f"dscore_mod_args[{i}]")
            assert_grad_close(g, ref_grads["score_mod_args"][i], dtype, what=f"dscore_mod_args[{i}]")

    out2, lse2, grads2 = run(d_out, d_lse)  # bitwise determinism
    assert bitwise_equal(out, out2) and bitwise_equal(lse, lse2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        assert bitwise_equal(a, b)
    return out, lse


@pytest.mark.parametrize("name", list(CASES))
def test_against_reference(impl, name):
    check(impl, name)


@pytest.mark.parametrize("name", ["alibi_args_causal_br", "neg_inf_softcap_sinks", "thd_causal_br_args"])
def test_against_reference_bfloat16(impl, name):
    check(impl, name, jnp.bfloat16)


# ------------------------------------------------------------------------------------------------------------------
# equal to the built-in features they restate


def _call(impl, q, k, v, **kw):
    """`attention(..., return_residual=True)` under `jit` (array arguments traced, the rest static)."""
    is_array = lambda x: isinstance(x, jax.Array) or (isinstance(x, tuple) and all(isinstance(a, jax.Array) for a in x))
    arrays = {n: x for n, x in kw.items() if is_array(x)}
    static = {n: x for n, x in kw.items() if n not in arrays}
    f = lambda q, k, v, a: attnlib.attention(q, k, v, implementation=impl, return_residual=True, **a, **static)
    return jax.jit(f)(q, k, v, arrays)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_built_in_features_as_modifiers(impl, alignment):
    r = np.random.default_rng(3)
    q, k, v = qkv(r)
    common = dict(diagonal_alignment=alignment, query_seq_lengths=lengths([11, 13]),
                  key_value_seq_lengths=lengths([19, 7]))  # fmt: skip
    # causal / sliding window as mask_mod, soft cap as score_mod: the positions are the aligned ones
    pairs = [
        (dict(is_causal=True), dict(mask_mod=lambda b, h, i, j: j <= i)),
        (dict(local_window_size=3), dict(mask_mod=sliding_window)),
        (dict(local_window_size=(4, 1), is_causal=True), dict(mask_mod=lambda b, h, i, j: (j <= i) & (j >= i - 4))),
        (dict(logits_soft_cap=2.5), dict(score_mod=softcap_mod(2.5))),
    ]
    for built_in, modifier in pairs:
        expected = _call(impl, q, k, v, **common, **built_in)
        got = _call(impl, q, k, v, **common, **modifier)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6, rtol=1e-6, err_msg=str(built_in))


def test_alibi_equals_bias(impl):
    r = np.random.default_rng(5)
    q, k, v = qkv(r)
    slopes = _slopes(r)
    dist = (jnp.arange(S)[None, :] - jnp.arange(T)[:, None]).astype(jnp.float32)
    bias = slopes * dist[None]
    expected = _call(impl, q, k, v, bias=bias)
    got = _call(impl, q, k, v, score_mod=alibi, score_mod_args=(slopes,))
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=1e-6, rtol=1e-6)
    # and the slope gradient equals the bias gradient contracted with the distances
    cot = normal(r, (B, T, N, HV))
    d_bias = jax.grad(lambda b: jnp.sum(_call(impl, q, k, v, bias=b)[0] * cot))(bias)
    d_slopes = jax.grad(lambda s: jnp.sum(_call(impl, q, k, v, score_mod=alibi, score_mod_args=(s,))[0] * cot))(slopes)
    assert_grad_close(d_slopes, to_f64(jnp.sum(d_bias * dist[None], axis=(-2, -1), keepdims=True)), jnp.float32)


def test_neg_inf_counts_as_masked_before_soft_cap(impl):
    # -inf from score_mod is masked even though the soft cap would map it to -c; a row of -inf is fully masked.
    r = np.random.default_rng(6)
    q, k, v = qkv(r)
    out, lse = _call(impl, q, k, v, score_mod=neg_inf_mod, logits_soft_cap=1.5)
    mask = (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + 2) & (jnp.arange(T)[:, None] != 4)
    exp_out, exp_lse = _call(impl, q, k, v, mask=mask, logits_soft_cap=1.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(exp_out), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(exp_lse), atol=1e-6, rtol=1e-6)
    assert (np.asarray(out)[:, 4] == 0).all() and np.isneginf(np.asarray(lse)[:, 4]).all()
    g = jax.grad(lambda q, k, v: jnp.sum(_call(impl, q, k, v, score_mod=neg_inf_mod, logits_soft_cap=1.5)[0]),
                 argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    for x in g:
        assert_finite(x)
    assert (np.asarray(g[0])[:, 4] == 0).all()


def test_fully_masked_by_mask_mod_everywhere(impl):
    r = np.random.default_rng(7)
    q, k, v = qkv(r)
    never = lambda b, h, i, j: i < 0
    out, lse = _call(impl, q, k, v, mask_mod=never)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    g = jax.grad(lambda q: jnp.sum(_call(impl, q, k, v, mask_mod=never)[0]))(q)
    assert (np.asarray(g) == 0).all()


# ------------------------------------------------------------------------------------------------------------------
# transformations


def test_checkpoint(impl):
    case = build("args_all_dtypes")
    a = case.arrays
    cot = normal(np.random.default_rng(12), (B, T, N, HV))

    def loss(q, k, v, args):
        out = attnlib.attention(q, k, v, implementation=impl, score_mod=args_score, mask_mod=args_mask,
                                score_mod_args=args)  # fmt: skip
        return jnp.sum(out * cot)

    grad = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))(a["query"], a["key"], a["value"], case.args)
    plain = grad(loss)
    for policy in (None, jax.checkpoint_policies.nothing_saveable):
        for x, y in zip(plain, grad(jax.checkpoint(loss, policy=policy)), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6)


def test_jit_and_eager_agree(impl):
    case = build("args_all_dtypes")
    f = lambda q, k, v, args: _call(impl, q, k, v, score_mod=args_score, mask_mod=args_mask, score_mod_args=args)
    a = case.arrays
    eager = f(a["query"], a["key"], a["value"], case.args)
    jitted = jax.jit(f)(a["query"], a["key"], a["value"], case.args)
    for e, j in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(np.asarray(j), np.asarray(e), atol=1e-6, rtol=1e-6)


VB = 3


def test_vmap_over_a_batch_axis(impl):
    r = np.random.default_rng(8)
    q, k, v = qkv(r, batch=(VB, B))
    slopes = normal(r, (VB, N, 1, 1), jnp.float32, 0.3)
    bias = normal(r, (VB, N, T, S))
    f = lambda q, k, v, b, s: attnlib.attention(
        q, k, v, b, implementation=impl, return_residual=True, score_mod=alibi, mask_mod=prefix_lm,
        score_mod_args=(s,), is_causal=True, diagonal_alignment="bottom_right",
    )  # fmt: skip
    out, lse = jax.jit(jax.vmap(f))(q, k, v, bias, slopes)
    cot = normal(r, out.shape)
    loss = lambda q, k, v, b, s: jnp.sum(jax.vmap(f)(q, k, v, b, s)[0] * cot)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, slopes)
    f_one = jax.jit(f)
    grad_one = jax.jit(jax.grad(lambda q, k, v, b, s, c: jnp.sum(f(q, k, v, b, s)[0] * c), argnums=(0, 1, 2, 3, 4)))
    for e in range(VB):
        o, l = f_one(q[e], k[e], v[e], bias[e], slopes[e])
        np.testing.assert_allclose(np.asarray(out[e]), np.asarray(o), atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse[e]), np.asarray(l), atol=1e-6, rtol=1e-6)
        g_e = grad_one(q[e], k[e], v[e], bias[e], slopes[e], cot[e])
        for got, want in zip(grads, g_e, strict=True):
            assert_grad_close(got[e], to_f64(want), jnp.float32)
        ref_out, _ = reference_attention(
            to_f64(q[e]), to_f64(k[e]), to_f64(v[e]), to_f64(bias[e]), score_mod=alibi, mask_mod=prefix_lm,
            score_mod_args=(to_f64(slopes[e]),), is_causal=True, diagonal_alignment="bottom_right",
        )  # fmt: skip
        assert_out_close(out[e], ref_out, jnp.float32)


def test_closure_over_traced_values(impl):
    # a score_mod that closes over values traced by jit (slopes indexed by head) works on plain JAX, and its
    # gradient w.r.t. the closed-over array equals the gradient through score_mod_args.
    r = np.random.default_rng(9)
    q, k, v = qkv(r)
    slopes = normal(r, (N,), jnp.float32, 0.3)
    cot = normal(r, (B, T, N, HV))

    def closed(q, k, v, slopes):
        def score_mod(score, b, h, i, j):
            return score + slopes[h] * (j - i).astype(score.dtype)

        description = modifiers.describe(score_mod, None, ())
        assert description.has_traced_consts and "traced float32[6]" in description.key
        return _call(impl, q, k, v, score_mod=score_mod, is_causal=True)[0]

    def as_args(q, k, v, slopes):
        return _call(impl, q, k, v, score_mod=alibi, score_mod_args=(slopes[:, None, None],), is_causal=True)[0]

    assert_out_close(jax.jit(closed)(q, k, v, slopes), to_f64(jax.jit(as_args)(q, k, v, slopes)), jnp.float32)
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3)))
    g_closed = loss(closed)(q, k, v, slopes)
    g_args = loss(as_args)(q, k, v, slopes)
    for a, b in zip(g_closed, g_args, strict=True):
        assert_grad_close(a, to_f64(b), jnp.float32)
    # vmap over the closed-over value too
    many = normal(r, (3, N), jnp.float32, 0.3)
    vm = jax.jit(jax.vmap(closed, in_axes=(None, None, None, 0)))(q, k, v, many)
    for e in range(3):
        assert_out_close(vm[e], to_f64(as_args(q, k, v, many[e])), jnp.float32)


def test_closure_over_concrete_int_array_and_int_args(impl):
    r = np.random.default_rng(10)
    q, k, v = qkv(r)
    doc = jnp.asarray(np.arange(S) // 6, jnp.int32)  # closed over, concrete, integer
    mask_mod = lambda b, h, i, j: doc[jnp.clip(i, 0, S - 1)] == doc[j]
    out, _ = _call(impl, q, k, v, mask_mod=mask_mod)
    qd = np.asarray(doc)[np.clip(np.arange(T), 0, S - 1)]
    mask = jnp.asarray(qd[:, None] == np.asarray(doc)[None, :])
    expected, _ = _call(impl, q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6, rtol=1e-6)
    # gradients with an integer closure and integer args: no error, finite
    g = jax.grad(lambda q, k, v: jnp.sum(_call(impl, q, k, v, mask_mod=mask_mod)[0]), argnums=(0, 1, 2))(q, k, v)
    for x in g:
        assert_finite(x)


def test_explain_accepts_modifiers_and_shape_dtype_structs():
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    k = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
    v = jax.ShapeDtypeStruct((B, S, K, HV), jnp.float32)
    slopes = jax.ShapeDtypeStruct((N, 1, 1), jnp.float32)
    explanation = attnlib.explain(q, k, v, score_mod=alibi, mask_mod=prefix_lm, score_mod_args=(slopes,))
    assert explanation.implementation is not None
    with pytest.raises(ValueError, match=r"`score_mod_args\[0\]`"):
        attnlib.explain(q, k, v, score_mod=alibi, score_mod_args=(jax.ShapeDtypeStruct((7,), jnp.float32),))


def test_context_parallel_declines_modifiers():
    q, k, v = qkv(np.random.default_rng(0))
    for kw in (dict(score_mod=double), dict(mask_mod=prefix_lm), dict(score_mod_args=(q,))):
        with pytest.raises(NotImplementedError, match=f"`{next(iter(kw))}`"):
            attnlib.context_parallel.attention(q, k, v, axis_name="sp", **kw)


# ------------------------------------------------------------------------------------------------------------------
# validation


def check_error(exc_type, names, given, fn, *args, **kwargs):
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for name in [names] if isinstance(names, str) else names:
        assert f"`{name}`" in msg, f"message does not name `{name}`: {msg!r}"
    for g in [given] if isinstance(given, str) else given:
        assert g in msg, f"message does not show what was given ({g!r}): {msg!r}"
    return info.value


def attn(*args, **kwargs):
    return attnlib.attention(*args, implementation="xla", **kwargs)


@pytest.fixture
def inputs():
    return qkv(np.random.default_rng(0))


def test_score_mod_must_be_callable(inputs):
    check_error(TypeError, "score_mod", "3", attn, *inputs, score_mod=3)
    check_error(TypeError, "mask_mod", "'no'", attn, *inputs, mask_mod="no")
    # explain takes the options untyped: the same rule from modifiers.describe
    check_error(TypeError, "score_mod", "3 of type int", attnlib.explain, *inputs, score_mod=3)


@pytest.mark.parametrize(
    "fn,exc,given",
    [
        (lambda s, b, h, i, j: i, TypeError, "int32[]"),
        (lambda s, b, h, i, j: s > 0, TypeError, "bool[]"),
        (lambda s, b, h, i, j: jnp.stack([s, s, s]), ValueError, "float32[3]"),
        (lambda s, b, h, i, j: (s, s), TypeError, "a tuple of 2 values (float32[], float32[])"),
        (lambda s, b, h, i, j: None, TypeError, "None"),
    ],
    ids=["int", "bool", "vector", "tuple", "none"],
)
def test_score_mod_must_return_a_float_scalar(inputs, fn, exc, given):
    check_error(exc, "score_mod", given, attn, *inputs, score_mod=fn)


def test_score_mod_any_float_dtype_is_used_as_float32(inputs):
    out = attn(*inputs, score_mod=lambda s, b, h, i, j: (2 * s).astype(jnp.bfloat16))
    expected = attn(*inputs, score_mod=lambda s, b, h, i, j: (2 * s).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize(
    "fn,exc,given",
    [
        (lambda b, h, i, j: i - j, TypeError, "int32[]"),
        (lambda b, h, i, j: jnp.float32(1.0), TypeError, "float32[]"),
        (lambda b, h, i, j: jnp.stack([i > j, i < j]), ValueError, "bool[2]"),
    ],
    ids=["int", "float", "vector"],
)
def test_mask_mod_must_return_a_bool_scalar(inputs, fn, exc, given):
    check_error(exc, "mask_mod", given, attn, *inputs, mask_mod=fn)


def test_function_raising_while_traced_is_named_and_chained(inputs):
    def python_if(score, b, h, i, j):
        if score > 0:  # Python control flow on a traced value
            return score
        return -score

    e = check_error(TypeError, "score_mod", "TracerBoolConversionError", attn, *inputs, score_mod=python_if)
    assert isinstance(e.__cause__, jax.errors.TracerBoolConversionError)
    # a wrong signature (mask_mod given the score too)
    e = check_error(TypeError, "mask_mod", "positional argument", attn, *inputs, mask_mod=lambda s, b, h, i, j: True)
    assert isinstance(e.__cause__, TypeError)

    def raises_value_error(b, h, i, j):
        raise ValueError("custom failure")

    e = check_error(ValueError, "mask_mod", "custom failure", attn, *inputs, mask_mod=raises_value_error)
    assert str(e.__cause__) == "custom failure"
    # the arguments: one scalar of each score_mod_args dtype
    e = check_error(TypeError, "score_mod", ["int32[]", "bool[]"], attn, *inputs, score_mod=lambda s, b, h, i, j: s,
                    score_mod_args=(jnp.ones((N, 1, 1), jnp.int32), jnp.ones((T, 1), bool)))  # fmt: skip


def test_score_mod_args_rules(inputs):
    check_error(ValueError, "score_mod_args", "score_mod=None and mask_mod=None", attn, *inputs,
                score_mod_args=(jnp.ones((N, 1, 1)),))  # fmt: skip
    check_error(TypeError, "score_mod_args", "f32[3]", attn, *inputs, score_mod=alibi, score_mod_args=jnp.ones(3))
    check_error(TypeError, "score_mod_args", "array of dtype float32 and shape (3,)", attnlib.explain, *inputs,
                score_mod=alibi, score_mod_args=jnp.ones(3))  # fmt: skip
    check_error(TypeError, "score_mod_args[0]", "'abc' of type str", attn, *inputs, score_mod=alibi,
                score_mod_args=("abc",))  # fmt: skip
    check_error(
        ValueError, "score_mod_args[1]", ["[*B, N, T, S]=(2, 6, 13, 19)", "score_mod_args[1].shape=(6, 13, 7)"],
        attn, *inputs, score_mod=lambda s, b, h, i, j, x, y: s,
        score_mod_args=(jnp.ones((N, 1, 1)), jnp.ones((N, T, 7))),
    )  # fmt: skip
    check_error(
        ValueError, "score_mod_args[0]", ["[N, T, S]=(6, 5, 7)", "(2, 6, 5, 7)"],
        attn, jnp.ones((5, N, H)), jnp.ones((7, K, H)), jnp.ones((7, K, H)), score_mod=alibi,
        score_mod_args=(jnp.ones((2, N, 5, 7)),), cu_seqlens_q=lengths([0, 5]), cu_seqlens_kv=lengths([0, 7]),
    )  # fmt: skip
    check_error(TypeError, "score_mod_args[0]", "ShapeDtypeStruct", attn, *inputs, score_mod=alibi,
                score_mod_args=(jax.ShapeDtypeStruct((N, 1, 1), jnp.float32),))  # fmt: skip
    # Python scalars and lists are arrays too; an empty tuple without functions is fine
    out = attn(*inputs, score_mod=alibi, score_mod_args=[0.0])
    np.testing.assert_allclose(np.asarray(out), np.asarray(attn(*inputs)), atol=1e-6, rtol=1e-6)
    attn(*inputs, score_mod_args=())


# ------------------------------------------------------------------------------------------------------------------
# the structural cache key


def describe(score_mod=None, mask_mod=None, args=()):
    return modifiers.describe(score_mod, mask_mod, args)


def test_key_same_function_same_key_and_config_equality():
    a, b = describe(alibi, prefix_lm, (jnp.ones((N, 1, 1)),)), describe(alibi, prefix_lm, (jnp.zeros((N, 1, 1)),))
    assert a.key == b.key and a == b and hash(a) == hash(b)
    # a lambda with the same body is the same computation: the same key
    assert describe(lambda s, b, h, i, j: 2.0 * s).key == describe(double).key
    assert not describe(double).has_traced_consts
    assert describe(None, None, ()) is None
    assert "0x" not in describe(head_sin, document).key


def test_key_different_functions_differ():
    functions = [
        double,
        lambda s, b, h, i, j: 3.0 * s,
        lambda s, b, h, i, j: s + 2.0,
        lambda s, b, h, i, j: jnp.sin(s),
        lambda s, b, h, i, j: jnp.cos(s),
        head_sin,
        batch_scale,
        softcap_mod(2.5),
        softcap_mod(2.0),
        neg_inf_mod,
    ]
    keys = [describe(f).key for f in functions]
    assert len(set(keys)) == len(keys)
    masks = [prefix_lm, sliding_window, document, lambda b, h, i, j: i >= j, lambda b, h, i, j: i > j]
    mask_keys = [describe(None, m).key for m in masks]
    assert len(set(mask_keys)) == len(mask_keys)
    # the same function as score_mod vs with a mask_mod; different argument shapes and dtypes
    assert describe(double).key != describe(double, prefix_lm).key
    add = lambda s, b, h, i, j, x: s + x.astype(s.dtype)
    k1 = describe(add, None, (jnp.ones((N, 1, 1)),)).key
    k2 = describe(add, None, (jnp.ones((1, T, 1)),)).key
    k3 = describe(add, None, (jnp.ones((N, 1, 1), jnp.bfloat16),)).key
    assert len({k1, k2, k3}) == 3


def test_key_closures_over_concrete_arrays():
    def make(values):
        table = jnp.asarray(values, jnp.float32)
        return lambda s, b, h, i, j: s + table[h]

    a = describe(make(np.arange(N)))
    b = describe(make(np.arange(N)))  # another array object, same values: the same computation
    c = describe(make(np.arange(N) + 1))  # different values, same shape: different keys
    assert a.key == b.key and a.key != c.key
    assert "concrete float32[6] sha256=" in a.key
    # a closed-over scalar becomes a literal of the jaxpr
    scalar = lambda x: lambda s, b, h, i, j: s * x
    assert describe(scalar(jnp.float32(2.0))).key != describe(scalar(jnp.float32(2.5))).key


def test_key_traced_constants_are_marked_and_value_independent():
    keys = []

    def f(x):
        d = describe(lambda s, b, h, i, j: s + x[h])
        assert d.has_traced_consts
        keys.append(d.key)
        return x

    jax.jit(f)(jnp.ones(N))
    jax.jit(lambda x: f(x) * 2)(jnp.arange(N, dtype=jnp.float32))  # a second trace, other values
    assert len(keys) == 2 and keys[0] == keys[1] and "traced float32[6]" in keys[0]
    assert "sha256" not in keys[0]


_PROGRAM = st.lists(
    st.tuples(st.sampled_from(["add", "mul", "sub", "sin", "tanh", "max", "where_q>k"]),
              st.floats(-4, 4, width=32, allow_nan=False, allow_subnormal=False)),
    min_size=1, max_size=4,
)  # fmt: skip


def _program_fn(program):
    def fn(s, b, h, i, j):
        for op, c in program:
            c = jnp.float32(c)
            if op == "add":
                s = s + c
            elif op == "mul":
                s = s * c
            elif op == "sub":
                s = c - s
            elif op == "sin":
                s = jnp.sin(s) + c
            elif op == "tanh":
                s = c * jnp.tanh(s)
            elif op == "max":
                s = jnp.maximum(s, c)
            else:
                s = jnp.where(i > j, s, c)
        return s

    return fn


@settings(deadline=None, derandomize=True, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(_PROGRAM, _PROGRAM)
def test_key_property_programs(p1, p2):
    k1, k1_again, k2 = describe(_program_fn(p1)).key, describe(_program_fn(p1)).key, describe(_program_fn(p2)).key
    assert k1 == k1_again
    same = [(op, np.float32(c).tobytes()) for op, c in p1] == [(op, np.float32(c).tobytes()) for op, c in p2]
    assert (k1 == k2) == same


_SUBPROCESS_CODE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from attnlib._src import modifiers

    table = jnp.asarray(np.linspace(-1.0, 1.0, 6), jnp.float32)

    def score_mod(score, b, h, q_idx, kv_idx, slope):
        return jax.nn.gelu(score) + table[h] + slope * (kv_idx - q_idx).astype(score.dtype)

    def mask_mod(b, h, q_idx, kv_idx, slope):
        return jnp.where(q_idx // 4 == kv_idx // 4, True, kv_idx <= q_idx)

    description = modifiers.describe(score_mod, mask_mod, (jnp.ones((6, 1, 1), jnp.float32),))
    """
)


def test_key_is_the_same_in_a_fresh_process():
    namespace: dict = {}
    exec(_SUBPROCESS_CODE, namespace)
    here = namespace["description"].key
    code = _SUBPROCESS_CODE + "\nimport sys; sys.stdout.write(description.key)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == here


# ------------------------------------------------------------------------------------------------------------------
# the reference's own backward through score_mod against central finite differences (float64, tiny shapes)


def test_reference_vjp_matches_finite_differences():
    r = np.random.default_rng(0)
    b, t, s, n, k, h, hv = 2, 3, 5, 4, 2, 3, 2
    args = dict(
        query=r.standard_normal((b, t, n, h)),
        key=r.standard_normal((b, s, k, h)),
        value=r.standard_normal((b, s, k, hv)),
        bias=r.standard_normal((1, n, t, s)),
        sinks=r.standard_normal(n),
        slope=r.standard_normal((n, 1, 1)),
        w=r.standard_normal((b, 1, t, s)),
    )
    heads_on = np.arange(n)[:, None, None] % 2 == 0

    def score_mod(score, bb, hh, i, j, slope, w, on):
        return jnp.sin(score) * 1.5 + slope * (j - i).astype(score.dtype) + w * score

    mask_mod = lambda bb, hh, i, j, slope, w, on: on | (j <= i + 1)
    options = dict(is_causal=True, diagonal_alignment="bottom_right", logits_soft_cap=2.0,
                   score_mod=score_mod, mask_mod=mask_mod)  # fmt: skip
    d_out = r.standard_normal((b, t, n, hv))
    d_lse = r.standard_normal((b, t, n))

    def run(a, fn):
        return fn(a["query"], a["key"], a["value"], a["bias"], sinks=a["sinks"],
                  score_mod_args=(a["slope"], a["w"], heads_on), **options)  # fmt: skip

    def loss(a):
        out, lse = run(a, reference_attention)
        return (out * d_out).sum() + np.where(np.isfinite(lse), lse * d_lse, 0.0).sum()

    grads = run(args, functools.partial(reference_attention_vjp, d_out=d_out, d_lse=d_lse))
    grads["slope"], grads["w"], none = grads.pop("score_mod_args")
    assert none is None
    assert_matches_finite_differences(grads, loss, args)
    assert math.isfinite(loss(args))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_shard_map_with_replicated_and_varying_args(implementation):
    """Inside `shard_map`: replicated slopes, a varying per-row argument, an integer argument and a closure over a
    replicated traced value; forward and gradients equal the unsharded call."""
    from jax.sharding import Mesh, PartitionSpec as P

    if implementation == "xla_chunked":
        implementation = attnlib.XlaChunked(block_k=5)
    mesh = Mesh(np.array(jax.devices()[:1]), ("b",))
    r = np.random.default_rng(11)
    q, k, v = qkv(r)
    slopes = _slopes(r)
    w = normal(r, (B, 1, T, S), jnp.float32, 0.5)
    kv_doc = jnp.asarray(np.arange(S) // 7, jnp.int32)
    table = normal(r, (N,), jnp.float32, 0.3)

    def local(q, k, v, slopes, w, table):
        def score_mod(score, b, h, i, j, slope, w_, doc):
            return score + slope * (j - i).astype(score.dtype) + w_ + table[h] * doc.astype(score.dtype)

        mask_mod = lambda b, h, i, j, slope, w_, doc: (doc <= i // 5) | (j <= i)
        return attnlib.attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, score_mod_args=(slopes, w, kv_doc), is_causal=True,
            diagonal_alignment="bottom_right", implementation=implementation,
        )  # fmt: skip

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("b"),) * 3 + (P(), P("b"), P()), out_specs=P("b"))
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    argnums = (0, 1, 2, 3, 4, 5)
    out, grads = jax.jit(jax.value_and_grad(loss(sharded), argnums=argnums))(q, k, v, slopes, w, table)
    expected, expected_grads = jax.jit(jax.value_and_grad(loss(local), argnums=argnums))(q, k, v, slopes, w, table)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        assert_grad_close(got, to_f64(want), jnp.float32)
