"""Per-token sequence membership and positions: the one rule every layout reduces to.

Padding lengths, packed segment ids and THD `cu_seqlens` all become, for each query token, a sequence id
(`0` = attends to nothing) and an *aligned* position, and for each key token a sequence id and a position. Query
`i` may see key `j` when both carry the same non-zero id and the positions satisfy the causal / window rule
(`masks.py`). Aligned positions already include the diagonal offset: with `diagonal_alignment="bottom_right"` a
query's position is shifted by `kv_len - q_len` of its own sequence, so the last query of a sequence lines up with
its last key.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import varying


class PackedTokens(NamedTuple):
    """Where each of `T` packed tokens lies in the ranges of `cu_seqlens` `[B + 1]`.

    Attributes:
        sequence: int32 `[T]`: the range holding the token (clipped to `[0, B - 1]` for tokens outside every range).
        offset: int32 `[T]`: the token's index in that range.
        inside: bool `[T]`: whether the token lies in a range (`cu[0] <= t < cu[-1]`).
    """

    sequence: jax.Array
    offset: jax.Array
    inside: jax.Array


def packed_tokens(cu_seqlens: jax.Array, num_tokens: int) -> PackedTokens:
    """The sequence, offset and membership of each packed token: an unrolled binary search of plain fused ops
    (`jnp.searchsorted`'s default `while` loop reads its condition back to the host at every step on a GPU)."""
    cu = cu_seqlens.astype(jnp.int32)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    found = jnp.searchsorted(cu, token, side="right", method="scan_unrolled").astype(jnp.int32) - 1
    sequence = jnp.clip(found, 0, cu.shape[0] - 2)
    return PackedTokens(sequence, token - cu[sequence], (token >= cu[0]) & (token < cu[-1]))


class TokenPositions(NamedTuple):
    """Sequence ids and positions of query and key tokens.

    Attributes:
        q_segment: int32 `[B, T]`, 0 = the query sees no key; None when every query and key belongs to one
            sequence per row (no padding, segments or THD).
        q_position: int32 `[B, T]`, position within its sequence plus the alignment offset.
        kv_segment: int32 `[B, S]`, 0 = no query sees the key; None exactly when `q_segment` is.
        kv_position: int32 `[B, S]`, position within its sequence.
    """

    q_segment: jax.Array | None
    q_position: jax.Array
    kv_segment: jax.Array | None
    kv_position: jax.Array

    def with_segments(self) -> "TokenPositions":
        """The same positions with explicit segment ids (all 1 when there was no sequence structure)."""
        if self.q_segment is not None:
            return self
        return self._replace(
            q_segment=jnp.ones(self.q_position.shape, jnp.int32),
            kv_segment=jnp.ones(self.kv_position.shape, jnp.int32),
        )


def _prefix_ids(lengths: jax.Array | None, batch: int, length: int) -> jax.Array:
    """`[B, L]` ids: 1 inside the valid prefix (all of it when `lengths` is None), else 0."""
    if lengths is None:
        return jnp.ones((batch, length), jnp.int32)
    index = jnp.arange(length, dtype=jnp.int32)[None, :]
    return (index < lengths.astype(jnp.int32)[:, None]).astype(jnp.int32)


def _run_starts(ids: jax.Array) -> jax.Array:
    """`[B, L]` bool: where a new contiguous run of equal ids begins."""
    first = jnp.ones_like(ids[:, :1], dtype=bool)
    return jnp.concatenate([first, ids[:, 1:] != ids[:, :-1]], axis=1)


def _positions_in_runs(ids: jax.Array) -> jax.Array:
    """`[B, L]` position of each token within its contiguous run of equal ids."""
    index = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    start = jax.lax.cummax(jnp.where(_run_starts(ids), index, 0), axis=1)
    return index - start


def _run_lengths(ids: jax.Array) -> jax.Array:
    """`[B, L]` length of the contiguous run each token belongs to."""
    run = jnp.cumsum(_run_starts(ids).astype(jnp.int32), axis=1) - 1
    count = jax.vmap(lambda r: jax.ops.segment_sum(jnp.ones_like(r), r, num_segments=ids.shape[1]))(run)
    return jnp.take_along_axis(count, run, axis=1)


def _count_matching(q_ids: jax.Array, kv_ids: jax.Array, chunk: int = 1024) -> jax.Array:
    """`[B, T]` number of key tokens whose id equals each query token's id, in memory linear in `S`."""
    B, S = kv_ids.shape
    num_chunks = -(-S // chunk)
    padded = jnp.pad(kv_ids, ((0, 0), (0, num_chunks * chunk - S)), constant_values=-1)

    def body(c, total):
        block = jax.lax.dynamic_slice_in_dim(padded, c * chunk, chunk, axis=1)
        return total + jnp.sum(q_ids[:, :, None] == block[:, None, :], axis=-1, dtype=jnp.int32)

    init = varying.like_inputs(jnp.zeros(q_ids.shape, jnp.int32), q_ids, kv_ids)
    return jax.lax.fori_loop(0, num_chunks, body, init)


def dense_positions(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    bottom_right: bool,
    query_seq_lengths: jax.Array | None,
    key_value_seq_lengths: jax.Array | None,
    q_segment_ids: jax.Array | None,
    kv_segment_ids: jax.Array | None,
) -> TokenPositions:
    """Positions for `[B, T]` / `[B, S]` rows with optional padding lengths and packed segments.

    Args:
        batch, q_len, kv_len: `B`, `T`, `S`.
        bottom_right: align each sequence's last query with its last key.
        query_seq_lengths, key_value_seq_lengths: int `[B]` valid prefix lengths, or None.
        q_segment_ids, kv_segment_ids: int `[B, T]` / `[B, S]` segment ids (0 = padding), or None.
    """
    q_ids = _prefix_ids(query_seq_lengths, batch, q_len)
    kv_ids = _prefix_ids(key_value_seq_lengths, batch, kv_len)
    if q_segment_ids is None:
        q_position = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
        kv_position = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
        if query_seq_lengths is None and key_value_seq_lengths is None:
            if bottom_right:
                q_position = q_position + (kv_len - q_len)
            return TokenPositions(None, q_position, None, kv_position)
        if bottom_right:
            q_count = jnp.sum(q_ids, axis=1, keepdims=True, dtype=jnp.int32)
            kv_count = jnp.sum(kv_ids, axis=1, keepdims=True, dtype=jnp.int32)
            q_position = q_position + (kv_count - q_count)
        return TokenPositions(q_ids, q_position, kv_ids, kv_position)

    q_seg = q_segment_ids.astype(jnp.int32) * q_ids
    kv_seg = kv_segment_ids.astype(jnp.int32) * kv_ids
    q_position = _positions_in_runs(q_seg)
    kv_position = _positions_in_runs(kv_seg)
    if bottom_right:
        q_position = q_position + _count_matching(q_seg, kv_seg) - _run_lengths(q_seg)
    return TokenPositions(q_seg, q_position, kv_seg, kv_position)


def _thd_ids_and_positions(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For packed tokens: 1-based sequence id (0 past `cu[-1]`), position in the sequence, sequence length."""
    cu = cu_seqlens.astype(jnp.int32)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, token, side="right").astype(jnp.int32)  # 1-based; len(cu) past the end
    inside = token < cu[-1]
    seq_index = jnp.clip(seq - 1, 0, cu.shape[0] - 2)
    position = token - cu[seq_index]
    length = cu[seq_index + 1] - cu[seq_index]
    return jnp.where(inside, seq, 0), position, length


def thd_positions(
    cu_seqlens_q: jax.Array, cu_seqlens_kv: jax.Array, q_tokens: int, kv_tokens: int, *, bottom_right: bool
) -> TokenPositions:
    """Positions for THD packed tokens as one row (`B = 1`): sequence `b` is rows `cu[b]:cu[b+1]`."""
    q_seg, q_position, q_length = _thd_ids_and_positions(cu_seqlens_q, q_tokens)
    kv_seg, kv_position, _ = _thd_ids_and_positions(cu_seqlens_kv, kv_tokens)
    if bottom_right:
        cu_kv = cu_seqlens_kv.astype(jnp.int32)
        seq_index = jnp.clip(q_seg - 1, 0, cu_kv.shape[0] - 2)
        kv_length = cu_kv[seq_index + 1] - cu_kv[seq_index]
        q_position = q_position + kv_length - q_length
    return TokenPositions(q_seg[None], q_position[None], kv_seg[None], kv_position[None])


def batch_index(positions: TokenPositions, batch: int, *, thd: bool) -> jax.Array:
    """int32 index of the sequence a query token belongs to: the `batch` argument of `score_mod` / `mask_mod`.

    Dense and paged rows: `[B, 1]`, the canonical (flattened `*B`) row. THD (one row of packed tokens): `[1, T]`,
    the 0-based sequence index of each query token (its sequence id - 1), 0 past `cu_seqlens_q[-1]`.
    """
    if thd:
        return jnp.maximum(positions.q_segment - 1, 0).astype(jnp.int32)
    return jnp.arange(batch, dtype=jnp.int32)[:, None]
