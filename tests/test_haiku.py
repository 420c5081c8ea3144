"""`attnlib.haiku`: parity with `haiku.MultiHeadAttention` (parameter trees, outputs, gradients), the extras,
transforms, dropout and training.

Sizes are odd and distinct where the layer allows: T'=7 queries, T=11 keys, H=6 heads (2 key/value heads for GQA),
key_size 5, value_size 3, model_size 13, input widths 17 / 11 / 19.
"""

import inspect
import json
import pathlib
import re
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from helpers import assert_grad_close, assert_out_close, normal
from layers_reference import reference_mha
from reference import reference_attention, reference_attention_vjp

import attnlib
import attnlib.haiku as ahk


T, S = 7, 11
DQ, DK, DV = 17, 11, 19
F32 = jnp.float32
GOLDEN = json.loads((pathlib.Path(__file__).parent / "golden" / "haiku_multi_head_attention.json").read_text())
CONFIGS = {
    "default": dict(num_heads=6, key_size=5, value_size=3, model_size=13),
    "gqa_learnable_sinks": dict(num_heads=6, key_size=5, value_size=3, model_size=13, num_kv_heads=2,
                                softmax_type="learnable"),
    "no_bias_defaults": dict(num_heads=6, key_size=5, with_bias=False),
}  # fmt: skip
_HOST_ARGS = {"num_heads", "key_size", "value_size", "model_size", "with_bias"}


def _transform(cls, config, *, w_init=None, b_init=None, mask=True, **extra):
    """`hk.transform` of one layer call `(q, k, v[, mask]) -> y`, with jitted `init` / `apply` (fast on CPU)."""
    w_init = hk.initializers.VarianceScaling(1.0) if w_init is None else w_init
    b_init = hk.initializers.RandomNormal(0.5) if b_init is None else b_init

    def f(q, k, v, mask=None):
        return cls(**config, **extra, w_init=w_init, b_init=b_init)(q, k, v, mask)

    transformed = hk.transform(f)
    return hk.Transformed(init=jax.jit(transformed.init), apply=jax.jit(transformed.apply))


def _inputs(seed, lead=(2,), s=S, dk=DK, dv=DV, dq=DQ):
    r = np.random.default_rng(seed)
    return normal(r, lead + (T, dq)), normal(r, lead + (s, dk)), normal(r, lead + (s, dv))


def _tril_mask(lead, t, s):
    """Haiku's own idiom: a float causal mask `[..., 1, T', T]` (nonzero = may attend)."""
    return np.broadcast_to(np.tril(np.ones((t, s), np.float32)), lead + (1, t, s))


def _structure(params):
    return {mod: {name: [list(x.shape), str(x.dtype)] for name, x in p.items()} for mod, p in params.items()}


def _golden(name):
    return {mod: {p: [shape, dtype] for p, (shape, dtype) in ps.items()} for mod, ps in GOLDEN[name].items()}


def _reference_params(params, prefix="multi_head_attention"):
    """`reference_mha` parameters from a Haiku parameter dict (same `x @ w + b` convention)."""
    lin = lambda name: (params[f"{prefix}/{name}"]["w"], params[f"{prefix}/{name}"].get("b"))
    out = {"query": lin("query"), "key": lin("key"), "value": lin("value"), "output": lin("linear")}
    if prefix in params:
        out["sinks"] = params[prefix]["sinks"]
    return out


# ------------------------------------------------------------------------------------------------------------------
# public surface, parameter trees


def test_shim_exports_the_src_classes():
    from attnlib._src.layers import haiku as src

    assert ahk.MultiHeadAttention is src.MultiHeadAttention
    assert ahk.DotProductAttention is src.DotProductAttention


def test_import_attnlib_haiku_imports_haiku_but_not_equinox():
    code = (
        "import sys, attnlib; a = 'haiku' in sys.modules; import attnlib.haiku; "
        "print(a, 'haiku' in sys.modules, 'equinox' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "False"]


def test_signatures_extend_haiku():
    ours = inspect.signature(ahk.MultiHeadAttention.__init__).parameters
    theirs = inspect.signature(hk.MultiHeadAttention.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    assert all(ours[n].kind == theirs[n].kind and ours[n].default == theirs[n].default for n in theirs)
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in list(ours.values())[len(theirs) :])
    call_ours = list(inspect.signature(ahk.MultiHeadAttention.__call__).parameters)
    assert call_ours[:5] == list(inspect.signature(hk.MultiHeadAttention.__call__).parameters)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_tree_matches_golden(name):
    config = CONFIGS[name]
    q, k, v = _inputs(0) if name != "no_bias_defaults" else _inputs(0, dk=DQ, dv=DQ)
    ours = _transform(ahk.MultiHeadAttention, config).init
    assert _structure(jax.eval_shape(ours, jr.key(0), q, k, v)) == _golden(name)
    if set(config) <= _HOST_ARGS:  # the golden file is Haiku's own tree
        theirs = _transform(hk.MultiHeadAttention, config).init(jr.key(0), q, k, v)
        assert _structure(theirs) == _golden(name)
        ours = ours(jr.key(0), q, k, v)
        # same rng -> the same initial values: parameters are created in Haiku's order
        for mod in theirs:
            for p in theirs[mod]:
                np.testing.assert_array_equal(ours[mod][p], theirs[mod][p], err_msg=f"{mod}/{p}")


# ------------------------------------------------------------------------------------------------------------------
# parity with haiku.MultiHeadAttention


PARITY = {
    "batched_float_tril_mask": dict(lead=(2,), mask="tril"),
    "two_leading_dims_bool_mask": dict(lead=(2, 3), mask="random"),
    "unbatched_no_mask": dict(lead=(), mask=None),
}


def _value_and_grads(transformed, params, d_y, *args):
    """`(y, d params, d inputs)` of `<d_y, apply(params, *args)>`, in one jitted function."""

    @jax.jit
    def run(params, q, k, v, *mask):
        def loss(params_and_inputs):
            y = transformed.apply(params_and_inputs[0], None, *params_and_inputs[1:], *mask)
            return jnp.sum(y * d_y), y

        grads, y = jax.grad(loss, has_aux=True)((params, q, k, v))
        return y, grads[0], grads[1:]

    return run(params, *args)


@pytest.mark.parametrize("case", list(PARITY))
def test_parity_output_and_gradients_with_haiku(case):
    lead, mask_kind = PARITY[case]["lead"], PARITY[case]["mask"]
    q, k, v = _inputs(1, lead=lead)
    args = [q, k, v]
    if mask_kind == "tril":
        args.append(_tril_mask(lead, T, S))
    elif mask_kind == "random":
        m = np.random.default_rng(2).random(lead + (6, T, S)) < 0.6
        m[..., 0] = True
        args.append(jnp.asarray(m))
    config = CONFIGS["default"]
    theirs = _transform(hk.MultiHeadAttention, config)
    params = theirs.init(jr.key(3), *args)  # a Haiku checkpoint, loaded unchanged
    d_y = normal(np.random.default_rng(4), lead + (T, 13))
    y_theirs, g_theirs, dx_theirs = _value_and_grads(theirs, params, d_y, *args)
    y_ours, g_ours, dx_ours = _value_and_grads(_transform(ahk.MultiHeadAttention, config), params, d_y, *args)
    assert_out_close(y_ours, y_theirs, F32)
    assert jax.tree.structure(g_ours) == jax.tree.structure(g_theirs)
    for path, a in jax.tree_util.tree_leaves_with_path(g_ours):
        e = g_theirs[path[0].key][path[1].key]
        assert_grad_close(a, e, F32, what=jax.tree_util.keystr(path))
    for a, e, what in zip(dx_ours, dx_theirs, ("d query", "d key", "d value"), strict=True):
        assert_grad_close(a, e, F32, what=what)


def test_deprecated_w_init_scale_still_works_and_warns():
    q, k, v = _inputs(0)
    config = dict(num_heads=6, key_size=5, w_init_scale=2.0)

    def make(cls):
        transformed = hk.transform(lambda q, k, v: cls(**config)(q, k, v))
        return hk.Transformed(jax.jit(transformed.init), jax.jit(transformed.apply))  # warns while tracing

    with pytest.warns(DeprecationWarning, match="w_init_scale is deprecated"):
        params = make(hk.MultiHeadAttention).init(jr.key(0), q, k, v)
    with pytest.warns(DeprecationWarning, match="w_init_scale is deprecated"):
        ours = make(ahk.MultiHeadAttention).init(jr.key(0), q, k, v)
    with pytest.warns(DeprecationWarning, match="w_init_scale is deprecated"):
        y_theirs = make(hk.MultiHeadAttention).apply(params, None, q, k, v)
    with pytest.warns(DeprecationWarning, match="w_init_scale is deprecated"):
        y_ours = make(ahk.MultiHeadAttention).apply(params, None, q, k, v)
    jax.tree.map(np.testing.assert_array_equal, ours, params)
    assert_out_close(y_ours, y_theirs, F32)


def test_fully_masked_row_outputs_the_final_bias_only():
    # Documented difference: Haiku averages all values uniformly; attnlib's attention row is 0.
    q, k, v = _inputs(0)
    mask = np.ones((2, 1, T, S), bool)
    mask[1, 0, 3] = False
    f = _transform(ahk.MultiHeadAttention, CONFIGS["default"])
    params = f.init(jr.key(0), q, k, v, mask)
    y = f.apply(params, None, q, k, v, mask)
    np.testing.assert_array_equal(y[1, 3], params["multi_head_attention/linear"]["b"])
    assert np.abs(np.asarray(y[1, 2] - params["multi_head_attention/linear"]["b"])).max() > 1e-3


# ------------------------------------------------------------------------------------------------------------------
# extras vs the float64 reference


EXTRAS = {
    "gqa_off_by_one_window_softcap": dict(num_kv_heads=2, softmax_type="off_by_one", local_window_size=(3, 1),
                                          logits_soft_cap=2.0),
    "learnable_all": dict(num_kv_heads=3, is_causal=True, local_window_size=(4, 0), softmax_type="learnable",
                          logits_soft_cap=3.0),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXTRAS))
def test_extras_match_reference_forward_and_gradients(case):
    options = EXTRAS[case]
    r = np.random.default_rng(5)
    q, k, v = _inputs(5, s=T)
    mask = np.random.default_rng(6).random((2, 1, T, T)) < 0.7
    mask[..., 0] = True
    f = _transform(ahk.MultiHeadAttention, CONFIGS["default"], **options)
    params = f.init(jr.key(5), q, k, v, mask)
    if "multi_head_attention" in params:  # zeros at init; make them distinct so their effect is visible
        params["multi_head_attention"]["sinks"] = normal(r, (6,))
    ref_params = _reference_params(params)
    if options.get("softmax_type") == "off_by_one":
        ref_params["sinks"] = np.zeros(6)
    ref_kwargs = {n: options[n] for n in ("is_causal", "local_window_size", "logits_soft_cap") if n in options}
    d_y = normal(r, (2, T, 13))
    y_ref, g_ref = reference_mha(
        q, k, v, ref_params, num_heads=6, num_kv_heads=options.get("num_kv_heads", 6), mask=mask, d_y=d_y,
        **ref_kwargs,
    )  # fmt: skip
    y, grads, _ = _value_and_grads(f, params, d_y, q, k, v, mask)
    assert_out_close(y, y_ref, F32)
    for name, mod in (("query", "query"), ("key", "key"), ("value", "value"), ("output", "linear")):
        assert_grad_close(grads[f"multi_head_attention/{mod}"]["w"], g_ref[name][0], F32, what=f"{mod}.w")
        assert_grad_close(grads[f"multi_head_attention/{mod}"]["b"], g_ref[name][1], F32, what=f"{mod}.b")
    if "multi_head_attention" in params:
        assert_grad_close(grads["multi_head_attention"]["sinks"], g_ref["sinks"], F32, what="sinks")
        assert np.abs(np.asarray(grads["multi_head_attention"]["sinks"])).min() > 0


def test_gqa_equals_mha_with_repeated_key_value_heads():
    q, k, v = _inputs(0)
    gqa = _transform(ahk.MultiHeadAttention, CONFIGS["default"], num_kv_heads=2)
    mha = _transform(ahk.MultiHeadAttention, CONFIGS["default"])
    params = gqa.init(jr.key(0), q, k, v)

    def repeat(x, head):  # [..., K * head] -> [..., N * head]: query head n uses kv head n // (N // K)
        x = x.reshape(x.shape[:-1] + (2, head))
        return jnp.repeat(x, 3, axis=-2).reshape(x.shape[:-2] + (6 * head,))

    full = dict(params)
    full["multi_head_attention/key"] = jax.tree.map(lambda x: repeat(x, 5), params["multi_head_attention/key"])
    full["multi_head_attention/value"] = jax.tree.map(lambda x: repeat(x, 3), params["multi_head_attention/value"])
    assert _structure(full) == _structure(jax.eval_shape(mha.init, jr.key(0), q, k, v))
    assert_out_close(gqa.apply(params, None, q, k, v), mha.apply(full, None, q, k, v), F32)


def test_softmax_types_differ_and_learnable_at_zero_is_off_by_one():
    q, k, v = _inputs(0)
    make = lambda st: _transform(ahk.MultiHeadAttention, CONFIGS["default"], softmax_type=st)
    params = make("learnable").init(jr.key(0), q, k, v)
    assert not np.asarray(params["multi_head_attention"]["sinks"]).any()
    plain = {n: p for n, p in params.items() if n != "multi_head_attention"}
    y_learn = make("learnable").apply(params, None, q, k, v)
    y_off = make("off_by_one").apply(plain, None, q, k, v)
    y_vanilla = make("vanilla").apply(plain, None, q, k, v)
    np.testing.assert_array_equal(y_learn, y_off)
    assert np.abs(np.asarray(y_vanilla - y_off)).max() > 1e-3


# ------------------------------------------------------------------------------------------------------------------
# DotProductAttention


def test_dot_product_attention_parameters_and_per_call_arguments():
    r = np.random.default_rng(0)
    q, k, v = normal(r, (2, T, 6, 5)), normal(r, (2, S, 2, 5)), normal(r, (2, S, 2, 3))
    bias = normal(r, (2, 1, T, S))
    lengths = dict(query_seq_lengths=jnp.asarray([7, 4]), key_value_seq_lengths=jnp.asarray([11, 6]))
    options = dict(is_causal=True, logits_soft_cap=4.0, diagonal_alignment="bottom_right", scale=0.3)

    f = hk.transform(
        lambda q, k, v, bias: ahk.DotProductAttention(softmax_type="learnable", **options)(
            q, k, v, bias, return_residual=True, **lengths
        )
    )
    params = jax.eval_shape(f.init, jr.key(0), q, k, v, bias)
    assert _structure(params) == {"dot_product_attention": {"sinks": [[6], "float32"]}}
    sinks = normal(r, (6,))
    params = {"dot_product_attention": {"sinks": sinks}}
    out, lse = jax.jit(f.apply)(params, None, q, k, v, bias)
    ref_kw = dict(options, sinks=sinks, **{n: np.asarray(x) for n, x in lengths.items()})
    ref_out, ref_lse = reference_attention(q, k, v, bias, **ref_kw)
    assert_out_close(out, ref_out, F32)
    assert_out_close(lse, ref_lse, F32, what="lse")

    d_out = normal(r, out.shape)
    g = jax.jit(jax.grad(lambda p: jnp.sum(f.apply(p, None, q, k, v, bias)[0] * d_out)))(params)
    g_ref = reference_attention_vjp(q, k, v, bias, d_out=d_out, **ref_kw)
    assert_grad_close(g["dot_product_attention"]["sinks"], g_ref["sinks"], F32, what="sinks")


def test_dot_product_attention_segments_thd_and_pages():
    r = np.random.default_rng(1)
    q, k, v = normal(r, (T, 4, 5)), normal(r, (T, 2, 5)), normal(r, (T, 2, 3))
    seg = jnp.asarray([1, 1, 1, 2, 2, 2, 0], jnp.int32)
    cu = jnp.asarray([0, 3, 7], jnp.int32)
    pool_k, pool_v = normal(r, (5, 3, 2, 5)), normal(r, (5, 3, 2, 3))
    table, lens = jnp.asarray([[4, 0], [2, 3]], jnp.int32), jnp.asarray([5, 2], jnp.int32)
    qd = normal(r, (2, 1, 4, 5))

    def f():
        core = ahk.DotProductAttention(is_causal=True, softmax_type="off_by_one")
        decode = ahk.DotProductAttention(is_causal=True, diagonal_alignment="bottom_right")
        return (
            core(q, k, v, q_segment_ids=seg, max_segments_per_row=2),
            core(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu),
            decode(qd, pool_k, pool_v, page_table=table, key_value_seq_lengths=lens),
        )

    segmented, thd, paged = jax.jit(hk.transform(f).apply)({}, None)
    zeros = np.zeros(4)
    ref, _ = reference_attention(q, k, v, is_causal=True, sinks=zeros, q_segment_ids=np.asarray(seg))
    assert_out_close(segmented, ref, F32, what="segments")
    ref, _ = reference_attention(
        q, k, v, is_causal=True, sinks=zeros, cu_seqlens_q=np.asarray(cu), cu_seqlens_kv=np.asarray(cu)
    )
    assert_out_close(thd, ref, F32, what="thd")
    ref, _ = reference_attention(
        qd, pool_k, pool_v, is_causal=True, diagonal_alignment="bottom_right", page_table=np.asarray(table),
        key_value_seq_lengths=np.asarray(lens),
    )  # fmt: skip
    assert_out_close(paged, ref, F32, what="paged")


# ------------------------------------------------------------------------------------------------------------------
# score_mod / mask_mod (flex attention): plain attributes of the module, `score_mod_args` per call

CAP = 2.5


def _softcap(score, batch, head, q_idx, kv_idx):
    return CAP * jnp.tanh(score / CAP)


def _alibi(score, batch, head, q_idx, kv_idx, slope):
    return score + slope * (kv_idx - q_idx).astype(jnp.float32)


def _prefix_lm(batch, head, q_idx, kv_idx, *args):  # `*args`: it also receives every score_mod_args
    return (kv_idx <= q_idx) | (kv_idx < 3)


def _slopes(n):
    return jnp.asarray(2.0 ** (-8.0 * np.arange(1, n + 1) / n), F32)


def _with_args(config, **options):
    """`hk.transform` of `(q, k, v, mask, score_mod_args) -> y` for one MultiHeadAttention (jitted)."""

    def f(q, k, v, mask=None, score_mod_args=()):
        mha = ahk.MultiHeadAttention(**config, **options, w_init=hk.initializers.VarianceScaling(1.0),
                                     b_init=hk.initializers.RandomNormal(0.5))  # fmt: skip
        return mha(q, k, v, mask, score_mod_args=score_mod_args)

    transformed = hk.transform(f)
    return hk.Transformed(init=jax.jit(transformed.init), apply=jax.jit(transformed.apply))


def _linear(params, x, name):
    """The Haiku projection `multi_head_attention/{name}`: `x @ w + b`."""
    p = params[f"multi_head_attention/{name}"]
    y = x @ p["w"]
    return y + jnp.broadcast_to(p["b"], y.shape)


def _heads(params, x, name, heads, size):
    """A projection as `[..., T, heads, size]`."""
    return _linear(params, x, name).reshape(x.shape[:-1] + (heads, size))


def test_modifiers_leave_the_parameters_unchanged():
    q, k, v = _inputs(0)
    config = CONFIGS["gqa_learnable_sinks"]
    plain = _transform(ahk.MultiHeadAttention, config).init(jr.key(0), q, k, v)
    modded = _with_args(config, score_mod=_alibi, mask_mod=_prefix_lm).init(
        jr.key(0), q, k, v, None, (_slopes(6)[:, None, None],)
    )
    assert _structure(modded) == _structure(plain) == _golden("gqa_learnable_sinks")
    jax.tree.map(np.testing.assert_array_equal, modded, plain)


def test_score_mod_softcap_equals_logits_soft_cap():
    q, k, v = (3.0 * x for x in _inputs(1))  # large logits: the cap matters
    config = CONFIGS["default"]
    capped = _transform(ahk.MultiHeadAttention, config, num_kv_heads=2, logits_soft_cap=CAP, implementation="xla")
    modded = _transform(ahk.MultiHeadAttention, config, num_kv_heads=2, score_mod=_softcap, implementation="xla")
    uncapped = _transform(ahk.MultiHeadAttention, config, num_kv_heads=2, implementation="xla")
    params = capped.init(jr.key(1), q, k, v)
    d_y = normal(np.random.default_rng(2), (2, T, 13))
    y_cap, g_cap, dx_cap = _value_and_grads(capped, params, d_y, q, k, v)
    y_mod, g_mod, dx_mod = _value_and_grads(modded, params, d_y, q, k, v)
    assert_out_close(y_mod, y_cap, F32)
    assert np.abs(np.asarray(uncapped.apply(params, None, q, k, v) - y_cap)).max() > 1e-2
    for path, a in jax.tree_util.tree_leaves_with_path(g_mod):
        assert_grad_close(a, g_cap[path[0].key][path[1].key], F32, what=jax.tree_util.keystr(path))
    for a, e, what in zip(dx_mod, dx_cap, ("d query", "d key", "d value"), strict=True):
        assert_grad_close(a, e, F32, what=what)

    # the core
    r = np.random.default_rng(3)
    qh, kh, vh = normal(r, (2, T, 6, 5), scale=3.0), normal(r, (2, S, 2, 5), scale=3.0), normal(r, (2, S, 2, 3))

    def cores(qh, kh, vh):
        cap = ahk.DotProductAttention(is_causal=True, logits_soft_cap=CAP, implementation="xla")
        mod = ahk.DotProductAttention(is_causal=True, score_mod=_softcap, implementation="xla")
        return cap(qh, kh, vh, return_residual=True), mod(qh, kh, vh, return_residual=True)

    (out_cap, lse_cap), (out_mod, lse_mod) = jax.jit(hk.transform(cores).apply)({}, None, qh, kh, vh)
    assert_out_close(out_mod, out_cap, F32)
    assert_out_close(lse_mod, lse_cap, F32, what="lse")


def test_alibi_score_mod_with_args_equals_the_core_attention_call():
    q, k, v = _inputs(4)
    f = _with_args(CONFIGS["default"], num_kv_heads=2, is_causal=True, score_mod=_alibi, implementation="xla")
    slopes = _slopes(6)[:, None, None]  # [N, 1, 1]: broadcast to [*B, N, T, S]
    params = f.init(jr.key(4), q, k, v, None, (slopes,))
    y = f.apply(params, None, q, k, v, None, (slopes,))

    qh, kh, vh = _heads(params, q, "query", 6, 5), _heads(params, k, "key", 2, 5), _heads(params, v, "value", 2, 3)
    attn = attnlib.attention(qh, kh, vh, is_causal=True, score_mod=_alibi, score_mod_args=(slopes,),
                             implementation="xla")  # fmt: skip
    assert_out_close(y, _linear(params, attn.reshape(2, T, 18), "linear"), F32)

    # ... which is ALiBi as an explicit bias
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    bias = jnp.asarray(np.asarray(slopes) * (j - i).astype(np.float32))  # [N, T, S]
    attn_bias = attnlib.attention(qh, kh, vh, bias, is_causal=True, implementation="xla")
    assert_out_close(y, _linear(params, attn_bias.reshape(2, T, 18), "linear"), F32, what="vs bias")
    assert np.abs(np.asarray(f.apply(params, None, q, k, v, None, (2 * slopes,)) - y)).max() > 1e-3


def test_prefix_lm_mask_mod_equals_the_boolean_mask():
    q, k, v = _inputs(5)
    plain = _transform(ahk.MultiHeadAttention, CONFIGS["default"], implementation="xla")
    modded = _transform(ahk.MultiHeadAttention, CONFIGS["default"], mask_mod=_prefix_lm, implementation="xla")
    params = plain.init(jr.key(5), q, k, v)
    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    mask = jnp.asarray((j <= i) | (j < 3))
    assert_out_close(modded.apply(params, None, q, k, v), plain.apply(params, None, q, k, v, mask), F32)
    extra = np.random.default_rng(6).random((2, 1, T, S)) < 0.6
    extra[..., 0] = True
    extra = jnp.asarray(extra)
    both = jnp.broadcast_to(mask, extra.shape) & extra
    assert_out_close(modded.apply(params, None, q, k, v, extra), plain.apply(params, None, q, k, v, both), F32)

    # the core with per-example document ids through score_mod_args: [B, 1, T, 1] and [B, 1, 1, S]
    def same_document(batch, head, q_idx, kv_idx, q_doc, kv_doc):
        return q_doc == kv_doc

    r = np.random.default_rng(7)
    qh, kh, vh = normal(r, (2, T, 6, 5)), normal(r, (2, T, 2, 5)), normal(r, (2, T, 2, 3))
    docs = jnp.asarray([[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 2, 2]], jnp.int32)

    def cores(qh, kh, vh, docs):
        modded = ahk.DotProductAttention(is_causal=True, mask_mod=same_document, implementation="xla")
        plain = ahk.DotProductAttention(is_causal=True, implementation="xla")
        mask = docs[:, None, :, None] == docs[:, None, None, :]
        return modded(qh, kh, vh, score_mod_args=(docs[:, None, :, None], docs[:, None, None, :])), plain(
            qh, kh, vh, mask=mask
        )

    out, expected = jax.jit(hk.transform(cores).apply)({}, None, qh, kh, vh, docs)
    assert_out_close(out, expected, F32, what="document mask")


def test_modifiers_under_jit_vmap_and_grad():
    q, k, v = _inputs(8, lead=(3,))
    f = _with_args(CONFIGS["default"], num_kv_heads=2, score_mod=_alibi, mask_mod=_prefix_lm, implementation="xla")
    slopes = _slopes(6)[:, None, None]
    params = f.init(jr.key(8), q, k, v, None, (slopes,))
    batched = f.apply(params, None, q, k, v, None, (slopes,))
    vmapped = jax.jit(jax.vmap(lambda q, k, v: f.apply(params, None, q, k, v, None, (slopes,))))(q, k, v)
    assert_out_close(vmapped, batched, F32)

    i, j = np.arange(T)[:, None], np.arange(S)[None, :]
    offsets = jnp.asarray((j - i).astype(np.float32))[None]  # [1, T, S]
    mask = jnp.asarray((j <= i) | (j < 3))

    def loss_mod(params, s):
        return jnp.mean(f.apply(params, None, q, k, v, None, (s,)) ** 2)

    def loss_bias(params, s):
        qh, kh, vh = _heads(params, q, "query", 6, 5), _heads(params, k, "key", 2, 5), _heads(params, v, "value", 2, 3)
        attn = attnlib.attention(qh, kh, vh, s * offsets, mask, implementation="xla")
        return jnp.mean(_linear(params, attn.reshape(3, T, 18), "linear") ** 2)

    g_mod = jax.jit(jax.grad(loss_mod, argnums=(0, 1)))(params, slopes)
    g_bias = jax.jit(jax.grad(loss_bias, argnums=(0, 1)))(params, slopes)
    for path, a in jax.tree_util.tree_leaves_with_path(g_mod[0]):
        assert_grad_close(a, g_bias[0][path[0].key][path[1].key], F32, what=jax.tree_util.keystr(path))
    assert g_mod[1].shape == (6, 1, 1) and np.abs(np.asarray(g_bias[1])).min() > 0
    assert_grad_close(g_mod[1], g_bias[1], F32, what="d slopes")


@pytest.mark.parametrize("cls", ["MultiHeadAttention", "DotProductAttention"])
@pytest.mark.parametrize("name", ["score_mod", "mask_mod"])
def test_non_callable_modifier_is_a_type_error(cls, name):
    def f():
        if cls == "MultiHeadAttention":
            ahk.MultiHeadAttention(6, 5, w_init=hk.initializers.VarianceScaling(1.0), **{name: "tanh"})
        else:
            ahk.DotProductAttention(**{name: "tanh"})

    with pytest.raises(TypeError, match=re.escape(f"`{name}` must be None or a function `{name}(") + ".*"
                       + re.escape(f"Got {name}='tanh'.")):  # fmt: skip
        hk.transform(f).init(jr.key(0))


# ------------------------------------------------------------------------------------------------------------------
# transforms


def _hlo_counts(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return text.count("stablehlo.dot_general"), text.count("stablehlo.while")


def test_jit_vmap_grad():
    q, k, v = _inputs(0, lead=(3,))
    f = _transform(ahk.MultiHeadAttention, CONFIGS["default"], num_kv_heads=2, is_causal=True, softmax_type="learnable")
    params = f.init(jr.key(0), q, k, v)
    params["multi_head_attention"]["sinks"] = normal(np.random.default_rng(1), (6,))
    apply = lambda params, q, k, v: f.apply(params, None, q, k, v)
    batched = jax.jit(apply)(params, q, k, v)  # leading dims broadcast
    vmapped = jax.jit(jax.vmap(apply, in_axes=(None, 0, 0, 0)))(params, q, k, v)
    assert_out_close(vmapped, batched, F32)
    assert_out_close(jax.jit(apply)(params, q[1], k[1], v[1]), batched[1], F32, what="unbatched row 1")

    # one batched attention, not a loop
    dots_one, loops_one = _hlo_counts(apply, params, q[0], k[0], v[0])
    dots_vmap, loops_vmap = _hlo_counts(jax.vmap(apply, in_axes=(None, 0, 0, 0)), params, q, k, v)
    assert (dots_vmap, loops_vmap) == (dots_one, loops_one)  # vmap adds no loop (xla_chunked has its own)

    loss = lambda params, q, k, v: jnp.mean(apply(params, q, k, v) ** 2)
    g_batch = jax.jit(jax.grad(loss))(params, q, k, v)
    g_rows = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0, 0)))(params, q, k, v)
    for a, e in zip(jax.tree.leaves(g_rows), jax.tree.leaves(g_batch), strict=True):
        assert_grad_close(jnp.mean(a, axis=0), e, F32)
    assert np.abs(np.asarray(g_batch["multi_head_attention"]["sinks"])).min() > 0


# ------------------------------------------------------------------------------------------------------------------
# dropout


def test_dropout_off_and_on():
    q, k, v = _inputs(0)
    plain = _transform(ahk.MultiHeadAttention, CONFIGS["default"])
    params = plain.init(jr.key(0), q, k, v)
    expected = jax.jit(lambda p: plain.apply(p, None, q, k, v))(params)

    def f(q, k, v, rate=None):
        layer = ahk.MultiHeadAttention(
            **CONFIGS["default"], dropout_rate=0.3, w_init=hk.initializers.VarianceScaling(1.0)
        )
        return layer(q, k, v, dropout_rate=rate)

    drop = hk.transform(f)
    # per-call override: rate 0 is the plain layer
    np.testing.assert_array_equal(jax.jit(lambda p: drop.apply(p, None, q, k, v, 0.0))(params), expected)
    with pytest.raises(ValueError, match="You must pass a non-None PRNGKey"):
        drop.apply(params, None, q, k, v)
    apply = jax.jit(lambda rng: drop.apply(params, rng, q, k, v))
    y1, y2, y3 = apply(jr.key(1)), apply(jr.key(1)), apply(jr.key(2))
    np.testing.assert_array_equal(y1, y2)
    assert np.abs(np.asarray(y1 - y3)).max() > 1e-3
    assert np.abs(np.asarray(y1 - expected)).max() > 1e-3

    # E[y] = y without dropout (linearity); per-element 5-sigma bound with the sample standard deviation.
    n = 256
    samples = np.asarray(jax.jit(jax.vmap(apply))(jr.split(jr.key(3), n)), np.float64)
    mean, std = samples.mean(0), samples.std(0, ddof=1)
    assert (np.abs(mean - np.asarray(expected, np.float64)) <= 5 * std / np.sqrt(n) + 1e-6).all()


def test_dot_product_attention_dropout_key_and_rate():
    rate = 0.25
    r = np.random.default_rng(0)
    q, k = normal(r, (T, 3, 5)), normal(r, (S, 3, 5))
    v = jnp.broadcast_to(jnp.eye(S, dtype=F32)[:, None, :], (S, 3, S))  # output rows = the attention weights
    f = hk.transform(lambda key: ahk.DotProductAttention(dropout_rate=rate)(q, k, v, dropout_key=key))
    g = hk.transform(lambda: ahk.DotProductAttention(dropout_rate=rate)(q, k, v, dropout_rate=0.0))
    probs = np.asarray(jax.jit(g.apply)({}, None))
    keys = jr.split(jr.key(0), 40)
    dropped = np.asarray(jax.jit(jax.vmap(lambda key: f.apply({}, None, key)))(keys))
    kept = dropped != 0
    np.testing.assert_allclose(dropped[kept], np.broadcast_to(probs / (1 - rate), dropped.shape)[kept], rtol=1e-6)
    sigma = np.sqrt(rate * (1 - rate) / kept.size)
    assert abs(kept.mean() - (1 - rate)) < 5 * sigma, (kept.mean(), 1 - rate, sigma)
    assert not np.array_equal(kept[0], kept[1])  # two keys, two masks
    # an explicit key is used as given (Haiku's rng is then not consumed): same key, same mask
    np.testing.assert_array_equal(np.asarray(jax.jit(f.apply)({}, jr.key(9), keys[0])) != 0, kept[0])


# ------------------------------------------------------------------------------------------------------------------
# training a tiny causal language model


def _lm(vocab, length, dim, **attn_kwargs):
    def forward(tokens):
        x = hk.Embed(vocab, dim)(tokens)
        x = x + hk.get_parameter("pos", [1, length, dim], init=hk.initializers.RandomNormal(0.1))
        x = x + ahk.MultiHeadAttention(
            num_heads=4, key_size=dim // 4, w_init=hk.initializers.VarianceScaling(1.0), is_causal=True,
            **attn_kwargs,
        )(x, x, x)  # fmt: skip
        return hk.Linear(vocab)(x)

    return hk.transform(forward)


@pytest.mark.parametrize(
    "attn_kwargs",
    [dict(dropout_rate=0.1), dict(num_kv_heads=2, local_window_size=(6, 0), softmax_type="learnable")],
    ids=["mha_dropout", "gqa_window_learnable_sinks"],
)
def test_tiny_causal_lm_trains(attn_kwargs):
    vocab, length, dim = 11, 12, 16
    half = np.random.default_rng(0).integers(0, vocab, (16, length // 2))
    tokens = jnp.asarray(np.concatenate([half, half], axis=1), jnp.int32)  # the second half copies the first
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = _lm(vocab, length - 1, dim, **attn_kwargs)
    params = model.init(jr.key(0), inputs)
    if "softmax_type" in attn_kwargs:
        assert _structure(params)["multi_head_attention"] == {"sinks": [[4], "float32"]}

    def loss_fn(params, rng):
        logp = jax.nn.log_softmax(model.apply(params, rng, inputs))
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    @jax.jit
    def step(params, rng):
        loss, grads = jax.value_and_grad(loss_fn)(params, rng)
        return loss, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    losses = []
    new_params = params
    for rng in jr.split(jr.key(1), 60):
        loss, new_params = step(new_params, rng)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.75 * losses[0], losses[::10]
    if "softmax_type" in attn_kwargs:  # the sinks were trained
        assert np.abs(np.asarray(new_params["multi_head_attention"]["sinks"])).max() > 1e-4


# ------------------------------------------------------------------------------------------------------------------
# constructor errors


BAD_ARGS = [
    (dict(num_heads=0), "`num_heads` must be a positive int. Got num_heads=0."),
    (dict(key_size=-5), "`key_size` must be a positive int. Got key_size=-5."),
    (dict(value_size=-1), "`value_size` must be a positive int. Got value_size=-1."),
    (dict(model_size=2.5), "`model_size` must be a positive int. Got model_size=2.5."),
    (dict(num_kv_heads=4), "`num_kv_heads` must divide `num_heads`"),
    (dict(softmax_type="softmax1"), "`softmax_type` must be one of ['vanilla', 'off_by_one', 'learnable']. "
                                    "Got softmax_type='softmax1'."),
    (dict(logits_soft_cap=0.0), "`logits_soft_cap` must be None or a positive finite float. Got logits_soft_cap=0.0."),
    (dict(local_window_size=-1), "`local_window_size` must be a non-negative int or a pair"),
    (dict(implementation="triton"), "`implementation` must be None, one of"),
    (dict(dropout_rate=1.5), "`dropout_rate` must be a float in [0, 1). Got dropout_rate=1.5."),
    (dict(is_causal=None), "`is_causal` must be a bool. Got is_causal=None."),
    (dict(w_init=None), "Please provide a weight initializer: `w_init`."),
]  # fmt: skip


@pytest.mark.parametrize("kwargs,message", BAD_ARGS, ids=[next(iter(k)) + str(i) for i, (k, _) in enumerate(BAD_ARGS)])
def test_bad_constructor_arguments(kwargs, message):
    kwargs = {"num_heads": 6, "key_size": 5, "w_init": hk.initializers.VarianceScaling(1.0), **kwargs}

    def f():
        ahk.MultiHeadAttention(**kwargs)

    with pytest.raises(ValueError, match=re.escape(message)):
        hk.transform(f).init(jr.key(0))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(diagonal_alignment="middle"), "`diagonal_alignment` must be 'top_left' or 'bottom_right'"),
        (dict(scale=float("inf")), "`scale` must be None or a finite float. Got scale=inf."),
        (dict(softmax_type="sigmoid"), "`softmax_type` must be one of"),
        (dict(dropout_rate=-0.5), "`dropout_rate` must be a float in [0, 1). Got dropout_rate=-0.5."),
    ],
    ids=["alignment", "scale", "softmax_type", "dropout_rate"],
)
def test_dot_product_attention_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        hk.transform(lambda: ahk.DotProductAttention(**kwargs)).init(jr.key(0))


def test_bad_mask_names_the_argument():
    q, k, v = _inputs(0)
    f = _transform(ahk.MultiHeadAttention, CONFIGS["default"])
    with pytest.raises(ValueError, match=re.escape("`mask` must be broadcastable to [*B, N, T, S]=(2, 6, 7, 11)")):
        f.init(jr.key(0), q, k, v, jnp.ones((2, 1, T, 5), bool))


# ------------------------------------------------------------------------------------------------------------------
# GPU: the cuDNN path (skipped without a GPU and attnlib's native extension; ATTNLIB_REQUIRE_GPU=1 makes it fail)


@pytest.mark.gpu
def test_gpu_cudnn_layer_matches_xla():
    # bfloat16 heads of width 64, no boolean mask: cuDNN serves causal + window + GQA + learnable sinks. The
    # reference is the same module with implementation="xla" evaluated in float32 at full matmul precision on the
    # same (bf16-rounded) parameters and inputs; the comparison is on the attention core's output and the sinks
    # gradient, read through `DotProductAttention` (tolerances from bf16's eps, as tests/test_cudnn_gpu.py).
    eps = 2.0**-7
    r = np.random.default_rng(0)
    q = normal(r, (3, 64, 4, 64), jnp.bfloat16)
    k, v = normal(r, (3, 64, 2, 64), jnp.bfloat16), normal(r, (3, 64, 2, 64), jnp.bfloat16)
    cot = normal(r, q.shape[:-1] + (64,))
    options = dict(is_causal=True, local_window_size=(16, 0), softmax_type="learnable")

    def make(impl):
        def f(q, k, v):
            return ahk.DotProductAttention(**options, implementation=impl)(q, k, v)

        return hk.transform(f)

    params = {"dot_product_attention": {"sinks": normal(r, (4,))}}

    def out_and_grads(f, params, q, k, v):
        loss = lambda p: jnp.sum(f.apply(p, None, q, k, v).astype(F32) * cot)
        return f.apply(params, None, q, k, v), jax.grad(loss)(params)

    cudnn = make("cudnn")
    hlo = jax.jit(jax.vmap(lambda q, k, v: cudnn.apply(params, None, q, k, v))).lower(q, k, v).as_text()
    assert hlo.count("custom_call @attnlib_cudnn_graph") == 1, "one fused call for the vmapped batch"
    out, grads = jax.jit(lambda p, q, k, v: out_and_grads(cudnn, p, q, k, v))(params, q, k, v)
    with jax.default_matmul_precision("highest"):
        up = lambda x: x.astype(F32)
        ref_out, ref_grads = jax.jit(lambda p, q, k, v: out_and_grads(make("xla"), p, q, k, v))(
            params, up(q), up(k), up(v)
        )
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out)
    assert np.all(np.abs(out - ref_out) <= 2 * eps + eps * np.abs(ref_out)), np.abs(out - ref_out).max()
    a = np.asarray(grads["dot_product_attention"]["sinks"])
    e = np.asarray(ref_grads["dot_product_attention"]["sinks"])
    assert np.all(np.abs(a - e) <= 8 * eps * np.abs(e).max() + eps * np.abs(e)), np.abs(a - e).max()

    # the projection layer in bf16: one cuDNN call per direction for a batch with leading dims
    mha = _transform(
        ahk.MultiHeadAttention, dict(num_heads=4, key_size=64), num_kv_heads=2, **options, implementation="cudnn"
    )
    x = normal(r, (3, 64, 256), jnp.bfloat16)
    mha_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), mha.init(jr.key(0), x, x, x))
    loss = lambda p: jnp.sum(mha.apply(p, None, x, x, x).astype(F32) ** 2)
    assert jax.jit(jax.grad(loss)).lower(mha_params).as_text().count("custom_call @attnlib_cudnn_graph") == 2
    g = jax.jit(jax.grad(loss))(mha_params)["multi_head_attention"]["sinks"]
    assert np.isfinite(np.asarray(g, np.float32)).all() and np.abs(np.asarray(g, np.float32)).min() > 0


def test_fp8_reaches_the_attention_call():
    r = np.random.default_rng(5)
    qh, kh, vh = normal(r, (2, T, 6, 8), scale=2.0), normal(r, (2, S, 2, 8)), normal(r, (2, S, 2, 4), scale=3.0)
    out = jax.jit(hk.transform(lambda q, k, v: ahk.DotProductAttention(is_causal=True, fp8="current")(q, k, v)).apply)(
        {}, None, qh, kh, vh
    )
    expected = attnlib.attention(qh, kh, vh, is_causal=True, fp8="current")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)  # jit vs eager: 1 ulp

    def mha(fp8):
        return hk.transform(
            lambda x: ahk.MultiHeadAttention(num_heads=6, key_size=8, w_init=hk.initializers.VarianceScaling(1.0),
                                             num_kv_heads=2, is_causal=True, fp8=fp8)(x, x, x)
        )  # fmt: skip

    x = normal(r, (T, 16))
    params = mha("current").init(jr.key(0), x)
    y, y_plain = mha("current").apply(params, None, x), mha(None).apply(params, None, x)
    gap = np.abs(np.asarray(y - y_plain)).max() / np.abs(np.asarray(y_plain)).max()
    assert 1e-4 < gap < 0.2, gap
    with pytest.raises(ValueError, match=r"`fp8` must be None or 'current'"):
        hk.transform(lambda x: ahk.DotProductAttention(fp8="delayed")(x, x, x)).init(jr.key(0), qh)
