"""Every layout as one dense problem for the plain-JAX implementations.

`*B` is flattened to `B`; THD becomes one row of packed tokens (`B = 1`); paged key/value pools are gathered into
dense `[B, S, K, H]` rows. Bias, mask and `score_mod_args` become rank 4 `[B|1, N|1, T|1, S|1]`. Sequence
structure travels as `TokenPositions`.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import dropout as dropout_lib, paged, positions as positions_lib
from .config import AttentionConfig, AttentionInputs


class Problem(NamedTuple):
    """One attention problem in canonical dense form.

    Attributes:
        query: `[B, T, N, H]`.
        key: `[B, S, K, H]`.
        value: `[B, S, K, Hv]`.
        bias: float `[B|1, N|1, T|1, S|1]` or None.
        mask: bool `[B|1, N|1, T|1, S|1]` or None.
        sinks: float `[N]` or None.
        dropout_seeds: uint32 `[2]` or None.
        positions: sequence ids and aligned positions of query and key tokens.
        score_mod_args: the arrays `score_mod` / `mask_mod` see one element of, each `[B|1, N|1, T|1, S|1]` in
            its own dtype; empty without them.
        scale: the 0-d float array of a runtime scale (`config.scale` is None), else None.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    sinks: jax.Array | None
    dropout_seeds: jax.Array | None
    positions: positions_lib.TokenPositions
    score_mod_args: tuple[jax.Array, ...] = ()
    scale: jax.Array | None = None


def _to_rank4(x: jax.Array, batch_shape: tuple[int, ...]) -> jax.Array:
    """`[*B?, N|1, T|1, S|1]` broadcastable array -> `[B|1, N|1, T|1, S|1]`."""
    nb = len(batch_shape)
    x = jnp.reshape(x, (1,) * (nb + 3 - x.ndim) + x.shape)
    if all(d == 1 for d in x.shape[:nb]):
        return jnp.reshape(x, (1,) + x.shape[nb:])
    x = jnp.broadcast_to(x, batch_shape + x.shape[nb:])
    return jnp.reshape(x, (math.prod(batch_shape),) + x.shape[nb:])


def dense_token_positions(config: AttentionConfig, inputs: AttentionInputs) -> positions_lib.TokenPositions:
    """Positions of a dense or paged call's `[B, T]` queries and `[B, S]` keys (`*B` flattened): padding lengths and
    segment ids (`kv_segment_ids` defaulting to `q_segment_ids`), aligned by `diagonal_alignment`."""
    B = config.batch_size
    flat = lambda x: None if x is None else jnp.reshape(x, (B,) + x.shape[len(config.batch_shape) :])
    q_seg = flat(inputs.q_segment_ids)
    kv_seg = flat(inputs.kv_segment_ids)
    if q_seg is not None and kv_seg is None:
        kv_seg = q_seg
    return positions_lib.dense_positions(
        B,
        config.q_len,
        config.kv_len,
        bottom_right=config.diagonal_alignment == "bottom_right",
        query_seq_lengths=flat(inputs.query_seq_lengths),
        key_value_seq_lengths=flat(inputs.key_value_seq_lengths),
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
    )


def canonicalize(config: AttentionConfig, inputs: AttentionInputs) -> Problem:
    """Build the canonical problem of a validated call."""
    bs = config.batch_shape
    B = config.batch_size
    bottom_right = config.diagonal_alignment == "bottom_right"

    if config.layout == "thd":
        query, key, value = inputs.query[None], inputs.key[None], inputs.value[None]
        cu_kv = inputs.cu_seqlens_kv if inputs.cu_seqlens_kv is not None else inputs.cu_seqlens_q
        positions = positions_lib.thd_positions(
            inputs.cu_seqlens_q, cu_kv, config.q_len, config.kv_len, bottom_right=bottom_right
        )
    else:
        query = jnp.reshape(inputs.query, (B,) + inputs.query.shape[-3:])
        if config.layout == "paged":
            key = paged.gather_pages(inputs.key, inputs.page_table)
            value = paged.gather_pages(inputs.value, inputs.page_table)
        else:
            key = jnp.reshape(inputs.key, (B,) + inputs.key.shape[-3:])
            value = jnp.reshape(inputs.value, (B,) + inputs.value.shape[-3:])
        positions = dense_token_positions(config, inputs)

    bias = None if inputs.bias is None else _to_rank4(inputs.bias, bs)
    mask = None if inputs.mask is None else _to_rank4(inputs.mask, bs)
    seeds = None
    if config.dropout_rate > 0:
        seeds = dropout_lib.dropout_seeds(inputs.dropout_key)
    score_mod_args = tuple(_to_rank4(a, bs) for a in inputs.score_mod_args)
    return Problem(query, key, value, bias, mask, inputs.sinks, seeds, positions, score_mod_args, inputs.scale)


def restore(config: AttentionConfig, out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Canonical `[B, T, N, Hv]` / `[B, T, N]` back to the caller's layout (`*B`, unbatched, THD)."""
    if config.layout == "thd" or config.unbatched:
        return out[0], lse[0]
    return (
        jnp.reshape(out, config.batch_shape + out.shape[1:]),
        jnp.reshape(lse, config.batch_shape + lse.shape[1:]),
    )
