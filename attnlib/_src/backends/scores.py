"""Scores, visibility and dropout for a block of keys: the pieces both plain-JAX implementations share.

Scores are laid out `[B, K, G, T, s]` (query head `n = k * G + g`, `G = N // K`) so grouped-query attention never
repeats key/value heads; `s` is the whole key length (`xla`) or one key block (`xla_chunked`).
"""

import jax
import jax.numpy as jnp

from .. import dropout as dropout_lib, masks
from ..canonical import Problem
from ..config import AttentionConfig


def precision(dtype) -> jax.lax.Precision:
    """Full float32 matmuls for float32 inputs (no TF32 on GPUs); the default for 16-bit inputs."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def grouped_query(config: AttentionConfig, query: jax.Array) -> jax.Array:
    """`[B, T, N, H]` -> `[B, K, G, T, H]`: the score matmul then writes `[B, K, G, T, s]` without a transpose."""
    B, T, N, H = query.shape
    return jnp.transpose(jnp.reshape(query, (B, T, config.num_kv_heads, config.group_size, H)), (0, 2, 3, 1, 4))


def grouped_heads(config: AttentionConfig, x: jax.Array) -> jax.Array:
    """Rank-4 `[B|1, N|1, T|1, s|1]` -> `[B|1, K|1, G|1, T|1, s|1]`."""
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return jnp.reshape(x, (b, config.num_kv_heads, config.group_size, t, s))


def grouped_sinks(config: AttentionConfig, sinks: jax.Array) -> jax.Array:
    """`[N]` -> float32 `[1, K, G, 1]`."""
    return jnp.reshape(sinks.astype(jnp.float32), (1, config.num_kv_heads, config.group_size, 1))


def raw_scores(config: AttentionConfig, q5: jax.Array, key: jax.Array, bias: jax.Array | None) -> jax.Array:
    """float32 `[B, K, G, T, s]` scores `scale * q.k (+ bias)`, before soft-capping.

    Args:
        q5: `[B, K, G, T, H]`.
        key: `[B, s, K, H]`.
        bias: rank-4 bias block or None.
    """
    s = jnp.einsum(
        "bkgth,bskh->bkgts", q5, key, preferred_element_type=jnp.float32, precision=precision(q5.dtype)
    )
    s = s * jnp.float32(config.scale)
    if bias is not None:
        s = s + grouped_heads(config, bias).astype(jnp.float32)
    return s


def soft_cap(config: AttentionConfig, s: jax.Array) -> jax.Array:
    """`c * tanh(s / c)` when `logits_soft_cap` is set."""
    if config.logits_soft_cap is None:
        return s
    c = jnp.float32(config.logits_soft_cap)
    return c * jnp.tanh(s / c)


def visible(
    config: AttentionConfig, problem: Problem, k_start: jax.Array | int, k_size: int, mask: jax.Array | None
) -> jax.Array:
    """Bool `[B, 1|K, 1|G, T, s]` for keys `k_start : k_start + k_size` (`mask` already sliced to them)."""
    p = problem.positions
    kv_segment = None if p.kv_segment is None else jax.lax.dynamic_slice_in_dim(p.kv_segment, k_start, k_size, axis=1)
    kv_position = jax.lax.dynamic_slice_in_dim(p.kv_position, k_start, k_size, axis=1)
    allowed = masks.visible(
        p.q_segment, p.q_position, kv_segment, kv_position, is_causal=config.is_causal, window=config.window
    )[:, None, None]
    if mask is not None:
        allowed = allowed & grouped_heads(config, mask)
    return allowed


def dropout_keep(
    config: AttentionConfig, seeds: jax.Array, batch: int, q_len: int, k_start: jax.Array | int, k_size: int
) -> jax.Array:
    """Bool `[B, K, G, T, s]` keep mask for keys `k_start : k_start + k_size`."""
    K, G = config.num_kv_heads, config.group_size
    b = jnp.arange(batch)[:, None, None, None, None]
    n = (jnp.arange(K)[:, None] * G + jnp.arange(G)[None, :])[None, :, :, None, None]
    i = jnp.arange(q_len)[None, None, None, :, None]
    j = (k_start + jnp.arange(k_size))[None, None, None, None, :]
    return dropout_lib.keep_mask_from_seeds(seeds, config.dropout_rate, b, n, i, j)
