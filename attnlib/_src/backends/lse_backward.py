"""Attention gradients from a fused forward's saved log-sum-exp, in plain JAX, in one pass over the keys."""

import jax
import jax.numpy as jnp


# Query rows per key head (T * G) up to which the gradients come from elementwise products rather than matmuls
# (docs/performance.md).
PRODUCT_ROWS = 4


def gradients(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    out: jax.Array,
    d_out: jax.Array,
    lse: jax.Array,
    visible: jax.Array,
    *,
    scale: float,
    bias: jax.Array | None = None,
    products: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`(dq, dk, dv, dbias)` of softmax attention whose forward saved `out` and `lse`.

    The probabilities are recomputed as `exp(scale * q.k + bias - lse)` on the visible keys; every score-sized tensor
    is materialised once (`[B, N, T, S]` float32), so this is for few query rows. With at most `PRODUCT_ROWS` query
    rows per key head everything is float32 elementwise products and sums; with more, matmuls take the inputs'
    dtype and accumulate in float32, and the probabilities and their gradients are rounded to the inputs' dtype
    before the matmuls that produce dV, dQ and dK (as fused kernels do). Sinks only enter through `lse`.

    Args:
        query: `[B, T, N, H]`.
        key: `[B, S, K, H]`.
        value: `[B, S, K, Hv]`.
        out: `[B, T, N, Hv]`, the forward's output.
        d_out: `[B, T, N, Hv]`, its cotangent (zero in rows that see no key).
        lse: float32 `[B, N, T]`, the forward's log-sum-exp (finite in rows that see no key).
        visible: bool `[B, T, S]`: the keys each query row sees.
        scale: the logit scale.
        bias: `[B|1, N|1, T, S]`, added to the scaled logits.
        products: the elementwise-products form (True) or the matmul form (False); None: products for at most
            `PRODUCT_ROWS` query rows per key head.

    Returns:
        `dq [B, T, N, H]`, `dk [B, S, K, H]`, `dv [B, S, K, Hv]` in the inputs' dtypes and `dbias` in the bias'
        shape and dtype (None without a bias).
    """
    B, T, N, H = query.shape
    K = key.shape[2]
    G = N // K
    if products is None:
        products = T * G <= PRODUCT_ROWS
    if products:
        dq, dk, dv, ds = _by_products(query, key, value, out, d_out, lse, visible, scale, bias)
    else:
        dq, dk, dv, ds = _by_matmuls(query, key, value, out, d_out, lse, visible, scale, bias)
    dbias = None
    if bias is not None:
        dbias = jnp.sum(ds, axis=tuple(i for i in (0, 1) if bias.shape[i] == 1), keepdims=True).astype(bias.dtype)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), dbias


def _correction(out: jax.Array, d_out: jax.Array) -> jax.Array:
    """`[B, T, N]` float32 `rowsum(dO * O)`: the softmax Jacobian's diagonal correction."""
    return jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)


def _by_matmuls(query, key, value, out, d_out, lse, visible, scale, bias):
    """Scores `[B, K, G, T, S]` from batched matmuls over `(B, K)` (XLA transposes K, V, dK and dV around them)."""
    B, T, N, H = query.shape
    K = key.shape[2]
    G = N // K
    f32 = jnp.float32
    q5 = jnp.reshape(query, (B, T, K, G, H))
    do5 = jnp.reshape(d_out, (B, T, K, G, d_out.shape[-1]))
    s = jnp.einsum("btkgh,bskh->bkgts", q5, key, preferred_element_type=f32) * f32(scale)
    if bias is not None:
        heads = (K, G) if bias.shape[1] > 1 else (1, 1)
        s = s + jnp.reshape(bias.astype(f32), (bias.shape[0], *heads, T, bias.shape[-1]))
    p = jnp.where(visible[:, None, None], jnp.exp(s - jnp.reshape(lse, (B, K, G, T, 1))), 0.0)
    correction = jnp.transpose(jnp.reshape(_correction(out, d_out), (B, T, K, G)), (0, 2, 3, 1))[..., None]
    dp = jnp.einsum("btkgh,bskh->bkgts", do5, value, preferred_element_type=f32)
    ds = p * (dp - correction)
    dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(value.dtype), do5, preferred_element_type=f32)
    ds_in = ds.astype(query.dtype)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds_in, key, preferred_element_type=f32) * f32(scale)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds_in, q5, preferred_element_type=f32) * f32(scale)
    return jnp.reshape(dq, (B, T, N, H)), dk, dv, jnp.reshape(ds, (B, N, T, -1))


def _by_products(query, key, value, out, d_out, lse, visible, scale, bias):
    """Scores `[B, S, K, T, G]` from elementwise products reduced over the head dim, in float32: every pass reads
    K and V (and writes dK and dV) in their own `[B, S, K, H]` layout, with no transpose. For a few query rows per
    key head, where the products cost less than the transposes a matmul needs."""
    B, T, N, H = query.shape
    K = key.shape[2]
    G = N // K
    f32 = jnp.float32
    per_head = lambda x: jnp.transpose(jnp.reshape(x, (B, T, K, G) + x.shape[3:]), (0, 2, 1, 3, *range(4, x.ndim + 1)))
    qk = per_head(query.astype(f32))[:, None]  # [B, 1, K, T, G, H]
    dok = per_head(d_out.astype(f32))[:, None]  # [B, 1, K, T, G, Hv]
    keys = key.astype(f32)[:, :, :, None, None, :]  # [B, S, K, 1, 1, H]
    s = jnp.sum(keys * qk, axis=-1) * f32(scale)  # [B, S, K, T, G]
    to_scores = lambda x: jnp.transpose(jnp.reshape(x, (x.shape[0], K, G, T, -1)), (0, 4, 1, 3, 2))
    if bias is not None:
        s = s + to_scores(jnp.broadcast_to(bias, (bias.shape[0], N, T, bias.shape[-1])).astype(f32))
    row_stat = lambda x: per_head(x[..., None])[:, None, ..., 0]  # [B, T, N] -> [B, 1, K, T, G]
    lse_rows = row_stat(jnp.transpose(lse, (0, 2, 1)))
    p = jnp.where(jnp.transpose(visible, (0, 2, 1))[:, :, None, :, None], jnp.exp(s - lse_rows), 0.0)
    dp = jnp.sum(value.astype(f32)[:, :, :, None, None, :] * dok, axis=-1)
    ds = p * (dp - row_stat(_correction(out, d_out)))
    dv = jnp.sum(p[..., None] * dok, axis=(3, 4))
    dk = jnp.sum(ds[..., None] * qk, axis=(3, 4)) * f32(scale)
    dq = jnp.sum(ds[..., None] * keys, axis=1) * f32(scale)  # [B, K, T, G, H]
    dq = jnp.reshape(jnp.transpose(dq, (0, 2, 1, 3, 4)), (B, T, N, H))
    ds_heads = jnp.reshape(jnp.transpose(ds, (0, 2, 4, 3, 1)), (B, N, T, -1))
    return dq, dk, dv, ds_heads
