"""The log-sum-exp of attention scores in plain JAX: what a fused kernel differentiates the `lse` it returns through."""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import scores


def logsumexp(
    query: jax.Array,
    key: jax.Array,
    visible: jax.Array,
    *,
    scale: float,
    bias: jax.Array | None = None,
    sinks: jax.Array | None = None,
    score_mod: Callable[[jax.Array], jax.Array] | None = None,
    masked_below: float | None = None,
) -> jax.Array:
    """The float32 log-sum-exp of each query row's scores over the keys it sees, sinks included.

    Scores are `score_mod(scale * q.k) + bias` in float32 from matmuls at `Precision.HIGHEST`; a row that sees
    nothing has `lse = -inf` (its sink logit with `sinks`) and passes no gradient to the scores.

    Args:
        query: `[B, T, N, H]`.
        key: `[B, S, K, H]`.
        visible: bool `[B, T, S]`: the keys each query row sees (sequence structure and band).
        scale: the logit scale.
        bias: `[B|1, N|1, T, S]`, added after `score_mod`.
        sinks: `[N]` sink logits, one more term in every row's sum.
        score_mod: float32 scores `[B, N, T, S]` -> modified scores of the same shape.
        masked_below: scores (after the bias) at or below this count as hidden: masks that reach a kernel as a
            large negative bias or score rather than as `visible`.

    Returns:
        float32 `[B, T, N]`.
    """
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    q5 = jnp.reshape(query.astype(jnp.float32), (B, T, K, G, H))
    s = jnp.einsum(
        "btkgh,bskh->bkgts", q5, key.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ) * jnp.float32(scale)
    if score_mod is not None:
        s = jnp.reshape(score_mod(jnp.reshape(s, (B, N, T, S))), s.shape)
    if bias is not None:
        heads = (K, G) if bias.shape[1] > 1 else (1, 1)
        s = s + jnp.reshape(bias.astype(jnp.float32), (bias.shape[0], *heads, T, S))
    allowed = visible[:, None, None]
    if masked_below is not None:
        allowed = allowed & (s > masked_below)
    grouped_sinks = None if sinks is None else jnp.reshape(sinks.astype(jnp.float32), (1, K, G, 1))
    _, _, lse = scores.statistics(s, allowed, grouped_sinks)  # [B, K, G, T]
    return jnp.transpose(jnp.reshape(scores.neg_inf_where_empty(lse), (B, N, T)), (0, 2, 1))
