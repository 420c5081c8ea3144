"""Attention gradients from a fused forward's saved log-sum-exp, in plain JAX, in one pass over the keys."""

import jax
import jax.numpy as jnp


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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """`(dq, dk, dv, dbias)` of softmax attention whose forward saved `out` and `lse`.

    The probabilities are recomputed as `exp(scale * q.k + bias - lse)` on the visible keys; every score-sized tensor
    is materialised once (`[B, N, T, S]` float32), so this is for few query rows. The matmuls take the inputs' dtype
    and accumulate in float32, the probabilities and their gradients are rounded to the inputs' dtype before the
    matmuls that produce dV, dQ and dK (as fused kernels do). Sinks only enter through `lse`.

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

    Returns:
        `dq [B, T, N, H]`, `dk [B, S, K, H]`, `dv [B, S, K, Hv]` in the inputs' dtypes and `dbias` in the bias'
        shape and dtype (None without a bias).
    """
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
    # D = rowsum(dO * O): the softmax Jacobian's diagonal correction.
    correction = jnp.sum(d_out.astype(f32) * out.astype(f32), axis=-1)  # [B, T, N]
    correction = jnp.transpose(jnp.reshape(correction, (B, T, K, G)), (0, 2, 3, 1))[..., None]
    dp = jnp.einsum("btkgh,bskh->bkgts", do5, value, preferred_element_type=f32)
    ds = p * (dp - correction)
    dv = jnp.einsum("bkgts,btkgh->bskh", p.astype(value.dtype), do5, preferred_element_type=f32)
    ds_in = ds.astype(query.dtype)
    dq = jnp.einsum("bkgts,bskh->btkgh", ds_in, key, preferred_element_type=f32) * f32(scale)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds_in, q5, preferred_element_type=f32) * f32(scale)
    dbias = None
    if bias is not None:
        ds_heads = jnp.reshape(ds, (B, N, T, -1))
        dbias = jnp.sum(ds_heads, axis=tuple(i for i in (0, 1) if bias.shape[i] == 1), keepdims=True)
        dbias = dbias.astype(bias.dtype)
    return (
        jnp.reshape(dq, (B, T, N, H)).astype(query.dtype),
        dk.astype(key.dtype),
        dv.astype(value.dtype),
        dbias,
    )
