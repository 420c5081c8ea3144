"""`lse_backward.gradients` (the cuDNN dense path's backward for a few query rows over many keys) against the float64
reference, in both of its forms (elementwise products and matmuls), fed the reference's own `out` and `lse`."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, lengths, normal, qkv, rng
from reference import reference_attention, reference_attention_vjp, visibility

from attnlib._src.backends import lse_backward


B, T, S, N, K, H, HV = 3, 2, 37, 6, 2, 16, 8  # T * G = 6 rows per key head


@pytest.mark.parametrize("form", ["products", "matmuls"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias_N1TS"])
def test_gradients_match_reference(form, with_bias):
    r = rng(11)
    q, k, v = qkv(r, batch=(B,), t=T, s=S, n=N, k=K, h=H, hv=HV)
    bias = normal(r, (N, T, S)) if with_bias else None
    sinks = normal(r, (N,))
    kv_lengths = [S, 20, 0]  # the last sequence has no key: its rows see nothing
    kw = dict(key_value_seq_lengths=lengths(kv_lengths), is_causal=True, diagonal_alignment="bottom_right",
              local_window_size=(11, 0), sinks=np.asarray(sinks, np.float64))  # fmt: skip
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)
    out, lse = reference_attention(f64(q), f64(k), f64(v), f64(bias), **kw)
    d_out = normal(r, out.shape)
    ref = reference_attention_vjp(f64(q), f64(k), f64(v), f64(bias), d_out=f64(d_out), **kw)

    scale = 1 / np.sqrt(H)
    visible = jnp.asarray(visibility(f64(q), f64(k), f64(v), f64(bias), **kw)[:, 0])  # the same for every head
    seen = np.asarray(visible).any(-1)  # [B, T]
    # As the cuDNN path hands them over: finite statistics and zero cotangents in rows that see no key.
    lse_heads = jnp.asarray(np.where(seen[:, :, None], lse, 0.0).transpose(0, 2, 1), jnp.float32)
    d_out = jnp.where(jnp.asarray(seen)[..., None, None], d_out, 0.0)
    dq, dk, dv, dbias = lse_backward.gradients(
        q, k, v, jnp.asarray(out, jnp.float32), d_out, lse_heads, visible, scale=scale,
        bias=None if bias is None else bias[None], products=form == "products",
    )  # fmt: skip
    assert_grad_close(dq, ref["query"], jnp.float32, what="dq")
    assert_grad_close(dk, ref["key"], jnp.float32, what="dk")
    assert_grad_close(dv, ref["value"], jnp.float32, what="dv")
    if with_bias:
        assert dbias.shape == (1, N, T, S)
        assert_grad_close(dbias[0], ref["bias"], jnp.float32, what="dbias")
    else:
        assert dbias is None
