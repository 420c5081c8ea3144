"""`attnlib.flax.dot_product_attention`: parity with Flax's own `dot_product_attention` (linen and nnx) and with its
attention layers (`flax.linen.MultiHeadDotProductAttention`, `flax.nnx.MultiHeadAttention`: outputs, gradients,
decoding, sown weights), Flax's own attention tests ported, every declined argument, and dropout.

Sizes are odd and distinct: T=7 queries, S=11 keys, N=6 heads (K=2 key/value heads for GQA), H=5, Hv=3, leading
batch dims (2, 3); layer widths 9 / 13 / 15 with qkv_features 12 (6 heads of 2) or 18.

Flax's own functions are called under JAX's default promotion rules (`_flax_defaults`): they rely on implicit rank
promotion (a mask with fewer dims than the weights), which the suite's `jax_numpy_rank_promotion="raise"` forbids.
attnlib's function itself runs under the suite's strict settings.
"""

import functools
import logging
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from flax import jax_utils, nnx
from flax.core import pop
from helpers import assert_grad_close, assert_out_close, normal
from reference import reference_attention

import attnlib
import attnlib.flax as aflax


T, S, N, K, H, HV = 7, 11, 6, 2, 5, 3
F32 = jnp.float32
attention_fn = aflax.dot_product_attention


def _flax_defaults():
    """JAX's default promotion rules, under which Flax's own code is written."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(jax.numpy_rank_promotion("allow"))
    stack.enter_context(jax.numpy_dtype_promotion("standard"))
    return stack


def _qkv(seed, batch=(2, 3), n=N, k=N, h=H, hv=HV, t=T, s=S, dtype=F32):
    r = np.random.default_rng(seed)
    return (
        normal(r, batch + (t, n, h), dtype),
        normal(r, batch + (s, k, h), dtype),
        normal(r, batch + (s, k, hv), dtype),
    )


def _mask(seed, shape):
    """A random float32 0/1 mask (Flax's masks are float32) with key 0 always visible: no fully masked row."""
    m = np.random.default_rng(seed).random(shape) > 0.4
    m[..., 0] = True
    return jnp.asarray(m, F32)


def _reference(q, k, v, bias=None, mask=None, **kwargs):
    mask = None if mask is None else np.asarray(mask) != 0
    return reference_attention(q, k, v, bias, mask, **kwargs)[0]


# ------------------------------------------------------------------------------------------------------------------
# (a) the function against Flax's own and the float64 reference


@pytest.mark.parametrize(
    "batch, mask_shape, bias_shape",
    [
        ((), (N, T, S), (T, S)),
        ((2,), (2, 1, T, S), (N, T, S)),
        ((2, 3), (3, 1, T, S), (2, 3, N, T, S)),  # the mask has fewer leading dims than the weights
        ((2, 3), (T, S), (1, N, 1, S)),
        ((2, 3), None, None),
    ],
    ids=["unbatched", "batch", "two_batch_dims_short_mask", "two_batch_dims_2d_mask", "plain"],
)
def test_function_matches_flax_and_the_reference(batch, mask_shape, bias_shape):
    q, k, v = _qkv(0, batch)
    mask = None if mask_shape is None else _mask(1, mask_shape)
    bias = None if bias_shape is None else normal(np.random.default_rng(2), bias_shape)
    out = attention_fn(q, k, v, bias, mask)
    assert out.shape == batch + (T, N, HV) and out.dtype == F32
    with _flax_defaults():
        linen_out = nn.dot_product_attention(q, k, v, bias, mask)
    assert_out_close(out, linen_out, F32, "vs flax.linen")
    if all(x is None or x.ndim == q.ndim for x in (mask, bias)):  # nnx's jax.nn path flattens full-rank masks only
        with _flax_defaults():
            nnx_out = nnx.dot_product_attention(q, k, k, bias, mask)  # and needs Hv = H
        assert_out_close(attention_fn(q, k, k, bias, mask), nnx_out, F32, "vs flax.nnx")
    assert_out_close(out, _reference(q, k, v, bias, mask), F32, "vs float64 reference")


def test_function_matches_flax_under_jit_and_grad():
    q, k, v = _qkv(3, (2,))
    mask, bias = _mask(4, (2, 1, T, S)), normal(np.random.default_rng(5), (N, T, S))
    ct = normal(np.random.default_rng(6), (2, T, N, HV))

    def loss(fn):
        return lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias, mask) * ct)

    ours = jax.jit(jax.grad(loss(attention_fn), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    with _flax_defaults():
        theirs = jax.jit(jax.grad(loss(nn.dot_product_attention), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for name, a, e in zip(["query", "key", "value", "bias"], ours, theirs, strict=True):
        assert_grad_close(a, e, F32, name)


def test_gqa_and_is_causal_match_flax_nnx():
    q, k, v = _qkv(7, (2,), n=N, k=K, hv=H)  # nnx's jax.nn path needs Hv = H
    mask = _mask(8, (2, 1, T, S))
    out = attention_fn(q, k, v, mask=mask, is_causal=True)
    with _flax_defaults():
        expected = nnx.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    assert_out_close(out, expected, F32)
    assert_out_close(out, _reference(q, k, v, mask=mask, is_causal=True), F32, "vs float64 reference")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_dtype_casts_the_inputs(dtype):
    q, k, v = _qkv(9, (2,))  # float32 inputs, computed in `dtype`, as Flax does
    out = attention_fn(q, k, v, dtype=dtype)
    with _flax_defaults():
        flax_out = nn.dot_product_attention(q, k, v, dtype=dtype)
    assert out.dtype == flax_out.dtype == dtype
    cast = [x.astype(dtype) for x in (q, k, v)]
    assert_out_close(out, _reference(*cast), dtype)


def test_promote_dtype_is_called_as_flax_nnx_calls_it():
    q, k, v = _qkv(10, (2,))
    seen = []

    def promote(arrays, *, dtype=None):
        seen.append((len(arrays), dtype))
        return tuple(x.astype(jnp.bfloat16) for x in arrays)

    out = attention_fn(q, k, v, promote_dtype=promote, dtype=F32)
    assert seen == [(3, F32)] and out.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "precision",
    [None, jax.lax.Precision.HIGHEST, "highest", "bfloat16", (jax.lax.Precision.HIGH, "tensorfloat32"),
     jax.lax.DotAlgorithmPreset.F32_F32_F32, "fastest"],
    ids=["none", "enum", "name", "bfloat16", "equal_pair", "preset", "alias"],
)  # fmt: skip
def test_precision_is_accepted(precision):
    q, k, v = _qkv(11, (2,))
    out = jax.jit(lambda q, k, v: attention_fn(q, k, v, precision=precision))(q, k, v)
    # attnlib multiplies float32 inputs at full precision whatever is asked (docs/layers.md, Flax)
    assert_out_close(out, _reference(q, k, v), F32)


def test_the_call_runs_attnlib(caplog):
    """The lowered program holds attnlib's named scope, and attnlib's dispatch chooses (and logs) the
    implementation: no silent fallback to Flax's einsums."""
    q, k, v = _qkv(12, (3,), t=5, s=9)
    text = jax.jit(lambda q: attention_fn(q, k, v)).lower(q).as_text(debug_info=True)
    assert "attnlib.flax.dot_product_attention/attnlib.attention/" in text
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("on a GPU cuDNN may serve the call and nothing falls back")
    fn = functools.partial(attention_fn, implementation=["cudnn", "xla"], logits_soft_cap=29.0)
    with caplog.at_level(logging.INFO, logger="attnlib"):
        fn(q, k, v)
    assert any("cudnn declined" in r.getMessage() and "using xla" in r.getMessage() for r in caplog.records)


def test_attention_kwargs_are_forwarded():
    q, k, v = _qkv(13, (2,))
    window = functools.partial(attention_fn, local_window_size=(2, 1), scale=0.3, logits_soft_cap=7.0)
    out = window(q, k, v)
    expected = attnlib.attention(q, k, v, local_window_size=(2, 1), scale=0.3, logits_soft_cap=7.0)
    np.testing.assert_array_equal(out, expected)
    assert_out_close(out, _reference(q, k, v, local_window_size=(2, 1), scale=0.3, logits_soft_cap=7.0), F32)


def test_fully_masked_rows_output_zero():
    """The documented difference: Flax averages every value (all logits at finfo.min); attnlib outputs 0."""
    q, k, v = _qkv(14, (2,))
    mask = np.ones((2, 1, T, S), bool)
    mask[:, :, 3] = False
    out = np.asarray(attention_fn(q, k, v, mask=jnp.asarray(mask)))
    np.testing.assert_array_equal(out[:, 3], 0.0)
    with _flax_defaults():
        flax_out = np.asarray(nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)))
    np.testing.assert_allclose(flax_out[:, 3], np.broadcast_to(np.asarray(v).mean(1), flax_out[:, 3].shape), atol=1e-6)
    keep = np.arange(T) != 3
    assert_out_close(out[:, keep], flax_out[:, keep], F32)


# ------------------------------------------------------------------------------------------------------------------
# (b) Flax's layers with attnlib as their attention_fn


def _linen_pair(**kwargs):
    theirs = nn.MultiHeadDotProductAttention(**kwargs)
    return theirs, theirs.clone(attention_fn=attention_fn)


@pytest.mark.parametrize("lead", [(2,), (2, 3)], ids=["batch", "two_batch_dims"])
def test_linen_layer_matches_flax_outputs_and_gradients(lead):
    r = np.random.default_rng(20)
    xq, xkv = normal(r, lead + (T, 9)), normal(r, lead + (S, 13))
    mask = _mask(21, lead + (1, T, S))
    theirs, ours = _linen_pair(num_heads=N, qkv_features=18, out_features=15, bias_init=nn.initializers.normal(0.5))
    with _flax_defaults():
        params = theirs.init(jr.key(0), xq, xkv, mask=mask)
    loss = lambda layer: lambda p, xq, xkv: jnp.sum(jnp.sin(layer.apply(p, xq, xkv, mask=mask)))
    y = jax.jit(ours.apply)(params, xq, xkv, mask=mask)
    g, gx = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(params, xq, xkv)
    with _flax_defaults():
        y_flax = theirs.apply(params, xq, xkv, mask=mask)
        g_flax, gx_flax = jax.grad(loss(theirs), argnums=(0, 1))(params, xq, xkv)
    assert_out_close(y, y_flax, F32)
    assert_grad_close(gx, gx_flax, F32, "d inputs_q")
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_flax), strict=True):
        assert_grad_close(a, e, F32, jax.tree_util.keystr(path))


def test_linen_layer_with_causal_partial_matches_a_causal_mask():
    r = np.random.default_rng(22)
    x = normal(r, (2, T, 9))
    theirs = nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=12)
    ours = theirs.clone(attention_fn=functools.partial(attention_fn, is_causal=True))
    with _flax_defaults():
        params = theirs.init(jr.key(1), x)
        expected = theirs.apply(params, x, mask=nn.make_causal_mask(jnp.ones((2, T))))
    assert_out_close(ours.apply(params, x), expected, F32)


def test_nnx_layer_matches_flax_outputs_and_gradients():
    r = np.random.default_rng(23)
    xq, xkv = normal(r, (2, T, 9)), normal(r, (2, S, 13))
    mask = _mask(24, (2, 1, T, S))
    kwargs = dict(num_heads=N, in_features=9, qkv_features=18, out_features=15, num_kv_heads=K, in_kv_features=13,
                  decode=False)  # fmt: skip
    theirs = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kwargs, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    for call in (dict(mask=mask), dict(mask=mask, is_causal=True), dict(is_causal=True)):
        loss = lambda m: jnp.sum(jnp.sin(m(xq, xkv, **call)))
        with _flax_defaults():
            y_flax, g_flax = theirs(xq, xkv, **call), nnx.grad(loss)(theirs)
        assert_out_close(ours(xq, xkv, **call), y_flax, F32, str(call.keys()))
        g = nnx.grad(loss)(ours)
        for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g_flax), strict=True):
            assert_grad_close(a, e, F32, jax.tree_util.keystr(path))


@pytest.mark.parametrize("spatial_shape, attn_dims", [((5,), (1,)), ((6, 5), (2,))], ids=["1d", "2d_batch"])
def test_linen_decoding_matches_a_causal_call(spatial_shape, attn_dims):
    """Port of Flax's `test_decoding`: the decode cache (whose mask reaches attention_fn as a float mask over the
    whole cache) feeds one position at a time and equals Flax's own layer on the causal mask."""
    bs, num_heads, num_features = 2, 3, 4
    key1, key2 = jr.split(jr.key(0))
    inputs = jr.normal(key1, (bs,) + spatial_shape + (num_heads * num_features,))
    theirs = nn.MultiHeadDotProductAttention(
        num_heads=num_heads, qkv_features=num_heads * num_features, precision=jax.lax.Precision.HIGHEST,
        deterministic=False, decode=False,
    )  # fmt: skip
    decode_module = theirs.clone(decode=True, attention_fn=attention_fn)
    with _flax_defaults():
        initial_vars = decode_module.init(key2, inputs)
        causal_mask = nn.attention.make_causal_mask(jnp.ones((bs,) + spatial_shape))
        y_ref = jax.jit(lambda x, y: theirs.apply(initial_vars, x, mask=y))(inputs, causal_mask)
    state, params = pop(initial_vars, "params")

    def body_fn(state, x):
        y, state = decode_module.apply({"params": params, **state}, x, mutable=["cache"])
        return state, y

    with _flax_defaults():  # Flax's scan_in_dim broadcasts
        _, y = jax_utils.scan_in_dim(body_fn, state, inputs, axis=attn_dims, keepdims=True)
    np.testing.assert_allclose(y_ref, y, atol=1e-5)


def test_nnx_decoding_with_gqa_matches_a_causal_call():
    length, in_feat = 6, 9
    x = jr.normal(jr.key(1), (2, length, in_feat))
    kwargs = dict(num_heads=N, in_features=in_feat, qkv_features=12, num_kv_heads=K)
    theirs = nnx.MultiHeadAttention(**kwargs, decode=False, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kwargs, decode=True, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    ours.init_cache(x.shape)
    steps = [ours(x[:, i : i + 1]) for i in range(length)]
    with _flax_defaults():
        expected = theirs(x, mask=nn.make_causal_mask(jnp.ones((2, length))))
    assert_out_close(jnp.concatenate(steps, axis=1), expected, F32)
    assert int(ours.cache_index[...]) == length


def test_linen_sown_weights_are_flax_weights():
    """`sow_weights=True` makes the layer pass `module`: Flax's own weights are sown (before dropout)."""
    x = normal(np.random.default_rng(25), (2, T, 9))
    theirs, ours = _linen_pair(num_heads=3, qkv_features=12, dropout_rate=0.3, deterministic=False)
    with _flax_defaults():
        params = theirs.init({"params": jr.key(0), "dropout": jr.key(1)}, x)
        _, flax_sown = theirs.apply(params, x, sow_weights=True, mutable=["intermediates"], rngs={"dropout": jr.key(2)})
    y, sown = ours.apply(params, x, sow_weights=True, mutable=["intermediates"], rngs={"dropout": jr.key(2)})
    assert jax.tree.structure(sown) == jax.tree.structure(flax_sown)
    (w,), (w_flax,) = sown["intermediates"]["attention_weights"], flax_sown["intermediates"]["attention_weights"]
    assert w.shape == (2, 3, T, T)
    np.testing.assert_allclose(w, w_flax, atol=1e-6)
    _, nothing = ours.apply(params, x, mutable=["intermediates"], rngs={"dropout": jr.key(2)})
    assert "intermediates" not in nothing


def test_nnx_sown_weights_are_flax_weights():
    x = normal(np.random.default_rng(26), (2, T, 9))
    kwargs = dict(num_heads=N, in_features=9, qkv_features=12, num_kv_heads=K, decode=False)
    theirs = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = nnx.MultiHeadAttention(**kwargs, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    with _flax_defaults():
        _, flax_sown = nnx.capture(theirs, nnx.Intermediate)(x, sow_weights=True, is_causal=True)
    _, sown = nnx.capture(ours, nnx.Intermediate)(x, sow_weights=True, is_causal=True)
    np.testing.assert_allclose(sown["attention_weights"][0], flax_sown["attention_weights"][0], atol=1e-6)
    assert sown["attention_weights"][0].shape == (2, N, T, T)


# ------------------------------------------------------------------------------------------------------------------
# (c) Flax's own attention tests (tests/linen/linen_attention_test.py, tests/nnx/nn/attention_test.py), ported:
# `attention_fn=attnlib.flax.dot_product_attention` on every layer.


def test_flax_multihead_self_attention():
    x = jnp.ones((4, 6, 5))
    sa_module = nn.MultiHeadDotProductAttention(
        num_heads=8, qkv_features=16, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros,
        deterministic=False, attention_fn=attention_fn,
    )  # fmt: skip
    y, _ = sa_module.init_with_output(jr.key(0), x)
    assert y.shape == x.shape and y.dtype == jnp.float32


def test_flax_dtype_infer_complex_is_declined():
    """Flax's `test_dtype_infer` runs complex64 attention; attnlib computes in real float dtypes only."""
    x = jnp.ones((4, 6, 5), jnp.complex64)
    sa_module = nn.MultiHeadDotProductAttention(num_heads=8, qkv_features=16, attention_fn=attention_fn)
    with pytest.raises(TypeError, match=r"`query` must have dtype float16, bfloat16, float32 or float64\. Got"):
        with _flax_defaults():  # Flax's projections promote float32 params with complex inputs
            sa_module.init_with_output(jr.key(0), x)


def test_flax_multihead_encoder_decoder_attention():
    q = jnp.ones((4, 2, 3, 5))
    sa_module = nn.MultiHeadDotProductAttention(
        num_heads=8, qkv_features=16, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros,
        deterministic=False, attention_fn=attention_fn,
    )  # fmt: skip
    y, _ = sa_module.init_with_output(jr.key(0), q)
    assert y.shape == q.shape


def test_flax_multihead_self_attention_w_dropout():
    x = jnp.ones((4, 2, 3, 5))
    sa_module = nn.MultiHeadDotProductAttention(
        num_heads=8, qkv_features=16, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros,
        dropout_rate=0.1, deterministic=False, attention_fn=attention_fn,
    )  # fmt: skip
    rng1, rng2 = jr.split(jr.key(0))
    y, _ = sa_module.init_with_output({"params": rng1, "dropout": rng2}, x)
    assert y.shape == x.shape


def test_flax_multihead_self_attention_explicit_dropout():
    def clone(key):
        return jax.tree.map(jax.random.clone, key)

    class Foo(nn.Module):
        attention_kwargs: dict

        @nn.compact
        def __call__(self, x, dropout_rng=None):
            a = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(x, x, dropout_rng=dropout_rng)
            if dropout_rng is not None:
                dropout_rng = clone(dropout_rng)
            b = nn.MultiHeadDotProductAttention(**self.attention_kwargs)(x, x, dropout_rng=dropout_rng)
            return a, b

    module = Foo(
        dict(num_heads=8, qkv_features=16, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros,
             dropout_rate=0.5, deterministic=False, attention_fn=attention_fn)
    )  # fmt: skip
    rng1, rng2, rng3, rng4 = jr.split(jr.key(0), 4)
    x = jr.normal(jr.key(5), (4, 2, 3, 5))  # Flax's ones make every row identical: random inputs show the masks
    rngs = {"params": rng1, "dropout": rng2}
    v = module.init(rngs, x)
    a, b = module.apply(v, x, rngs=clone(rngs))
    c, d = module.apply(v, x, rngs={"dropout": clone(rng2)})
    e, f = module.apply(v, x, rngs={"dropout": rng3})
    assert not (a == b).all()
    assert (a == c).all()
    assert (b == d).all()
    assert not (a == e).all()
    assert not (b == f).all()
    a, b = module.apply(v, x, rngs=clone(rngs), dropout_rng=rng4)
    assert (a == b).all()
    a, b = module.apply(v, x, dropout_rng=clone(rng4))
    assert (a == b).all()
    assert a.shape == b.shape == x.shape


def test_flax_multihead_self_attention_w_dropout_disabled():
    x = jr.normal(jr.key(6), (4, 2, 3, 5))
    common = dict(num_heads=8, qkv_features=16, kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros,
                  attention_fn=attention_fn)  # fmt: skip
    rng1, rng2, rng3, rng4 = jr.split(jr.key(0), 4)
    rngs1, rngs2 = {"params": rng1, "dropout": rng2}, {"params": rng3, "dropout": rng4}
    sa_module0 = nn.MultiHeadDotProductAttention(**common, dropout_rate=0.0, deterministic=True)
    y1, vs = sa_module0.init_with_output(rngs1, x)
    y2, _ = sa_module0.init_with_output(rngs2, x)
    np.testing.assert_allclose(y1, y2)
    np.testing.assert_allclose(sa_module0.apply(vs, x, rngs=rngs1), sa_module0.apply(vs, x, rngs=rngs2))
    sa_module1 = nn.MultiHeadDotProductAttention(**common, dropout_rate=0.0)
    y5 = sa_module1.apply(vs, x, deterministic=True, rngs=rngs1)
    np.testing.assert_allclose(y5, sa_module1.apply(vs, x, deterministic=True, rngs=rngs2))
    sa_module2 = nn.MultiHeadDotProductAttention(**common, dropout_rate=0.5)
    y7 = sa_module2.apply(vs, x, deterministic=True, rngs=rngs1)
    np.testing.assert_allclose(y7, sa_module2.apply(vs, x, deterministic=True, rngs=rngs2))
    np.testing.assert_array_equal(y5, y7)


def test_flax_autoregressive_receptive_field_1d():
    length, dim, num_heads = 10, 1, 1
    rng1, rng2 = jr.split(jr.key(0))
    input_shape = (1, length, dim)
    inputs = jr.normal(rng2, input_shape)
    module = nn.MultiHeadDotProductAttention(
        num_heads=num_heads, kernel_init=jax.nn.initializers.ones, deterministic=False, attention_fn=attention_fn
    )
    initial_vars = module.init(rng1, inputs)
    causal_mask = nn.attention.make_causal_mask(jnp.ones(input_shape[:-1]))

    def model_loss(inputs, pos):
        out = module.apply(initial_vars, inputs, mask=causal_mask)
        assert out.shape == input_shape
        return out[0, pos, :].sum()

    grad_fn = jax.jit(jax.grad(model_loss), static_argnums=1)
    for i in range(length):
        deps = jnp.any(jnp.abs(grad_fn(inputs, i)[0, :, :]) > 1e-5, axis=-1)
        assert deps[:i].all(), f"position {i} does not reach every earlier position"
        assert not deps[i + 1 :].any(), f"position {i} reaches a later position"


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_autoregressive_decode_with_x64(api):
    with jax.enable_x64(True), _flax_defaults():
        x = jnp.ones((1, 4, 4))
        if api == "linen":
            module = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, decode=True,
                                                     attention_fn=attention_fn)  # fmt: skip
            variables = module.init(jr.PRNGKey(0), x)
            params, cache = variables["params"], variables["cache"]
            y1, updates = module.apply({"params": params, "cache": cache}, x[:, :1, :], mutable=["cache"])
            y2, _ = module.apply({"params": params, "cache": updates["cache"]}, x[:, 1:2, :], mutable=["cache"])
        else:
            module = nnx.MultiHeadAttention(in_features=4, num_heads=2, qkv_features=4, decode=True,
                                            attention_fn=attention_fn, rngs=nnx.Rngs(0))  # fmt: skip
            module.init_cache(x.shape, dtype=x.dtype)
            y1, y2 = module(x[:, :1, :]), module(x[:, 1:2, :])
        assert y1.shape == y2.shape == (1, 1, 4)
        assert y1.dtype == jnp.float64


def test_flax_mixed_precision_sown_weights():
    """Flax's `test_mixed_precision_multihead_attention`: `force_fp32_for_softmax` decides the sown weights' dtype."""
    x = jr.uniform(jr.key(0), (2, 4))
    for force_fp32, weights_dtype in ((True, jnp.float32), (False, jnp.bfloat16)):
        mha = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=4, force_fp32_for_softmax=force_fp32, deterministic=False, dtype=jnp.bfloat16,
            attention_fn=attention_fn,
        )  # fmt: skip
        with _flax_defaults():
            init_vars = mha.init({"params": jr.key(1), "dropout": jr.key(2)}, x)
            y, updated = mha.apply(init_vars, x, mutable=["intermediates"], sow_weights=True)
        assert updated["intermediates"]["attention_weights"][0].dtype == weights_dtype
        assert y.dtype == jnp.bfloat16


def test_flax_nnx_basic_and_varying_num_features():
    module = nnx.MultiHeadAttention(num_heads=2, in_features=3, qkv_features=6, out_features=6,
                                    attention_fn=attention_fn, rngs=nnx.Rngs(0))  # fmt: skip
    assert module(jnp.ones((1, 7, 3)), decode=False).shape == (1, 7, 6)
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=3, qkv_features=6, out_features=6, in_kv_features=4,
                                   attention_fn=attention_fn, rngs=nnx.Rngs(42), decode=False)  # fmt: skip
    assert layer(jnp.ones((1, 3)), jr.normal(jr.key(42), (1, 4))).shape == (1, 6)


@pytest.mark.parametrize("use_padding", [True, False])
@pytest.mark.parametrize("is_cross_attention", [True, False])
def test_flax_nnx_causal_mask_equivalence(use_padding, is_cross_attention):
    batch_size, num_heads, q_len, head_dim = 1, 2, 2, 4
    kv_len = 4 if is_cross_attention else q_len
    q = jr.normal(jr.key(0), (batch_size, 1, q_len, num_heads, head_dim))
    k = jr.normal(jr.key(1), (batch_size, 1, kv_len, num_heads, head_dim))
    v = jr.normal(jr.key(2), (batch_size, 1, kv_len, num_heads, head_dim))
    causal_mask = jnp.broadcast_to(jnp.tril(jnp.ones((q_len, kv_len), jnp.bool_)),
                                   (batch_size, 1, num_heads, q_len, kv_len))  # fmt: skip
    padding_mask = None
    if use_padding:
        padding_mask = jnp.ones((batch_size, 1, 1, q_len, kv_len), jnp.bool_).at[..., -2:].set(False)
    with _flax_defaults():
        manual_mask = nnx.combine_masks(padding_mask, causal_mask, dtype=q.dtype)
        attn_flax = nnx.dot_product_attention(q, k, v, mask=manual_mask, deterministic=True)

    class DummyModule(nnx.Module):
        pass

    def _run(m):
        return attention_fn(q, k, v, mask=padding_mask, is_causal=True, deterministic=True, module=m)

    with _flax_defaults():  # the sown weights are Flax's, computed by Flax's code
        attn_ours, sown = nnx.capture(_run, nnx.Intermediate)(DummyModule())
    assert sown["attention_weights"][0].shape == (batch_size, 1, num_heads, q_len, kv_len)
    expected = np.asarray(attn_flax)
    if use_padding and not is_cross_attention:  # every key is padding: Flax averages the values, attnlib gives 0
        expected = np.zeros_like(expected)
    np.testing.assert_allclose(attn_ours, expected, atol=1e-6)
    np.testing.assert_allclose(attention_fn(q, k, v, mask=manual_mask), expected, atol=1e-6)


@pytest.mark.parametrize("precision", [jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_flax_nnx_attention_equivalence_with_linen(precision, decode, dtype):
    """Flax's `test_nnx_attention_equivalence` (use_bias, param_dtype and normalize_qk leave attention_fn alone)."""
    x = jnp.ones((1, 3))
    kwargs = dict(num_heads=2, qkv_features=6, out_features=6, dtype=dtype, precision=precision, decode=decode,
                  attention_fn=attention_fn)  # fmt: skip
    model_nnx = nnx.MultiHeadAttention(in_features=3, **kwargs, rngs=nnx.Rngs(42))
    model = nn.MultiHeadDotProductAttention(**kwargs)
    variables = model.init(jr.key(42), x)
    for qkvo in ("query", "key", "value", "out"):
        getattr(model_nnx, qkvo).kernel[...] = variables["params"][qkvo]["kernel"]
        getattr(model_nnx, qkvo).bias[...] = variables["params"][qkvo]["bias"]
    if decode:
        model_nnx.init_cache(x.shape, dtype=dtype)
    out, _ = model.apply(variables, x, mutable=["cache"])
    np.testing.assert_array_equal(out, model_nnx(x))


def test_flax_nnx_gqa_shapes_and_invalid_heads():
    k1, k2, k3 = jr.split(jr.key(0), 3)
    query, key, value = jr.normal(k1, (2, 4, 6, 8)), jr.normal(k2, (2, 5, 3, 8)), jr.normal(k3, (2, 5, 3, 8))
    assert attention_fn(query, key, value).shape == (2, 4, 6, 8)
    with pytest.raises(ValueError, match="must be a multiple"):
        attention_fn(jnp.ones((1, 4, 5, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)))


def test_flax_nnx_gqa_multihead_attention_decodes():
    model = nnx.MultiHeadAttention(num_heads=8, in_features=16, qkv_features=64, num_kv_heads=2,
                                   attention_fn=attention_fn, rngs=nnx.Rngs(0))  # fmt: skip
    assert model(jnp.ones((1, 10, 16)), decode=False).shape == (1, 10, 16)
    model.init_cache((1, 10, 16))
    assert model.cached_key.shape == (1, 10, 2, 8)
    assert model(jnp.ones((1, 1, 16)), decode=True).shape == (1, 1, 16)
    assert model.cache_index == 1


def test_flax_nnx_gqa_parity_with_jax():
    class DummyModule(nnx.Module):
        pass

    k1, k2, k3 = jr.split(jr.key(42), 3)
    query, key, value = jr.normal(k1, (2, 8, 4, 16)), jr.normal(k2, (2, 8, 2, 16)), jr.normal(k3, (2, 8, 2, 16))
    with _flax_defaults():
        jax_out = jax.nn.dot_product_attention(query, key, value)
        out, sown = nnx.capture(lambda m: attention_fn(query, key, value, module=m), nnx.Intermediate)(DummyModule())
    np.testing.assert_allclose(out, jax_out, atol=1e-5, rtol=1e-5)
    assert sown["attention_weights"][0].shape == (2, 4, 8, 8)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, match",
    [
        ((2, 16, 4, 8), (16, 4, 8), (16, 4, 8), "same rank"),
        ((2, 16, 4, 8), (3, 16, 4, 8), (3, 16, 4, 8), "batch dims"),
        ((2, 16, 4, 8), (2, 16, 4, 8), (2, 15, 4, 8), "same length S"),
        ((2, 16, 4, 8), (2, 16, 4, 7), (2, 16, 4, 8), "same head dim H"),
    ],
    ids=["rank", "batch", "length", "depth"],
)
def test_flax_nnx_invalid_shapes(q_shape, k_shape, v_shape, match):
    with pytest.raises(ValueError, match=match):
        attention_fn(jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape), dropout_rate=0.1,
                     dropout_rng=jr.key(0))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# (d) declined and invalid arguments


@pytest.mark.parametrize("name", ["einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum"])
def test_einsum_overrides_are_declined(name):
    q, k, v = _qkv(30, (2,))
    with pytest.raises(NotImplementedError, match=rf"`{name}` is not supported .* Pass {name}=None\. Got {name}="):
        attention_fn(q, k, v, **{name: jax.lax.dot_general})


def test_linen_layer_with_einsum_classes_is_declined():
    layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4, attention_fn=attention_fn,
                                            qk_attn_weights_einsum_cls=lambda: jnp.einsum,
                                            attn_weights_value_einsum_cls=lambda: jnp.einsum)  # fmt: skip
    with pytest.raises(NotImplementedError, match="`qk_attn_weights_einsum` is not supported"):
        layer.init(jr.key(0), jnp.ones((1, 3, 4)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(precision=("highest", "bfloat16")), NotImplementedError, "two different operand precisions"),
        (dict(precision=jax.lax.DotAlgorithm(jnp.float32, jnp.float32, jnp.float32)), NotImplementedError,
         "custom jax.lax.DotAlgorithm"),
        (dict(precision="fast"), ValueError, r"`precision` must be None, .* Got precision='fast'\."),
        (dict(dropout_rate=0.1), ValueError, r"`dropout_rng` is required .* Got dropout_rng=None\."),
        (dict(dropout_rate=0.1, dropout_rng=jnp.ones(3)), TypeError, r"`dropout_rng` must be a PRNG key"),
        (dict(dropout_rate=1.0, dropout_rng=jr.key(0)), ValueError, r"`dropout_rate` must be a float in \[0, 1\)"),
        (dict(dropout_key=jr.key(0)), TypeError, r"pass the key as Flax's `dropout_rng`"),
        (dict(module=object()), TypeError, r"`module` must be None, a flax.linen.Module or a flax.nnx.Module"),
        (dict(deterministic=None), ValueError, r"`deterministic` must be a bool\. Got deterministic=None\."),
        (dict(broadcast_dropout=1), ValueError, r"`broadcast_dropout` must be a bool"),
        (dict(is_causal="yes"), ValueError, r"`is_causal` must be a bool"),
        (dict(promote_dtype="float32"), TypeError, r"`promote_dtype` must be None or a function"),
        (dict(not_an_option=1), TypeError, r"not_an_option"),
    ],
    ids=["precision_pair", "dot_algorithm", "precision_name", "no_rng", "bad_rng", "rate_one", "dropout_key",
         "module_type", "deterministic", "broadcast_dropout", "is_causal", "promote_dtype", "unknown_kwarg"],
)  # fmt: skip
def test_invalid_arguments_raise_named_errors(kwargs, error, match):
    q, k, v = _qkv(31, (2,))
    with pytest.raises(error, match=match):
        attention_fn(q, k, v, **kwargs)


def test_sowing_with_options_that_change_the_weights_is_declined():
    class DummyModule(nnx.Module):
        pass

    q, k, v = _qkv(32, (2,))
    fn = functools.partial(attention_fn, local_window_size=(2, 0))
    with pytest.raises(NotImplementedError, match=r"together with `local_window_size`"):
        nnx.capture(lambda m: fn(q, k, v, module=m), nnx.Intermediate)(DummyModule())
    with _flax_defaults():  # the implementation leaves the weights alone
        _, sown = nnx.capture(lambda m: attention_fn(q, k, v, module=m, implementation="xla"), nnx.Intermediate)(
            DummyModule()
        )
    assert sown["attention_weights"][0].shape == (2, N, T, S)


def test_deterministic_dropout_ignores_rate_and_rng():
    q, k, v = _qkv(33, (2,))
    expected = attention_fn(q, k, v)
    np.testing.assert_array_equal(attention_fn(q, k, v, dropout_rate=0.5, deterministic=True), expected)
    np.testing.assert_array_equal(attention_fn(q, k, v, dropout_rate=0.0, dropout_rng=jr.key(1)), expected)


# ------------------------------------------------------------------------------------------------------------------
# (e) dropout


def test_dropout_is_attnlib_dropout_reproducible_per_key():
    q, k, v = _qkv(40, (2,))
    rate = 0.3
    call = jax.jit(lambda rng, broadcast: attention_fn(q, k, v, dropout_rate=rate, dropout_rng=rng,
                                                       broadcast_dropout=broadcast), static_argnums=1)  # fmt: skip
    y1, y2, y3 = call(jr.key(1), True), call(jr.key(1), True), call(jr.key(2), True)
    np.testing.assert_array_equal(y1, y2)
    assert np.abs(np.asarray(y1 - y3)).max() > 1e-3
    assert np.abs(np.asarray(y1 - attention_fn(q, k, v))).max() > 1e-3
    # attnlib's own dropout with the same key; broadcast_dropout does not change attnlib's mask
    same = jax.jit(lambda rng: attnlib.attention(q, k, v, dropout_rate=rate, dropout_key=rng))(jr.key(1))
    np.testing.assert_array_equal(y1, same)
    np.testing.assert_array_equal(y1, call(jr.key(1), False))
    # a raw uint32 key (jax.random.PRNGKey) works too
    assert call(jr.PRNGKey(1), True).shape == y1.shape


def test_dropout_is_unbiased_and_keeps_the_right_fraction():
    """Value = one-hot keys, so the output rows are the dropped, rescaled weights; their mean over keys is the
    weights (per-element 5-sigma bound), and the kept fraction is 1 - rate. Masks differ across heads and batch rows
    (attnlib's independent draw, also under broadcast_dropout=True)."""
    rate, n = 0.3, 256
    r = np.random.default_rng(41)
    q, k = normal(r, (2, T, 3, H)), normal(r, (2, S, 3, H))
    v = jnp.broadcast_to(jnp.eye(S, dtype=F32)[None, :, None, :], (2, S, 3, S))
    probs = np.asarray(attention_fn(q, k, v), np.float64)
    draws = jax.jit(jax.vmap(lambda rng: attention_fn(q, k, v, dropout_rate=rate, dropout_rng=rng)))(
        jr.split(jr.key(0), n)
    )
    draws = np.asarray(draws, np.float64)
    kept = draws != 0
    np.testing.assert_allclose(draws[kept], np.broadcast_to(probs / (1 - rate), draws.shape)[kept], rtol=1e-6)
    sigma = np.sqrt(rate * (1 - rate) / kept.size)
    assert abs(kept.mean() - (1 - rate)) < 5 * sigma
    mean, std = draws.mean(0), draws.std(0, ddof=1)
    assert (np.abs(mean - probs) <= 5 * std / np.sqrt(n) + 1e-6).all()
    assert not np.array_equal(kept[:, 0, :, 0], kept[:, 0, :, 1])  # heads draw their own masks
    assert not np.array_equal(kept[:, 0], kept[:, 1])  # batch rows too


def test_dropout_through_the_layers():
    x = normal(np.random.default_rng(42), (2, T, 9))
    theirs, ours = _linen_pair(num_heads=3, qkv_features=12, dropout_rate=0.4)
    with _flax_defaults():
        params = theirs.init(jr.key(0), x, deterministic=True)
        expected = theirs.apply(params, x, deterministic=True)
    assert_out_close(ours.apply(params, x, deterministic=True), expected, F32)
    y1 = ours.apply(params, x, deterministic=False, rngs={"dropout": jr.key(1)})
    y2 = ours.apply(params, x, deterministic=False, rngs={"dropout": jr.key(1)})
    y3 = ours.apply(params, x, deterministic=False, rngs={"dropout": jr.key(2)})
    np.testing.assert_array_equal(y1, y2)
    assert np.abs(np.asarray(y1 - y3)).max() > 1e-3 and np.abs(np.asarray(y1 - expected)).max() > 1e-3

    kwargs = dict(num_heads=N, in_features=9, qkv_features=12, num_kv_heads=K, dropout_rate=0.4, decode=False)
    theirs_nnx = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours_nnx = nnx.MultiHeadAttention(**kwargs, attention_fn=attention_fn, rngs=nnx.Rngs(0))
    with _flax_defaults():
        expected = theirs_nnx(x, deterministic=True)
    assert_out_close(ours_nnx(x, deterministic=True), expected, F32)
    z1, z2 = ours_nnx(x, deterministic=False), ours_nnx(x, deterministic=False)  # the layer's stream advances
    assert np.abs(np.asarray(z1 - z2)).max() > 1e-3 and np.abs(np.asarray(z1 - expected)).max() > 1e-3
    z3 = ours_nnx(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    np.testing.assert_array_equal(z3, ours_nnx(x, deterministic=False, rngs=nnx.Rngs(dropout=7)))
    grads = nnx.grad(lambda m: jnp.sum(m(x, deterministic=False, rngs=nnx.Rngs(dropout=7)) ** 2))(ours_nnx)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_public_module_and_signature():
    import inspect

    ours = inspect.signature(attention_fn).parameters
    linen = inspect.signature(nn.dot_product_attention).parameters
    assert list(ours)[: len(linen)] == list(linen)  # linen's positional order
    for name, p in inspect.signature(nnx.dot_product_attention).parameters.items():
        assert name in ours, name  # every keyword flax.nnx's layer may pass
    assert "pip install 'attnlib[flax]'" in pathlib.Path(aflax.__file__).read_text()


@pytest.mark.gpu
def test_gpu_cudnn_through_the_linen_layer_matches_xla():
    """bfloat16 heads of width 64 through linen's layer with a causal window: one cuDNN call per direction, and the
    attention output matches `implementation="xla"` in float32 on the same bf16-rounded inputs (bf16 tolerances, as
    tests/test_cudnn_gpu.py)."""
    eps = 2.0**-7
    r = np.random.default_rng(0)
    q = normal(r, (3, 64, 4, 64), jnp.bfloat16)
    k, v = normal(r, (3, 64, 2, 64), jnp.bfloat16), normal(r, (3, 64, 2, 64), jnp.bfloat16)
    options = dict(is_causal=True, local_window_size=(16, 0))
    cudnn = functools.partial(attention_fn, **options, implementation="cudnn")
    out = jax.jit(cudnn)(q, k, v)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(functools.partial(attention_fn, **options, implementation="xla"))(
            *(x.astype(F32) for x in (q, k, v))
        )
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    assert np.all(np.abs(out - ref) <= 2 * eps + eps * np.abs(ref)), np.abs(out - ref).max()

    layer = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=256, dtype=jnp.bfloat16, attention_fn=cudnn)
    x = normal(r, (3, 64, 256), jnp.bfloat16)
    params = layer.init(jr.key(0), x)
    loss = lambda p: jnp.sum(layer.apply(p, x).astype(F32) ** 2)
    assert jax.jit(jax.grad(loss)).lower(params).as_text().count("custom_call @attnlib_cudnn_graph") == 2
    g = jax.jit(jax.grad(loss))(params)
    assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves(g))
