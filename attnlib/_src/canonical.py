"""Every layout as one dense problem for the plain-JAX implementations.

`*B` is flattened to `B`; THD becomes one row of packed tokens (`B = 1`); paged key/value pools (in any layout,
`kv_layouts.py`) are gathered into dense `[B, S, K, H]` rows, and ragged queries against them (`cu_seqlens_q` with
`page_table`) into rows `[B, max_seqlen_q, N, H]` padded with `query_seq_lengths` (`ragged_rows`, the rows cuDNN's paged
graph takes too; tokens past `cu_seqlens_q[-1]` get out 0 and lse -inf where `gather_rows` reads them back). Bias, mask
and `score_mod_args` become rank 4 `[B|1, N|1, T|1, S|1]`. Sequence structure travels as `TokenPositions`.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import dropout as dropout_lib, positions as positions_lib
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
        ragged_rows: ragged paged queries only: int32 `[T]`, the flat `[B * T']` row of each packed query token
            (`RaggedRows.rows`: `restore` reads its result there), else None.
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
    ragged_rows: jax.Array | None = None


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
    elif config.ragged_queries:
        key, value = config.pool_layout.gather(inputs.key, inputs.value, inputs.page_table)
        laid_out = ragged_rows(config, inputs.query, inputs.cu_seqlens_q)
        query = laid_out.query
        kv_lengths = jnp.clip(inputs.key_value_seq_lengths.astype(jnp.int32), 0, config.kv_len)
        positions = positions_lib.dense_positions(
            config.num_sequences, query.shape[1], config.kv_len, bottom_right=bottom_right,
            query_seq_lengths=laid_out.lengths, key_value_seq_lengths=kv_lengths, q_segment_ids=None,
            kv_segment_ids=None,
        )  # fmt: skip
    else:
        query = jnp.reshape(inputs.query, (B,) + inputs.query.shape[-3:])
        if config.layout == "paged":
            key, value = config.pool_layout.gather(inputs.key, inputs.value, inputs.page_table)
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
    return Problem(
        query, key, value, bias, mask, inputs.sinks, seeds, positions, score_mod_args, inputs.scale,
        laid_out.rows if config.ragged_queries else None,
    )  # fmt: skip


class RaggedRows(NamedTuple):
    """Ragged queries against a paged cache (`cu_seqlens_q` with `page_table`) laid out as dense rows.

    Attributes:
        query: `[B, T', N, H]`: sequence `b`'s queries in its first `lengths[b]` rows, zeros after them.
        rows: int32 `[T]`: the flat `[B * T']` row of each packed query token (`gather_rows` reads the token's
            result there); tokens past `cu_seqlens_q[-1]`, or past a sequence's first `max_seqlen_q`, point past every
            row (`gather_rows` fills them).
        lengths: int32 `[B]`: the query rows of each sequence (at most `max_seqlen_q`).
    """

    query: jax.Array
    rows: jax.Array
    lengths: jax.Array


def ragged_rows(config: AttentionConfig, query: jax.Array, cu_seqlens_q: jax.Array) -> RaggedRows:
    """Packed queries `[T, N, H]` as padded rows `[B, max_seqlen_q, N, H]` (a sequence longer than `max_seqlen_q`
    keeps its first rows): what every implementation of ragged paged queries attends with (cuDNN's paged graph
    included, whose rows may not outnumber the cache's keys)."""
    B, T, bound = config.num_sequences, config.q_len, config.max_seqlen_q
    cu = cu_seqlens_q.astype(jnp.int32)
    q_lengths = jnp.clip(cu[1:] - cu[:-1], 0, bound)
    token = jnp.arange(bound, dtype=jnp.int32)[None, :]
    source = jnp.where(token < q_lengths[:, None], cu[:-1, None] + token, T)  # T: out of range, reads zeros
    dense = jnp.take(query, source, axis=0, mode="fill", fill_value=0)
    tokens = positions_lib.packed_tokens(cu, T)
    inside = tokens.inside & (tokens.offset < bound)
    # Tokens outside every row point past them all: `gather_rows` fills their results.
    flat = jnp.where(inside, tokens.sequence * bound + tokens.offset, B * bound)
    return RaggedRows(dense, flat, q_lengths)


def gather_rows(x: jax.Array, rows: jax.Array, fill_value: float = 0.0) -> jax.Array:
    """Results `[B, T', ...]` of the rows of `ragged_rows` back at the packed query tokens: `[T, ...]` (`rows`:
    `RaggedRows.rows`); a token past every row gets `fill_value` (0 for outputs, -inf for `lse`)."""
    flat = jnp.reshape(x, (-1,) + x.shape[2:])
    return jnp.take(flat, rows, axis=0, mode="fill", fill_value=fill_value)


def restore(
    config: AttentionConfig, out: jax.Array, lse: jax.Array, problem: Problem | None = None
) -> tuple[jax.Array, jax.Array]:
    """Canonical `[B, T, N, Hv]` / `[B, T, N]` back to the caller's layout (`*B`, unbatched, THD; ragged paged
    queries need their `problem`)."""
    if config.ragged_queries:
        return gather_rows(out, problem.ragged_rows), gather_rows(lse, problem.ragged_rows, -jnp.inf)
    if config.layout == "thd" or config.unbatched:
        return out[0], lse[0]
    return (
        jnp.reshape(out, config.batch_shape + out.shape[1:]),
        jnp.reshape(lse, config.batch_shape + lse.shape[1:]),
    )
