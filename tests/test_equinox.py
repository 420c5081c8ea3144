"""`attnlib.equinox`: parity with `equinox.nn.MultiheadAttention`, the extras, transforms, dropout, training.

Sizes are odd and distinct where the layer allows (T=7 queries, S=11 keys, N=6 heads, K=2 key/value heads).
"""

import dataclasses
import inspect
import io
import re
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_grad_close, assert_out_close, normal
from layers_reference import reference_mha
from reference import reference_attention, reference_attention_vjp

import attnlib
import attnlib.equinox as aeqx


T, S = 7, 11
F32 = jnp.float32


def _mask(rng, shape):
    """A random bool mask in which every query row keeps at least one key (Equinox and attnlib then agree)."""
    m = rng.random(shape) < 0.6
    m[..., 0] = True
    return jnp.asarray(m)


def _copy_weights(src, dst):
    """`dst` with the four projections of `src` (an `equinox.nn.MultiheadAttention`), via `equinox.tree_at`."""
    where = lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj)
    return eqx.tree_at(where, dst, where(src))


def _params(m):
    """`reference_mha` parameters (`x @ w + b` convention) of an Equinox-style layer."""
    lin = lambda p: (np.asarray(p.weight).T, None if p.bias is None else np.asarray(p.bias))
    params = {
        "query": lin(m.query_proj),
        "key": lin(m.key_proj),
        "value": lin(m.value_proj),
        "output": lin(m.output_proj),
    }
    if getattr(m, "sinks", None) is not None:
        params["sinks"] = np.asarray(m.sinks)
    return params


def _rope_process_heads(q, k, v):
    rope = eqx.nn.RotaryPositionalEmbedding(q.shape[-1])
    per_head = jax.vmap(rope, in_axes=1, out_axes=1)
    return per_head(q), per_head(k), v


@eqx.filter_jit
def _jit_call(module, *args, **kwargs):
    """`module(*args, **kwargs)` compiled once (arrays traced, the rest static) instead of one compile per operation
    of an eager call, for CPU time: the numbers are the same. (`test_dropout_off_paths_equal_the_no_dropout_layer`
    and `test_no_warnings_in_normal_use` call layers eagerly.)"""
    return module(*args, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# public surface


def test_shim_exports_the_src_classes():
    from attnlib._src.layers import equinox as src

    assert aeqx.MultiheadAttention is src.MultiheadAttention
    assert aeqx.DotProductAttention is src.DotProductAttention


def test_import_attnlib_equinox_imports_equinox_but_not_haiku():
    code = (
        "import sys, attnlib; a = 'equinox' in sys.modules; import attnlib.equinox; "
        "print(a, 'equinox' in sys.modules, 'haiku' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "False"]


def test_fields_and_call_signature_match_equinox():
    ours = aeqx.MultiheadAttention(6, 18, key=jr.key(0))
    theirs = eqx.nn.MultiheadAttention(6, 18, key=jr.key(0))
    extras = ["sinks", "num_kv_heads", "is_causal", "local_window_size", "softmax_type", "logits_soft_cap", "fp8",
              "score_mod", "mask_mod", "implementation"]  # fmt: skip
    our_fields = [f.name for f in dataclasses.fields(ours)]
    assert [f for f in our_fields if f not in extras] == [f.name for f in dataclasses.fields(theirs)]
    assert set(our_fields) - {f.name for f in dataclasses.fields(theirs)} == set(extras)
    init_ours = list(inspect.signature(aeqx.MultiheadAttention.__init__).parameters)
    init_theirs = list(inspect.signature(eqx.nn.MultiheadAttention.__init__).parameters)
    assert init_ours[: len(init_theirs) - 1] == init_theirs[:-1] and init_ours[-1] == init_theirs[-1] == "key"
    call_ours = inspect.signature(aeqx.MultiheadAttention.__call__).parameters
    call_theirs = inspect.signature(eqx.nn.MultiheadAttention.__call__).parameters
    # Equinox's arguments, in order, with the same kinds and defaults; then attnlib's keyword-only extras
    assert list(call_ours)[: len(call_theirs)] == list(call_theirs)
    assert all(call_ours[n].kind == p.kind and call_ours[n].default == p.default for n, p in call_theirs.items())
    assert list(call_ours)[len(call_theirs) :] == ["score_mod_args"]
    assert call_ours["score_mod_args"].kind == inspect.Parameter.KEYWORD_ONLY


# ------------------------------------------------------------------------------------------------------------------
# parity with equinox.nn.MultiheadAttention

PARITY = {
    "defaults": (dict(num_heads=6, query_size=18), T, None),
    "sizes_and_biases": (
        dict(num_heads=3, query_size=15, key_size=7, value_size=11, output_size=13, qk_size=5, vo_size=2,
             use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True),
        S,
        "2d",
    ),
    "per_head_mask": (dict(num_heads=3, query_size=15, qk_size=5, vo_size=3, use_output_bias=True), S, "3d"),
    "process_heads_rope": (dict(num_heads=3, query_size=15, qk_size=6, vo_size=5), S, "rope"),
}  # fmt: skip


def _parity_case(name):
    kwargs, s, extra = PARITY[name]
    theirs = eqx.nn.MultiheadAttention(**kwargs, key=jr.key(1))
    ours = _copy_weights(theirs, aeqx.MultiheadAttention(**kwargs, key=jr.key(2)))
    r = np.random.default_rng(3)
    xq = normal(r, (T, theirs.query_size))
    xk = normal(r, (s, theirs.key_size))
    xv = normal(r, (s, theirs.value_size))
    call = {}
    if extra == "2d":
        call["mask"] = _mask(r, (T, s))
    elif extra == "3d":
        call["mask"] = _mask(r, (kwargs["num_heads"], T, s))
    elif extra == "rope":
        call["process_heads"] = _rope_process_heads
    return theirs, ours, (xq, xk, xv), call


def _value_and_grads(layer, d_y, *inputs, **call):
    """`(y, d layer, d inputs)` of `<d_y, layer(*inputs, **call)>` in one jitted function (one compile instead of
    many eager ops)."""

    @eqx.filter_jit
    def run(layer_and_inputs):
        def loss(layer_and_inputs):
            layer, *inputs = layer_and_inputs
            y = layer(*inputs, **call)
            return jnp.sum(y * d_y), y

        grads, y = eqx.filter_grad(loss, has_aux=True)(layer_and_inputs)
        return y, grads

    y, grads = run((layer, *inputs))
    return y, grads[0], grads[1:]


@pytest.mark.parametrize("case", list(PARITY))
def test_parity_output_and_gradients_with_equinox(case):
    theirs, ours, (xq, xk, xv), call = _parity_case(case)
    d_y = normal(np.random.default_rng(4), (T, theirs.output_size))
    y_ours, g_ours, dx_ours = _value_and_grads(ours, d_y, xq, xk, xv, **call)
    y_theirs, g_theirs, dx_theirs = _value_and_grads(theirs, d_y, xq, xk, xv, **call)
    assert_out_close(y_ours, y_theirs, F32)
    for proj in ("query_proj", "key_proj", "value_proj", "output_proj"):
        for leaf in ("weight", "bias"):
            a, e = getattr(getattr(g_ours, proj), leaf), getattr(getattr(g_theirs, proj), leaf)
            assert (a is None) == (e is None)
            if e is not None:
                assert_grad_close(a, e, F32, what=f"{proj}.{leaf}")
    for a, e, what in zip(dx_ours, dx_theirs, ("d query", "d key_", "d value"), strict=True):
        assert_grad_close(a, e, F32, what=what)


def test_same_key_gives_the_same_initial_weights_as_equinox():
    kwargs = dict(num_heads=3, query_size=15, key_size=7, qk_size=5, use_key_bias=True, use_output_bias=True)
    theirs = eqx.nn.MultiheadAttention(**kwargs, key=jr.key(7))
    ours = aeqx.MultiheadAttention(**kwargs, key=jr.key(7))
    leaves_t, leaves_o = jax.tree.leaves(theirs), jax.tree.leaves(ours)
    assert len(leaves_t) == len(leaves_o)
    for a, e in zip(leaves_o, leaves_t, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_equinox_checkpoint_loads_unchanged():
    kwargs = dict(num_heads=3, query_size=15, qk_size=5, use_query_bias=True, dropout_p=0.25)
    theirs = eqx.nn.MultiheadAttention(**kwargs, key=jr.key(1))
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, theirs)
    buffer.seek(0)
    ours = eqx.tree_deserialise_leaves(buffer, aeqx.MultiheadAttention(**kwargs, key=jr.key(2)))
    x = normal(np.random.default_rng(0), (T, 15))
    assert_out_close(_jit_call(ours, x, x, x, inference=True), _jit_call(theirs, x, x, x, inference=True), F32)
    assert ours.dropout.p == 0.25


def test_fully_masked_row_outputs_the_output_bias_only():
    # Documented difference: Equinox averages all values uniformly; attnlib's row of attention output is 0.
    m = aeqx.MultiheadAttention(3, 15, use_output_bias=True, key=jr.key(0))
    m = eqx.tree_at(lambda m: m.output_proj.bias, m, jnp.arange(15, dtype=F32))
    x = normal(np.random.default_rng(0), (T, 15))
    mask = np.ones((T, T), bool)
    mask[2] = False
    y = _jit_call(m, x, x, x, mask=jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(y[2]), np.arange(15, dtype=np.float32))
    assert not np.allclose(np.asarray(y[3]), np.arange(15))


def test_integer_mask_means_nonzero_may_attend():
    m = aeqx.MultiheadAttention(3, 15, key=jr.key(0))
    r = np.random.default_rng(1)
    x = normal(r, (T, 15))
    mask = _mask(r, (T, T))
    np.testing.assert_array_equal(m(x, x, x, mask=mask.astype(jnp.int32) * 3), m(x, x, x, mask=mask))


# ------------------------------------------------------------------------------------------------------------------
# extras vs the float64 reference


EXTRAS = {
    "window_softcap_mask": (dict(local_window_size=(3, 1), logits_soft_cap=2.0), dict(mask="2d")),
    "off_by_one": (dict(softmax_type="off_by_one", is_causal=True), {}),
    "learnable_all": (
        dict(num_kv_heads=3, is_causal=True, local_window_size=(4, 0), softmax_type="learnable", logits_soft_cap=3.0),
        dict(mask="3d"),
    ),
}  # fmt: skip


def _reference_kwargs(layer):
    kw = dict(is_causal=layer.is_causal, local_window_size=layer.local_window_size)
    if layer.logits_soft_cap is not None:
        kw["logits_soft_cap"] = layer.logits_soft_cap
    return kw


@pytest.mark.parametrize("case", list(EXTRAS))
def test_extras_match_reference_forward_and_gradients(case):
    options, call = EXTRAS[case]
    r = np.random.default_rng(5)
    layer = aeqx.MultiheadAttention(6, 18, qk_size=5, vo_size=3, use_query_bias=True, **options, key=jr.key(5))
    if layer.sinks is not None:  # zeros at init; make them distinct so their gradient and effect are visible
        layer = eqx.tree_at(lambda m: m.sinks, layer, normal(r, (6,)))
    x = normal(r, (T, 18))
    kwargs = {}
    if call.get("mask") == "2d":
        kwargs["mask"] = _mask(r, (T, T))
    elif call.get("mask") == "3d":
        kwargs["mask"] = _mask(r, (6, T, T))
    params = _params(layer)
    if layer.softmax_type == "off_by_one":
        params["sinks"] = np.zeros(6)
    d_y = normal(r, (T, 18))
    y_ref, g_ref = reference_mha(
        x, x, x, params, num_heads=6, num_kv_heads=layer.num_kv_heads, d_y=d_y, **kwargs, **_reference_kwargs(layer)
    )
    y, grads, _ = _value_and_grads(layer, d_y, x, x, x, **kwargs)
    assert_out_close(y, y_ref, F32)
    for name, proj in (
        ("query", "query_proj"), ("key", "key_proj"), ("value", "value_proj"), ("output", "output_proj")
    ):
        g = getattr(grads, proj)
        assert_grad_close(np.asarray(g.weight).T, g_ref[name][0], F32, what=f"{proj}.weight")
        if g.bias is not None:
            assert_grad_close(g.bias, g_ref[name][1], F32, what=f"{proj}.bias")
    if layer.sinks is not None:
        assert_grad_close(grads.sinks, g_ref["sinks"], F32, what="sinks")
        assert np.abs(np.asarray(grads.sinks)).min() > 0


def test_softmax_types_differ_and_learnable_at_zero_is_off_by_one():
    x = normal(np.random.default_rng(0), (T, 18))
    make = lambda st: aeqx.MultiheadAttention(6, 18, softmax_type=st, key=jr.key(0))
    vanilla, off, learnable = make("vanilla"), make("off_by_one"), make("learnable")
    assert vanilla.sinks is None and off.sinks is None
    assert learnable.sinks.shape == (6,) and not np.asarray(learnable.sinks).any()
    np.testing.assert_array_equal(_jit_call(learnable, x, x, x), _jit_call(off, x, x, x))
    assert np.abs(np.asarray(_jit_call(vanilla, x, x, x) - _jit_call(off, x, x, x))).max() > 1e-3


def test_gqa_equals_mha_with_repeated_key_value_heads():
    r = np.random.default_rng(0)
    gqa = aeqx.MultiheadAttention(6, 18, qk_size=5, vo_size=3, num_kv_heads=2, use_key_bias=True, key=jr.key(0))
    assert gqa.key_proj.weight.shape == (2 * 5, 18) and gqa.value_proj.weight.shape == (2 * 3, 18)
    mha = aeqx.MultiheadAttention(6, 18, qk_size=5, vo_size=3, use_key_bias=True, key=jr.key(1))

    def repeat(w, head):  # rows [K * head] -> [N * head]: query head n uses kv head n // (N // K)
        return jnp.repeat(w.reshape((2, head) + w.shape[1:]), 3, axis=0).reshape((6 * head,) + w.shape[1:])

    mha = eqx.tree_at(
        lambda m: (m.query_proj, m.output_proj, m.key_proj.weight, m.key_proj.bias, m.value_proj.weight),
        mha,
        (gqa.query_proj, gqa.output_proj, repeat(gqa.key_proj.weight, 5), repeat(gqa.key_proj.bias, 5),
         repeat(gqa.value_proj.weight, 3)),
    )  # fmt: skip
    x = normal(r, (T, 18))
    assert_out_close(_jit_call(gqa, x, x, x), _jit_call(mha, x, x, x), F32)


def test_is_causal_and_window_equal_the_explicit_mask():
    r = np.random.default_rng(0)
    x = normal(r, (T, 18))
    plain = aeqx.MultiheadAttention(6, 18, key=jr.key(0))
    windowed = aeqx.MultiheadAttention(6, 18, is_causal=True, local_window_size=(2, 0), key=jr.key(0))
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    band = jnp.asarray((j <= i) & (j >= i - 2))
    assert_out_close(_jit_call(windowed, x, x, x), _jit_call(plain, x, x, x, mask=band), F32)


def test_implementation_is_passed_through():
    x = normal(np.random.default_rng(0), (T, 18))
    make = lambda impl: aeqx.MultiheadAttention(6, 18, is_causal=True, implementation=impl, key=jr.key(0))
    assert_out_close(_jit_call(make("xla_chunked"), x, x, x), _jit_call(make("xla"), x, x, x), F32)
    assert make(["cudnn", "xla"]).implementation == ("cudnn", "xla")  # static fields stay hashable
    no_gpu = make("cudnn")
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(NotImplementedError, match="cudnn"):
            no_gpu(x, x, x)


# ------------------------------------------------------------------------------------------------------------------
# DotProductAttention


def test_dot_product_attention_forwards_per_call_arguments():
    r = np.random.default_rng(0)
    q, k, v = normal(r, (2, T, 6, 5)), normal(r, (2, S, 2, 5)), normal(r, (2, S, 2, 3))
    bias = normal(r, (2, 1, T, S))
    core = aeqx.DotProductAttention(
        6, is_causal=True, softmax_type="learnable", logits_soft_cap=4.0, diagonal_alignment="bottom_right", scale=0.3
    )
    sinks = normal(r, (6,))
    core = eqx.tree_at(lambda m: m.sinks, core, sinks)
    lengths = dict(query_seq_lengths=jnp.asarray([7, 4]), key_value_seq_lengths=jnp.asarray([11, 6]))
    out, lse = _jit_call(core, q, k, v, bias, return_residual=True, **lengths)
    ref_kw = dict(is_causal=True, logits_soft_cap=4.0, diagonal_alignment="bottom_right", scale=0.3, sinks=sinks)
    ref_out, ref_lse = reference_attention(q, k, v, bias, **ref_kw, **{n: np.asarray(x) for n, x in lengths.items()})
    assert_out_close(out, ref_out, F32)
    assert_out_close(lse, ref_lse, F32, what="lse")

    d_out = normal(r, out.shape)
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(q, k, v, bias, **lengths) * d_out)))(core)
    g_ref = reference_attention_vjp(
        q, k, v, bias, d_out=d_out, **ref_kw, **{n: np.asarray(x) for n, x in lengths.items()}
    )
    assert_grad_close(g.sinks, g_ref["sinks"], F32, what="sinks")


def test_dot_product_attention_segments_thd_and_pages():
    r = np.random.default_rng(1)
    core = aeqx.DotProductAttention(is_causal=True, softmax_type="off_by_one")
    zeros = np.zeros(4)
    # packed rows with segment ids
    q, k, v = normal(r, (T, 4, 5)), normal(r, (T, 2, 5)), normal(r, (T, 2, 3))
    seg = jnp.asarray([1, 1, 1, 2, 2, 2, 0], jnp.int32)
    ref, _ = reference_attention(q, k, v, is_causal=True, sinks=zeros, q_segment_ids=np.asarray(seg))
    assert_out_close(_jit_call(core, q, k, v, q_segment_ids=seg, max_segments_per_row=2), ref, F32)
    # THD
    cu = jnp.asarray([0, 3, 7], jnp.int32)
    ref, _ = reference_attention(
        q, k, v, is_causal=True, sinks=zeros, cu_seqlens_q=np.asarray(cu), cu_seqlens_kv=np.asarray(cu)
    )
    assert_out_close(_jit_call(core, q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), ref, F32)
    # paged decode: pools [P, page, K, H], one new token per sequence
    pool_k, pool_v = normal(r, (5, 3, 2, 5)), normal(r, (5, 3, 2, 3))
    table, lens = jnp.asarray([[4, 0], [2, 3]], jnp.int32), jnp.asarray([5, 2], jnp.int32)
    decode = aeqx.DotProductAttention(is_causal=True, diagonal_alignment="bottom_right")
    qd = normal(r, (2, 1, 4, 5))
    ref, _ = reference_attention(
        qd, pool_k, pool_v, is_causal=True, diagonal_alignment="bottom_right", page_table=np.asarray(table),
        key_value_seq_lengths=np.asarray(lens),
    )  # fmt: skip
    assert_out_close(_jit_call(decode, qd, pool_k, pool_v, page_table=table, key_value_seq_lengths=lens), ref, F32)


def test_dot_product_attention_checks_the_head_count():
    core = aeqx.DotProductAttention(6, softmax_type="learnable")
    q = jnp.zeros((T, 4, 5))
    with pytest.raises(
        ValueError, match=re.escape("`query` must have num_heads=6 heads") + ".*" + re.escape("(7, 4, 5)")
    ):
        core(q, q, q)


# ------------------------------------------------------------------------------------------------------------------
# score_mod / mask_mod (flex attention): static callables in the layer, `score_mod_args` traced per call

CAP = 2.5


def _softcap(score, batch, head, q_idx, kv_idx):
    return CAP * jnp.tanh(score / CAP)


def _alibi(score, batch, head, q_idx, kv_idx, slope):
    return score + slope * (kv_idx - q_idx).astype(jnp.float32)


def _prefix_lm(batch, head, q_idx, kv_idx, *args):  # `*args`: it also receives every score_mod_args
    return (kv_idx <= q_idx) | (kv_idx < 3)


def _slopes(n):
    return jnp.asarray(2.0 ** (-8.0 * np.arange(1, n + 1) / n), F32)


def test_modifiers_are_static_fields():
    plain = aeqx.MultiheadAttention(6, 18, key=jr.key(0))
    modded = aeqx.MultiheadAttention(6, 18, score_mod=_alibi, mask_mod=_prefix_lm, key=jr.key(0))
    assert (modded.score_mod, modded.mask_mod) == (_alibi, _prefix_lm)
    # no new leaves: the functions live in the treedef, the weights are unchanged
    assert len(jax.tree.leaves(modded)) == len(jax.tree.leaves(plain))
    for a, e in zip(jax.tree.leaves(modded), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(a, e)
    again = aeqx.MultiheadAttention(6, 18, score_mod=_alibi, mask_mod=_prefix_lm, key=jr.key(1))
    assert jax.tree.structure(again) == jax.tree.structure(modded) != jax.tree.structure(plain)
    core = aeqx.DotProductAttention(score_mod=_softcap, mask_mod=_prefix_lm)
    assert jax.tree.leaves(core) == jax.tree.leaves(aeqx.DotProductAttention())
    assert (core.score_mod, core.mask_mod) == (_softcap, _prefix_lm)


def test_score_mod_softcap_equals_logits_soft_cap():
    r = np.random.default_rng(0)
    xq, xk = normal(r, (T, 18), scale=3.0), normal(r, (S, 18), scale=3.0)  # large logits: the cap matters
    capped = aeqx.MultiheadAttention(6, 18, num_kv_heads=2, logits_soft_cap=CAP, implementation="xla", key=jr.key(0))
    modded = aeqx.MultiheadAttention(6, 18, num_kv_heads=2, score_mod=_softcap, implementation="xla", key=jr.key(0))
    uncapped = aeqx.MultiheadAttention(6, 18, num_kv_heads=2, implementation="xla", key=jr.key(0))
    d_y = normal(r, (T, 18))
    y_cap, g_cap, dx_cap = _value_and_grads(capped, d_y, xq, xk, xk)
    y_mod, g_mod, dx_mod = _value_and_grads(modded, d_y, xq, xk, xk)
    assert_out_close(y_mod, y_cap, F32)
    assert np.abs(np.asarray(_jit_call(uncapped, xq, xk, xk) - y_cap)).max() > 1e-2  # the cap changed the output
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g_mod), jax.tree.leaves(g_cap), strict=True):
        assert_grad_close(a, e, F32, what=jax.tree_util.keystr(path))
    for a, e, what in zip(dx_mod, dx_cap, ("d query", "d key_", "d value"), strict=True):
        assert_grad_close(a, e, F32, what=what)

    # the core, batched, with the soft cap as a score_mod vs the built-in
    q, k, v = normal(r, (2, T, 6, 5), scale=3.0), normal(r, (2, S, 2, 5), scale=3.0), normal(r, (2, S, 2, 3))
    core_cap = aeqx.DotProductAttention(is_causal=True, logits_soft_cap=CAP, implementation="xla")
    core_mod = aeqx.DotProductAttention(is_causal=True, score_mod=_softcap, implementation="xla")
    out_mod, lse_mod = _jit_call(core_mod, q, k, v, return_residual=True)
    out_cap, lse_cap = _jit_call(core_cap, q, k, v, return_residual=True)
    assert_out_close(out_mod, out_cap, F32)
    assert_out_close(lse_mod, lse_cap, F32, what="lse")


def test_alibi_score_mod_with_args_equals_the_core_attention_call():
    r = np.random.default_rng(1)
    layer = aeqx.MultiheadAttention(
        6, 18, use_query_bias=True, use_output_bias=True, num_kv_heads=2, is_causal=True, score_mod=_alibi,
        implementation="xla", key=jr.key(0),
    )  # fmt: skip
    xq, xk = normal(r, (T, 18)), normal(r, (S, 18))
    slopes = _slopes(6)[:, None, None]  # [N, 1, 1]: broadcast to [N, T, S]
    y = _jit_call(layer, xq, xk, xk, score_mod_args=(slopes,))

    @jax.jit
    def by_hand(layer, slopes, bias):
        """The layer's projections around `attnlib.attention` with the score_mod, and with ALiBi as a bias."""
        q = jax.vmap(layer.query_proj)(xq).reshape(T, 6, 3)
        k = jax.vmap(layer.key_proj)(xk).reshape(S, 2, 3)
        v = jax.vmap(layer.value_proj)(xk).reshape(S, 2, 3)
        modded = attnlib.attention(q, k, v, is_causal=True, score_mod=_alibi, score_mod_args=(slopes,),
                                   implementation="xla")  # fmt: skip
        biased = attnlib.attention(q, k, v, bias, is_causal=True, implementation="xla")
        return tuple(jax.vmap(layer.output_proj)(a.reshape(T, 18)) for a in (modded, biased))

    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    bias = np.asarray(slopes) * (j - i).astype(np.float32)  # [N, T, S]
    expected, expected_bias = by_hand(layer, slopes, jnp.asarray(bias))
    assert_out_close(y, expected, F32)
    # ... which is ALiBi as an explicit bias
    assert_out_close(y, expected_bias, F32, what="vs bias")
    # different slopes, same layer: the arguments are traced inputs, not part of the layer
    assert np.abs(np.asarray(_jit_call(layer, xq, xk, xk, score_mod_args=(2 * slopes,)) - y)).max() > 1e-3


def test_prefix_lm_mask_mod_equals_the_boolean_mask():
    r = np.random.default_rng(2)
    xq, xk = normal(r, (T, 18)), normal(r, (S, 18))
    plain = aeqx.MultiheadAttention(6, 18, implementation="xla", key=jr.key(0))
    modded = aeqx.MultiheadAttention(6, 18, mask_mod=_prefix_lm, implementation="xla", key=jr.key(0))
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    mask = jnp.asarray((j <= i) | (j < 3))
    call = _jit_call
    assert_out_close(call(modded, xq, xk, xk), call(plain, xq, xk, xk, mask=mask), F32)
    # ANDed with a call's mask and the built-in masks
    extra = _mask(r, (T, S))
    assert_out_close(call(modded, xq, xk, xk, mask=extra), call(plain, xq, xk, xk, mask=mask & extra), F32,
                     what="and mask")  # fmt: skip
    causal = aeqx.MultiheadAttention(6, 18, is_causal=True, mask_mod=_prefix_lm, implementation="xla", key=jr.key(0))
    assert_out_close(call(causal, xq, xk, xk), call(plain, xq, xk, xk, mask=jnp.asarray(j <= i)), F32,
                     what="and causal")  # fmt: skip

    # the core with per-example document ids through score_mod_args: [B, 1, T, 1] and [B, 1, 1, S]
    def same_document(batch, head, q_idx, kv_idx, q_doc, kv_doc):
        return q_doc == kv_doc

    q, k, v = normal(r, (2, T, 6, 5)), normal(r, (2, T, 2, 5)), normal(r, (2, T, 2, 3))
    docs = jnp.asarray([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]], jnp.int32)
    core = aeqx.DotProductAttention(is_causal=True, mask_mod=same_document, implementation="xla")
    out = _jit_call(core, q, k, v, score_mod_args=(docs[:, None, :, None], docs[:, None, None, :]))
    mask = docs[:, None, :, None] == docs[:, None, None, :]  # [B, 1, T, T]
    expected = _jit_call(aeqx.DotProductAttention(is_causal=True, implementation="xla"), q, k, v, mask=mask)
    assert_out_close(out, expected, F32, what="document mask")


def test_modifiers_under_jit_vmap_and_grad():
    r = np.random.default_rng(3)
    layer = aeqx.MultiheadAttention(
        6, 18, num_kv_heads=2, score_mod=_alibi, mask_mod=_prefix_lm, implementation="xla", key=jr.key(0)
    )
    xb = normal(r, (3, T, 18))
    slopes = _slopes(6)[:, None, None]
    per_example = jnp.stack([_jit_call(layer, x, x, x, score_mod_args=(slopes,)) for x in xb])
    run = eqx.filter_jit(lambda m, xb, s: jax.vmap(lambda x: m(x, x, x, score_mod_args=(s,)))(xb))
    assert_out_close(run(layer, xb, slopes), per_example, F32)

    # gradients with respect to the weights and to the traced slopes, against the same layer with an explicit bias
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    offsets = jnp.asarray((j - i).astype(np.float32))[None]  # [1, T, T]
    mask = jnp.asarray((j <= i) | (j < 3))
    plain = aeqx.MultiheadAttention(6, 18, num_kv_heads=2, implementation="xla", key=jr.key(0))

    def loss_mod(m, s):
        return jnp.mean(jax.vmap(lambda x: m(x, x, x, score_mod_args=(s,)))(xb) ** 2)

    def loss_bias(m, s):
        q = jax.vmap(jax.vmap(m.query_proj))(xb).reshape(3, T, 6, 3)
        k = jax.vmap(jax.vmap(m.key_proj))(xb).reshape(3, T, 2, 3)
        v = jax.vmap(jax.vmap(m.value_proj))(xb).reshape(3, T, 2, 3)
        attn = attnlib.attention(q, k, v, s * offsets, mask, implementation="xla")
        return jnp.mean(jax.vmap(jax.vmap(m.output_proj))(attn.reshape(3, T, 18)) ** 2)

    g_mod = eqx.filter_jit(eqx.filter_grad(loss_mod))(layer, slopes)
    g_bias = eqx.filter_jit(eqx.filter_grad(loss_bias))(plain, slopes)
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g_mod), jax.tree.leaves(g_bias), strict=True):
        assert_grad_close(a, e, F32, what=jax.tree_util.keystr(path))
    d_slopes_mod = eqx.filter_jit(jax.grad(loss_mod, argnums=1))(layer, slopes)
    d_slopes_bias = eqx.filter_jit(jax.grad(loss_bias, argnums=1))(plain, slopes)
    assert d_slopes_mod.shape == (6, 1, 1) and np.abs(np.asarray(d_slopes_bias)).min() > 0
    assert_grad_close(d_slopes_mod, d_slopes_bias, F32, what="d slopes")


@pytest.mark.parametrize("cls", ["MultiheadAttention", "DotProductAttention"])
@pytest.mark.parametrize("name", ["score_mod", "mask_mod"])
def test_non_callable_modifier_is_a_type_error(cls, name):
    make = (
        (lambda **kw: aeqx.MultiheadAttention(6, 18, **kw, key=jr.key(0)))
        if cls == "MultiheadAttention"
        else (lambda **kw: aeqx.DotProductAttention(**kw))
    )
    with pytest.raises(TypeError, match=re.escape(f"`{name}` must be None or a function `{name}(") + ".*"
                       + re.escape(f"Got {name}=3.0.")):  # fmt: skip
        make(**{name: 3.0})


def test_score_mod_args_without_a_modifier_is_an_error():
    layer = aeqx.MultiheadAttention(6, 18, implementation="xla", key=jr.key(0))
    x = jnp.zeros((T, 18))
    with pytest.raises(ValueError, match=re.escape("`score_mod_args` are the extra arguments of `score_mod`")):
        layer(x, x, x, score_mod_args=(jnp.ones((6, 1, 1)),))


# ------------------------------------------------------------------------------------------------------------------
# transforms


def _hlo_counts(f, *args):
    text = jax.jit(lambda *a: f(*a)).lower(*args).as_text()
    return text.count("stablehlo.dot_general"), text.count("stablehlo.while")


def test_jit_vmap_grad():
    r = np.random.default_rng(0)
    layer = aeqx.MultiheadAttention(6, 18, num_kv_heads=2, is_causal=True, softmax_type="learnable", key=jr.key(0))
    layer = eqx.tree_at(lambda m: m.sinks, layer, normal(r, (6,)))
    xb = normal(r, (3, T, 18))
    mask = _mask(r, (3, T, T))
    batched = jax.vmap(layer)(xb, xb, xb, mask)
    jitted = eqx.filter_jit(lambda m, x, mask: m(x, x, x, mask))
    for b in range(3):
        assert_out_close(batched[b], jitted(layer, xb[b], mask[b]), F32, what=f"vmap row {b}")
    assert_out_close(eqx.filter_jit(jax.vmap(layer))(xb, xb, xb, mask), batched, F32, what="jit")

    # one batched attention, not a loop: the vmapped program has the dot products of one example and no while loop
    dots_one, loops_one = _hlo_counts(layer, xb[0], xb[0], xb[0], mask[0])
    dots_vmap, loops_vmap = _hlo_counts(jax.vmap(layer), xb, xb, xb, mask)
    assert (dots_vmap, loops_vmap) == (dots_one, loops_one)  # vmap adds no loop (xla_chunked has its own)

    # grad of the batch loss vs vmap of per-example grads (their mean is the batch gradient)
    loss = lambda m, x: jnp.mean(m(x, x, x) ** 2)
    g_batch = eqx.filter_jit(eqx.filter_grad(lambda m, xb: jnp.mean(jax.vmap(loss, in_axes=(None, 0))(m, xb))))(
        layer, xb
    )
    g_rows = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(loss), in_axes=(None, 0)))(layer, xb)
    for a, e in zip(jax.tree.leaves(g_rows), jax.tree.leaves(g_batch), strict=True):
        assert_grad_close(jnp.mean(a, axis=0), e, F32)
    assert np.abs(np.asarray(g_batch.sinks)).min() > 0


# ------------------------------------------------------------------------------------------------------------------
# dropout


def test_dropout_off_paths_equal_the_no_dropout_layer():
    x = normal(np.random.default_rng(0), (T, 18))
    base = aeqx.MultiheadAttention(6, 18, is_causal=True, key=jr.key(0))
    drop = aeqx.MultiheadAttention(6, 18, is_causal=True, dropout_p=0.5, key=jr.key(0))
    expected = base(x, x, x)
    np.testing.assert_array_equal(drop(x, x, x, inference=True), expected)
    np.testing.assert_array_equal(eqx.nn.inference_mode(drop)(x, x, x), expected)
    np.testing.assert_array_equal(base(x, x, x, key=jr.key(3)), expected)  # p = 0: the key is unused
    with pytest.raises(RuntimeError, match="requires a PRNG `key`. Got key=None"):
        drop(x, x, x)
    with pytest.warns(DeprecationWarning, match="deterministic=.... is deprecated"):
        np.testing.assert_array_equal(drop(x, x, x, deterministic=True), expected)


def test_dropout_on_is_deterministic_per_key_and_unbiased():
    r = np.random.default_rng(0)
    x = normal(r, (T, 18))
    layer = aeqx.MultiheadAttention(6, 18, dropout_p=0.3, use_output_bias=True, key=jr.key(0))
    call = eqx.filter_jit(lambda m, k: m(x, x, x, key=k))
    y1, y2, y3 = call(layer, jr.key(1)), call(layer, jr.key(1)), layer(x, x, x, key=jr.key(2))
    np.testing.assert_array_equal(y1, y2)
    assert np.abs(np.asarray(y1 - y3)).max() > 1e-3
    expected = np.asarray(layer(x, x, x, inference=True), np.float64)
    assert np.abs(np.asarray(y1) - expected).max() > 1e-3

    # E[y] = y without dropout (linearity); per-element 5-sigma bound with the sample standard deviation.
    n = 512
    samples = eqx.filter_jit(eqx.filter_vmap(call, in_axes=(None, 0)))(layer, jr.split(jr.key(3), n))
    samples = np.asarray(samples, np.float64)
    mean, std = samples.mean(0), samples.std(0, ddof=1)
    assert (np.abs(mean - expected) <= 5 * std / np.sqrt(n) + 1e-6).all()
    # gradients flow through the dropped probabilities
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(call(m, jr.key(1)))))(layer)
    assert np.isfinite(np.asarray(g.query_proj.weight)).all() and np.abs(np.asarray(g.query_proj.weight)).max() > 0


def test_dropout_keeps_the_right_fraction_and_rescales():
    # value = one-hot keys, so the output rows are the (dropped, rescaled) attention weights themselves.
    rate = 0.3
    r = np.random.default_rng(0)
    q, k = normal(r, (T, 3, 5)), normal(r, (S, 3, 5))
    v = jnp.broadcast_to(jnp.eye(S, dtype=F32)[:, None, :], (S, 3, S))
    core = aeqx.DotProductAttention(dropout_p=rate)
    probs = np.asarray(core(q, k, v, inference=True))
    keys = jr.split(jr.key(0), 40)
    dropped = np.asarray(jax.vmap(lambda kk: core(q, k, v, key=kk))(keys))
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], np.broadcast_to(probs / (1 - rate), dropped.shape)[kept], rtol=1e-6)
    n = kept.size
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(kept.mean() - (1 - rate)) < 5 * sigma, (kept.mean(), 1 - rate, sigma)
    assert not np.array_equal(kept[0], kept[1])  # two keys, two masks


# ------------------------------------------------------------------------------------------------------------------
# training a tiny causal language model


class TinyLM(eqx.Module):
    embed: eqx.nn.Embedding
    pos: jax.Array
    attn: aeqx.MultiheadAttention
    head: eqx.nn.Linear

    def __init__(self, vocab, length, dim, *, key, **attn_kwargs):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.pos = 0.1 * jr.normal(k2, (length, dim))
        self.attn = aeqx.MultiheadAttention(4, dim, use_output_bias=True, is_causal=True, **attn_kwargs, key=k3)
        self.head = eqx.nn.Linear(dim, vocab, key=k4)

    def __call__(self, tokens, key=None):
        x = jax.vmap(self.embed)(tokens) + self.pos
        x = x + self.attn(x, x, x, key=key)
        return jax.vmap(self.head)(x)


def _copy_task(vocab, length, batch, seed):
    """Each row is a random half followed by its copy: the second half is predictable only by attending back."""
    half = np.random.default_rng(seed).integers(0, vocab, (batch, length // 2))
    return jnp.asarray(np.concatenate([half, half], axis=1), jnp.int32)


@pytest.mark.parametrize(
    "attn_kwargs",
    [dict(dropout_p=0.1), dict(num_kv_heads=2, local_window_size=(6, 0), softmax_type="learnable")],
    ids=["mha_dropout", "gqa_window_learnable_sinks"],
)
def test_tiny_causal_lm_trains(attn_kwargs):
    vocab, length, dim = 11, 12, 16
    tokens = _copy_task(vocab, length, 16, seed=0)
    model = TinyLM(vocab, length - 1, dim, key=jr.key(0), **attn_kwargs)

    def loss_fn(model, tokens, key):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = jax.vmap(model)(inputs, jr.split(key, inputs.shape[0]))
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    @eqx.filter_jit
    def step(model, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, key)
        return loss, eqx.apply_updates(model, jax.tree.map(lambda g: -0.5 * g, grads))

    losses = []
    for key in jr.split(jr.key(1), 60):
        loss, model = step(model, key)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.75 * losses[0], losses[::10]
    if model.attn.sinks is not None:
        assert np.abs(np.asarray(model.attn.sinks)).max() > 1e-4  # the sinks were trained


# ------------------------------------------------------------------------------------------------------------------
# constructor and call errors


BAD_ARGS = [
    (dict(num_heads=0), "`num_heads` must be a positive int. Got num_heads=0."),
    (dict(query_size=-3), "`query_size` must be a positive int. Got query_size=-3."),
    (dict(key_size=2.5), "`key_size` must be a positive int. Got key_size=2.5."),
    (dict(qk_size=0), "`qk_size` must be a positive int (it defaults to query_size // num_heads = 18 // 6). "
                      "Got qk_size=0."),
    (dict(num_heads=6, query_size=5), "`qk_size` must be a positive int "
                                      "(it defaults to query_size // num_heads = 5 // 6). Got qk_size=0."),
    (dict(num_kv_heads=4), "`num_kv_heads` must divide `num_heads`"),
    (dict(softmax_type="softmax1"), "`softmax_type` must be one of ['vanilla', 'off_by_one', 'learnable']. "
                                    "Got softmax_type='softmax1'."),
    (dict(logits_soft_cap=-1.0), "`logits_soft_cap` must be None or a positive finite float. "
                                 "Got logits_soft_cap=-1.0."),
    (dict(local_window_size=(1, 2, 3)), "`local_window_size` must be a non-negative int or a pair"),
    (dict(implementation="triton"), "`implementation` must be None, one of"),
    (dict(dropout_p=1.0), "`dropout_p` must be a float in [0, 1). Got dropout_p=1.0."),
    (dict(is_causal="yes"), "`is_causal` must be a bool. Got is_causal='yes'."),
]  # fmt: skip


@pytest.mark.parametrize("kwargs,message", BAD_ARGS, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_ARGS)])
def test_bad_constructor_arguments(kwargs, message):
    kwargs = {"num_heads": 6, "query_size": 18, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        aeqx.MultiheadAttention(**kwargs, key=jr.key(0))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(softmax_type="learnable"), "`num_heads` is required with softmax_type='learnable'"),
        (dict(num_heads=-1), "`num_heads` must be a positive int. Got num_heads=-1."),
        (dict(diagonal_alignment="middle"), "`diagonal_alignment` must be 'top_left' or 'bottom_right'"),
        (dict(scale=float("nan")), "`scale` must be None or a finite float. Got scale=nan."),
        (dict(dropout_p=-0.1), "`dropout_p` must be a float in [0, 1). Got dropout_p=-0.1."),
    ],
    ids=["learnable_without_heads", "num_heads", "alignment", "scale", "dropout_p"],
)
def test_dot_product_attention_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        aeqx.DotProductAttention(**kwargs)


def test_bad_call_arguments():
    layer = aeqx.MultiheadAttention(6, 18, key=jr.key(0))
    x = jnp.zeros((T, 18))
    with pytest.raises(ValueError, match=re.escape("`mask` must have shape (q_seq, kv_seq)=(7, 7)") + ".*"
                       + re.escape("Got mask.shape=(7, 5).")):  # fmt: skip
        layer(x, x, x, mask=jnp.ones((T, 5), bool))
    with pytest.raises(
        ValueError, match=re.escape("`query` must be one unbatched sequence of shape (seq, query_size)=(seq, 18)")
    ):
        layer(x[None], x, x)
    with pytest.raises(ValueError, match=re.escape("`key_` and `value` must have the same sequence length")):
        layer(x, x, x[:5])
    with pytest.raises(ValueError, match="`process_heads` must not change the shapes of the heads"):
        layer(x, x, x, process_heads=lambda q, k, v: (q[:, :3], k, v))
    dropping = eqx.tree_at(lambda m: m.dropout.p, layer, 0.2)
    with pytest.raises(ValueError, match=re.escape("`dropout.p` must be a concrete Python float")):
        jax.jit(lambda m: m(x, x, x, key=jr.key(0), inference=False))(dropping)  # plain jax.jit traces `p`


def test_plain_jax_jit_of_the_module_in_inference_mode_works_as_in_equinox():
    # `jax.jit` (not `filter_jit`) traces the float `dropout.p`; with `inference=True` Equinox never reads it.
    x = normal(np.random.default_rng(0), (T, 18))
    theirs = eqx.nn.MultiheadAttention(6, 18, dropout_p=0.2, key=jr.key(0))
    ours = _copy_weights(theirs, aeqx.MultiheadAttention(6, 18, dropout_p=0.2, key=jr.key(1)))
    call = jax.jit(lambda m: m(x, x, x, inference=True))
    assert_out_close(call(ours), call(theirs), F32)


def test_x64_default_float64_parameters_run_in_float64():
    """As `equinox.nn.MultiheadAttention` does: under x64 the default float64 parameters give a float64 layer.
    (Abstractly, `jax.eval_shape`: the dtypes are those of running it, without compiling it.)"""

    def build_and_call(dtype=None):
        m = aeqx.MultiheadAttention(2, 8, **({} if dtype is None else dict(dtype=dtype)), key=jax.random.key(0))
        x = jnp.ones((3, 8), dtype)
        return [x for x in jax.tree.leaves(m) if eqx.is_inexact_array(x)], m(x, x, x)

    with jax.enable_x64(True):
        leaves, y = jax.eval_shape(build_and_call)
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float64)} and y.dtype == jnp.float64
        leaves, y = jax.eval_shape(lambda: build_and_call(jnp.float32))
        assert {x.dtype for x in leaves} == {jnp.dtype(jnp.float32)} and y.dtype == jnp.float32


def test_no_warnings_in_normal_use():
    layer = aeqx.MultiheadAttention(6, 18, num_kv_heads=3, softmax_type="learnable", key=jr.key(0))
    x = jnp.ones((T, 18))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, x, x)


# ------------------------------------------------------------------------------------------------------------------
# GPU: the cuDNN path (skipped without a GPU and attnlib's native extension; ATTNLIB_REQUIRE_GPU=1 makes it fail)


@pytest.mark.gpu
def test_gpu_cudnn_core_and_layer_under_vmap():
    # bfloat16, head dims multiple of 8, no boolean mask: cuDNN serves causal + window + GQA + learnable sinks.
    # Reference: the `xla` implementation in float32 at full matmul precision on the same bf16 values; tolerances
    # from bf16's eps as in tests/test_cudnn_gpu.py (out: 2 eps + eps|e|; gradients 8 eps max|e| + eps|e|).
    eps = 2.0**-7
    r = np.random.default_rng(0)
    q = normal(r, (3, 64, 4, 64), jnp.bfloat16)
    k, v = normal(r, (3, 64, 2, 64), jnp.bfloat16), normal(r, (3, 64, 2, 64), jnp.bfloat16)
    sinks = normal(r, (4,))
    options = dict(is_causal=True, local_window_size=(16, 0), softmax_type="learnable")
    core = eqx.tree_at(lambda m: m.sinks, aeqx.DotProductAttention(4, **options, implementation="cudnn"), sinks)
    ref = eqx.tree_at(lambda m: m.sinks, aeqx.DotProductAttention(4, **options, implementation="xla"), sinks)
    cot = normal(r, q.shape[:-1] + (64,))

    def out_and_grads(core, q, k, v):
        loss = lambda args: jnp.sum(jax.vmap(args[0])(*args[1:]).astype(F32) * cot)
        return jax.vmap(core)(q, k, v), eqx.filter_grad(loss)((core, q, k, v))

    hlo = jax.jit(lambda q, k, v: jax.vmap(core)(q, k, v)).lower(q, k, v).as_text()
    assert hlo.count("custom_call @attnlib_cudnn_graph") == 1, "one fused call for the vmapped batch"
    out, grads = eqx.filter_jit(out_and_grads)(core, q, k, v)
    with jax.default_matmul_precision("highest"):
        up = lambda x: x.astype(F32)
        ref_out, ref_grads = eqx.filter_jit(out_and_grads)(ref, up(q), up(k), up(v))
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out)
    assert np.all(np.abs(out - ref_out) <= 2 * eps + eps * np.abs(ref_out)), np.abs(out - ref_out).max()
    for a, e, what in zip(
        (grads[0].sinks, *grads[1:]), (ref_grads[0].sinks, *ref_grads[1:]), ("sinks", "dq", "dk", "dv"), strict=True
    ):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.all(np.abs(a - e) <= 8 * eps * np.abs(e).max() + eps * np.abs(e)), (what, np.abs(a - e).max())

    # the whole layer: one cuDNN call forward (and one backward) for the vmapped batch, sinks trained through it
    layer = aeqx.MultiheadAttention(
        4, 256, num_kv_heads=2, **options, dtype=jnp.bfloat16, implementation="cudnn", key=jr.key(0)
    )
    x = normal(r, (3, 64, 256), jnp.bfloat16)
    loss = lambda m: jnp.sum(jax.vmap(m)(x, x, x).astype(F32) ** 2)
    assert jax.jit(lambda: jax.vmap(layer)(x, x, x)).lower().as_text().count("custom_call @attnlib_cudnn_graph") == 1
    assert eqx.filter_jit(eqx.filter_grad(loss)).lower(layer).as_text().count("custom_call @attnlib_cudnn_graph") == 2
    g = eqx.filter_jit(eqx.filter_grad(loss))(layer)
    assert np.isfinite(np.asarray(g.sinks, np.float32)).all() and np.abs(np.asarray(g.sinks, np.float32)).min() > 0


# ------------------------------------------------------------------------------------------------------------------
# FP8 (`fp8="current"`): a static option passed to every attention call


def test_fp8_reaches_the_attention_call():
    r = np.random.default_rng(5)
    q, k, v = normal(r, (2, T, 6, 8), scale=2.0), normal(r, (2, S, 2, 8)), normal(r, (2, S, 2, 4), scale=3.0)
    core = aeqx.DotProductAttention(is_causal=True, fp8="current")
    attention = jax.jit(attnlib.attention, static_argnames=("is_causal", "fp8"))  # one compile, not one per operation
    expected = attention(q, k, v, is_causal=True, fp8="current")
    np.testing.assert_array_equal(np.asarray(_jit_call(core, q, k, v)), np.asarray(expected))
    assert np.abs(np.asarray(expected - attention(q, k, v, is_causal=True))).max() > 1e-3

    layer = aeqx.MultiheadAttention(6, 16, num_kv_heads=2, is_causal=True, fp8="current", key=jr.key(0))
    plain = aeqx.MultiheadAttention(6, 16, num_kv_heads=2, is_causal=True, key=jr.key(0))  # the same weights
    x = normal(r, (T, 16))
    y, y_plain = _jit_call(layer, x, x, x), _jit_call(plain, x, x, x)
    gap = np.abs(np.asarray(y - y_plain)).max() / np.abs(np.asarray(y_plain)).max()
    assert 1e-4 < gap < 0.2, gap  # FP8 rounding: visible, but small
    with pytest.raises(ValueError, match=r"`fp8` must be None or 'current' .* Got fp8='delayed'"):
        aeqx.DotProductAttention(fp8="delayed")
