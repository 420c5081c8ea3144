"""Sequence metadata for cuDNN's ragged (THD) graphs, computed on device, and the bucketing of graph dims.

THD calls (`cu_seqlens_q`/`cu_seqlens_kv`) and packed rows (`q_segment_ids`/`kv_segment_ids` with
`max_segments_per_row`) both become one `RaggedBatch`: a list of sequences, each a run of query rows and a run of
key rows inside the packed token arrays, plus per-token tables that map results back. Everything here is plain JAX
on device (no host round trip) and runs the same on CPU, where it is tested against `positions.py`.

Graph dims are bucketed (`bucket_sequences`, `bucket_length`, `bucket_tokens`) so that a training loop whose lengths
change from step to step builds a handful of graphs, not one per batch: padding sequences have length 0.

Two rules keep results exact whatever cuDNN does with rows it does not own:
- *Virtual slicing*: with a bottom-right causal diagonal, the first `q_len - kv_len - right` query rows of a
  sequence see no key. They are dropped from the sequence given to cuDNN (its query start moves forward), which keeps
  every sequence at `q_len <= kv_len + right` as cuDNN requires; bottom-right alignment of the remaining rows is
  unchanged by dropping leading rows.
- *Overflow is NaN*: a sequence longer than the graph's bucketed bound (`max_seqlen_*`), or a packed row with more
  than `max_segments_per_row` segments, is not run (length 0) and its rows are NaN in the output and gradients.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def _sequence_of(cu: jax.Array, token: jax.Array) -> jax.Array:
    """The sequence (index into `cu_seqlens`) that holds each token: an unrolled binary search, plain fused ops.
    `jnp.searchsorted`'s default method is a `while` loop, and an XLA while loop on a GPU reads its condition back to
    the host at every step."""
    return jnp.searchsorted(cu, token, side="right", method="scan_unrolled").astype(jnp.int32) - 1


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def bucket_sequences(n: int) -> int:
    """The graph's batch dim for `n` sequences: at least 8, a power of two up to 512, then multiples of 512."""
    if n <= 512:
        return max(8, _next_pow2(n))
    return -(-n // 512) * 512


def bucket_length(n: int) -> int:
    """The graph's per-sequence length bound for a static bound `n`: a power of two, at least 64."""
    return max(64, _next_pow2(n))


def bucket_tokens(n: int) -> int:
    """Token capacity given to cuDNN's ragged backward: 1024 up to 1024, powers of two up to 32768, then multiples
    of 32768."""
    if n <= 1024:
        return 1024
    if n <= 32768:
        return _next_pow2(n)
    return -(-n // 32768) * 32768


class RaggedBatch(NamedTuple):
    """A ragged batch of `Bc` (bucketed) sequences over packed query tokens `[Tq]` and key tokens `[Tkv]`.

    Attributes:
        seq_q: int32 `[Bc]` query rows given to cuDNN per sequence (after virtual slicing; 0 = not run).
        seq_kv: int32 `[Bc]` key rows per sequence (0 = not run).
        off_q: int32 `[Bc + 1]` first packed query token of each sequence given to cuDNN; the last entry is the
            end of the packed data. Element offsets are these times heads times head dim.
        off_kv: int32 `[Bc + 1]` the same for keys/values.
        tok_seq: int32 `[Tq]` the sequence of each query token, -1 for none.
        tok_pos: int32 `[Tq]` the token's row within its sequence as given to cuDNN (negative for sliced rows).
        q_nan: bool `[Tq]` query tokens whose results are NaN (overflow).
        kv_in: bool `[Tkv]` key tokens of a sequence that runs with at least one query row (others get zero
            gradients; cuDNN's backward writes no rows of a sequence without query rows).
        kv_nan: bool `[Tkv]` key tokens whose gradients are NaN (overflow).
    """

    seq_q: jax.Array
    seq_kv: jax.Array
    off_q: jax.Array
    off_kv: jax.Array
    tok_seq: jax.Array
    tok_pos: jax.Array
    q_nan: jax.Array
    kv_in: jax.Array
    kv_nan: jax.Array


def _pad(x: jax.Array, size: int, value) -> jax.Array:
    return jnp.concatenate([x, jnp.full((size - x.shape[0],), value, x.dtype)])


def _slice_and_bound(q_len, kv_len, *, slice_right: int | None, t_bound: int, s_bound: int):
    """(rows skipped at each sequence's start, query rows, key rows, overflowing) of each sequence."""
    q_len = jnp.maximum(q_len, 0)
    kv_len = jnp.maximum(kv_len, 0)
    skip = jnp.zeros_like(q_len) if slice_right is None else jnp.clip(q_len - kv_len - slice_right, 0, q_len)
    rows = q_len - skip
    bad = (rows > t_bound) | (kv_len > s_bound)
    return skip, jnp.where(bad, 0, rows), jnp.where(bad, 0, kv_len), bad


def thd_batch(
    cu_seqlens_q: jax.Array,
    cu_seqlens_kv: jax.Array,
    q_tokens: int,
    kv_tokens: int,
    *,
    num_buckets: int,
    t_bound: int,
    s_bound: int,
    slice_right: int | None,
) -> RaggedBatch:
    """The ragged batch of a THD call.

    Args:
        cu_seqlens_q, cu_seqlens_kv: int `[B + 1]`.
        q_tokens, kv_tokens: `Tq`, `Tkv` (rows of the packed arrays).
        num_buckets: `Bc >= B`, the graph's batch dim.
        t_bound, s_bound: the graph's per-sequence length bounds.
        slice_right: with a bottom-right diagonal, the effective right bound (queries past it see no key and are
            sliced off); None for no slicing.
    """
    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_kv = cu_seqlens_kv.astype(jnp.int32)
    n = cu_q.shape[0] - 1
    skip, rows, kv_rows, bad = _slice_and_bound(
        cu_q[1:] - cu_q[:-1], cu_kv[1:] - cu_kv[:-1], slice_right=slice_right, t_bound=t_bound, s_bound=s_bound
    )
    end_q = jnp.maximum(cu_q[-1], 0)
    end_kv = jnp.maximum(cu_kv[-1], 0)
    off_q = jnp.clip(cu_q[:-1] + skip, 0, end_q)
    off_kv = jnp.clip(cu_kv[:-1], 0, end_kv)

    token = jnp.arange(q_tokens, dtype=jnp.int32)
    seq = _sequence_of(cu_q, token)
    inside = (seq >= 0) & (seq < n) & (token < cu_q[-1])
    safe = jnp.clip(seq, 0, max(n - 1, 0))
    tok_seq = jnp.where(inside, seq, -1)
    tok_pos = token - cu_q[safe] - skip[safe] if n else jnp.zeros_like(token)
    q_nan = inside & bad[safe] if n else jnp.zeros_like(inside)

    kv_token = jnp.arange(kv_tokens, dtype=jnp.int32)
    kv_seq = _sequence_of(cu_kv, kv_token)
    kv_inside = (kv_seq >= 0) & (kv_seq < n) & (kv_token < cu_kv[-1])
    kv_safe = jnp.clip(kv_seq, 0, max(n - 1, 0))
    kv_nan = kv_inside & bad[kv_safe] if n else jnp.zeros_like(kv_inside)
    kv_seen = kv_inside & (rows[kv_safe] > 0) if n else jnp.zeros_like(kv_inside)  # of a sequence with query rows
    return RaggedBatch(
        seq_q=_pad(rows, num_buckets, 0),
        seq_kv=_pad(kv_rows, num_buckets, 0),
        off_q=_pad(off_q, num_buckets + 1, end_q),
        off_kv=_pad(off_kv, num_buckets + 1, end_kv),
        tok_seq=tok_seq,
        tok_pos=tok_pos,
        q_nan=q_nan,
        kv_in=kv_seen & ~kv_nan,
        kv_nan=kv_nan,
    )


class _Runs(NamedTuple):
    start: jax.Array  # int32 [B, M] first token of run m (L when absent)
    length: jax.Array  # int32 [B, M]
    ident: jax.Array  # int32 [B, M] the run's segment id (0 when absent)
    index: jax.Array  # int32 [B, L] run index of each token (-1 for id 0)
    count: jax.Array  # int32 [B] runs in the row


def _run_starts(ids: jax.Array) -> jax.Array:
    """bool `[B, L]`: the tokens that start a run of equal non-zero ids."""
    position = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    previous = jnp.concatenate([jnp.zeros((ids.shape[0], 1), ids.dtype), ids[:, :-1]], axis=1)
    return (ids != 0) & ((position == 0) | (ids != previous))


def runs_per_row(ids: jax.Array) -> jax.Array:
    """int32 `[B]`: the number of contiguous runs of non-zero ids in each row of `[B, L]` ids."""
    return jnp.sum(_run_starts(ids), axis=1, dtype=jnp.int32)  # int32 under `jax_enable_x64` too


def _runs(ids: jax.Array, max_runs: int) -> _Runs:
    """The first `max_runs` contiguous runs of non-zero ids of each row."""
    B, L = ids.shape
    position = jnp.arange(L, dtype=jnp.int32)[None, :]
    starts = _run_starts(ids)
    index = jnp.where(ids != 0, jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1, -1)
    count = jnp.sum(starts, axis=1, dtype=jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, L))
    slot = jnp.where((index >= 0) & (index < max_runs), index, max_runs)  # max_runs: dropped
    start = jnp.full((B, max_runs), L, jnp.int32).at[rows, slot].min(jnp.broadcast_to(position, (B, L)), mode="drop")
    length = jnp.zeros((B, max_runs), jnp.int32).at[rows, slot].add(1, mode="drop")
    ident = jnp.take_along_axis(ids, jnp.clip(start, 0, L - 1), axis=1)
    ident = jnp.where(length > 0, ident, 0)
    return _Runs(start, length, ident, index, count)


def segment_batch(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    max_segments: int,
    num_buckets: int,
    t_bound: int,
    s_bound: int,
    slice_right: int | None,
) -> RaggedBatch:
    """The ragged batch of packed rows: segment `m` of row `r` is sequence `r * max_segments + m`.

    The query tokens are row `r`'s contiguous runs of non-zero ids in order; each is paired with the key run of the
    same id in the same row (length 0 when there is none). Packed tokens are `[B * T]` / `[B * S]` row-major.

    Args:
        q_segment_ids: int `[B, T]` (0 = padding; already combined with any padding lengths).
        kv_segment_ids: int `[B, S]`.
        max_segments: the static bound on runs per row; a row with more (query or key side) is not run and its
            tokens are NaN.
        num_buckets: `Bc >= B * max_segments`.
        t_bound, s_bound, slice_right: as in `thd_batch`.
    """
    q_ids = q_segment_ids.astype(jnp.int32)
    kv_ids = kv_segment_ids.astype(jnp.int32)
    B, T = q_ids.shape
    S = kv_ids.shape[1]
    M = max_segments
    q_runs = _runs(q_ids, M)
    kv_runs = _runs(kv_ids, M)
    overflow = (q_runs.count > M) | (kv_runs.count > M)  # [B]

    match = (q_runs.ident[:, :, None] == kv_runs.ident[:, None, :]) & (q_runs.ident[:, :, None] != 0)  # [B, M, M]
    found = jnp.any(match, axis=2)
    which = jnp.argmax(match, axis=2).astype(jnp.int32)
    kv_start = jnp.where(found, jnp.take_along_axis(kv_runs.start, which, axis=1), S)
    kv_len = jnp.where(found, jnp.take_along_axis(kv_runs.length, which, axis=1), 0)
    q_len = jnp.where(overflow[:, None], 0, q_runs.length)
    kv_len = jnp.where(overflow[:, None], 0, kv_len)

    skip, rows, kv_rows, bad = _slice_and_bound(
        q_len, kv_len, slice_right=slice_right, t_bound=t_bound, s_bound=s_bound
    )
    row = jnp.arange(B, dtype=jnp.int32)[:, None]
    off_q = jnp.reshape(row * T + jnp.minimum(q_runs.start + skip, T), (-1,))
    off_kv = jnp.reshape(row * S + jnp.minimum(kv_start, S), (-1,))

    # Query tokens.
    in_run = (q_runs.index >= 0) & (q_runs.index < M)
    run = jnp.clip(q_runs.index, 0, M - 1)
    start = jnp.take_along_axis(q_runs.start, run, axis=1)
    skipped = jnp.take_along_axis(skip, run, axis=1)
    seq_bad = jnp.take_along_axis(bad, run, axis=1)
    tok_seq = jnp.where(in_run & ~overflow[:, None], row * M + run, -1)
    tok_pos = jnp.arange(T, dtype=jnp.int32)[None, :] - start - skipped
    q_nan = jnp.broadcast_to(overflow[:, None], (B, T)) | (in_run & seq_bad)

    # Key tokens: inside a key run that some query run uses.
    used = jnp.zeros((B, M), bool).at[
        jnp.broadcast_to(row, (B, M)), jnp.where(found & (kv_len > 0), which, M)
    ].set(True, mode="drop")
    kv_run = jnp.clip(kv_runs.index, 0, M - 1)
    kv_in = (kv_runs.index >= 0) & (kv_runs.index < M) & jnp.take_along_axis(used, kv_run, axis=1)
    kv_nan = jnp.broadcast_to(overflow[:, None], (B, S))
    return RaggedBatch(
        seq_q=_pad(jnp.reshape(rows, (-1,)), num_buckets, 0),
        seq_kv=_pad(jnp.reshape(kv_rows, (-1,)), num_buckets, 0),
        off_q=_pad(off_q, num_buckets + 1, B * T),
        off_kv=_pad(off_kv, num_buckets + 1, B * S),
        tok_seq=jnp.reshape(tok_seq, (-1,)),
        tok_pos=jnp.reshape(tok_pos, (-1,)),
        q_nan=jnp.reshape(q_nan, (-1,)),
        kv_in=jnp.reshape(kv_in & ~kv_nan, (-1,)),
        kv_nan=jnp.reshape(kv_nan, (-1,)),
    )


def element_offsets(token_offsets: jax.Array, heads: int, dim: int) -> jax.Array:
    """int32 `[n, 2]`: the INT64 element offsets `token * heads * dim` as little-endian (low, high) int32 pairs.

    The policy keeps every offset below 2**31, so the high word is 0.
    """
    low = token_offsets.astype(jnp.int32) * (heads * dim)
    return jnp.stack([low, jnp.zeros_like(low)], axis=1)


def rows_seeing_keys(seq_q: jax.Array, seq_kv: jax.Array, left: int | None) -> jax.Array:
    """Per sequence, the leading query rows that see a key under a top-left diagonal (whatever the right bound):
    none without keys, else the rows below `seq_kv + left` (row `i` sees keys from `i - left`)."""
    seeing = seq_q if left is None else jnp.minimum(seq_q, seq_kv + left)
    return jnp.where(seq_kv > 0, seeing, 0)
