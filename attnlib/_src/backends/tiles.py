"""Tiles of the plain-JAX key-block loops (`xla_chunked`): which (query block, key block) tiles a static band
touches, and the helpers that pad, slice and accumulate the rows and keys of a canonical problem tile by tile."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import canonical, explicit_axes
from ..band import Band
from ..positions import TokenPositions


def pad_keys(problem: canonical.Problem, padded_len: int) -> canonical.Problem:
    """Pad the key axis to `padded_len`; padded keys belong to no sequence, so nothing sees them."""
    S = problem.key.shape[1]
    extra = padded_len - S
    if extra == 0:
        return problem
    pad_tokens = lambda x, value=0: jnp.pad(
        x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2), constant_values=value
    )
    pad_last = lambda x, value: x if x is None or x.shape[-1] == 1 else jnp.pad(
        x, [(0, 0)] * 3 + [(0, extra)], constant_values=value
    )
    p = problem.positions.with_segments()
    positions = TokenPositions(p.q_segment, p.q_position, pad_tokens(p.kv_segment), pad_tokens(p.kv_position))
    return problem._replace(
        key=pad_tokens(problem.key),
        value=pad_tokens(problem.value),
        bias=pad_last(problem.bias, 0),
        mask=pad_last(problem.mask, False),
        positions=positions,
        score_mod_args=tuple(pad_last(a, False if a.dtype == jnp.bool_ else 0) for a in problem.score_mod_args),
    )


def slice_keys(x: jax.Array | None, start: jax.Array, size: int) -> jax.Array | None:
    """Keys `start : start + size` of a rank-4 bias/mask (unchanged when broadcast along keys)."""
    if x is None or x.shape[-1] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=3)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The (query block, key block) tiles the key-block loops visit.

    Without a static band every key block is visited against all query rows at once (`pairs` None). Under one
    (`Band.on_indices`) the queries are cut into blocks too and only the tiles the band touches are visited, grouped
    by query block with ascending keys (the order of the online softmax), so a fully-masked tile costs nothing and
    every loop keeps a static trip count (work linear in the visible band, memory linear in `T` and `S`).

    Attributes:
        block_q: query rows per tile (all the rows when `pairs` is None).
        block_k: keys per tile.
        num_q_blocks: query blocks of the padded rows (`num_q_blocks * block_q` rows).
        num_k_blocks: key blocks of the padded keys.
        pairs: the visited `(query block, key block)` indices, or None for every key block with all rows.
    """

    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    pairs: tuple[tuple[int, int], ...] | None = None

    @property
    def num_steps(self) -> int:
        return self.num_k_blocks if self.pairs is None else len(self.pairs)

    def starts(self, step):
        """`(first query row, first key)` of tile `step` (the row is the int 0 without `pairs`)."""
        if self.pairs is None:
            return 0, step * self.block_k
        blocks = np.reshape(np.asarray(self.pairs, np.int32), (-1, 2))
        table = jnp.asarray(blocks * np.asarray([self.block_q, self.block_k], np.int32))
        return table[step, 0], table[step, 1]


def plan_tiles(band: Band | None, q_len: int, kv_len: int, block_k: int) -> Tiles:
    """The tiles of a `q_len x kv_len` call with key blocks of `block_k` (`block_k <= kv_len`): under `band` (on the
    canonical indices, `Band.on_indices`) query blocks of about `block_k` rows, each against the key blocks its rows
    can see; every key block with all rows when there is no band or it hides no tile."""
    num_k = max(1, -(-kv_len // block_k))
    whole = Tiles(q_len, block_k, 1, num_k)
    if band is None or num_k == 1 or q_len == 0:
        return whole
    num_q = -(-q_len // block_k)
    block_q = -(-q_len // num_q)  # as even as possible: fewer than num_q padded rows ...
    if num_q > 1:
        block_q = -(-block_q // 8) * 8  # ... rounded to a multiple of 8 rows
    num_q = -(-q_len // block_q)
    pairs = []
    for a in range(num_q):
        first, last = a * block_q, min(q_len, (a + 1) * block_q) - 1
        lo = 0 if band.left is None else max(0, int(band.diagonal(first, q_len, kv_len)) - band.left)
        hi = kv_len - 1 if band.right is None else min(kv_len - 1, int(band.diagonal(last, q_len, kv_len)) + band.right)
        if lo <= hi:
            pairs += [(a, c) for c in range(lo // block_k, hi // block_k + 1)]
    if len(pairs) >= num_q * num_k:
        return whole
    return Tiles(block_q, block_k, num_q, num_k, tuple(pairs))


def pad_queries(problem: canonical.Problem, padded_len: int) -> canonical.Problem:
    """Pad the query axis to `padded_len`; padded queries belong to no sequence, so they see nothing."""
    extra = padded_len - problem.query.shape[1]
    if extra == 0:
        return problem
    pad = lambda x, axis, value=0: jnp.pad(
        x, [(0, 0)] * axis + [(0, extra)] + [(0, 0)] * (x.ndim - axis - 1), constant_values=value
    )
    pad_rank4 = lambda x, value: x if x is None or x.shape[2] == 1 else pad(x, 2, value)
    p = problem.positions.with_segments()
    return problem._replace(
        query=pad(problem.query, 1),
        bias=pad_rank4(problem.bias, 0),
        mask=pad_rank4(problem.mask, False),
        positions=p._replace(q_segment=pad(p.q_segment, 1), q_position=pad(p.q_position, 1)),
        score_mod_args=tuple(pad_rank4(a, False if a.dtype == jnp.bool_ else 0) for a in problem.score_mod_args),
    )


def query_rows(problem: canonical.Problem, q_start, rows: int) -> canonical.Problem:
    """The problem restricted to query rows `q_start : q_start + rows` (the query, the query axis of bias, mask and
    `score_mod_args`, the query positions); unchanged when that is all of them."""
    if rows == problem.query.shape[1]:
        return problem
    cut = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, q_start, rows, axis=axis)
    cut_rank4 = lambda x: x if x is None or x.shape[2] == 1 else cut(x, 2)
    p = problem.positions
    return problem._replace(
        query=cut(problem.query, 1),
        bias=cut_rank4(problem.bias),
        mask=cut_rank4(problem.mask),
        positions=p._replace(
            q_segment=None if p.q_segment is None else cut(p.q_segment, 1), q_position=cut(p.q_position, 1)
        ),
        score_mod_args=tuple(cut_rank4(a) for a in problem.score_mod_args),
    )


def rows_of(x: jax.Array, q_start, rows: int, axis: int = 3) -> jax.Array:
    """Query rows `q_start : q_start + rows` of a per-row array (`[B, K, G, T, ...]`: axis 3)."""
    return x if x.shape[axis] == rows else jax.lax.dynamic_slice_in_dim(x, q_start, rows, axis=axis)


def set_rows(x: jax.Array, rows: jax.Array, q_start, axis: int = 3) -> jax.Array:
    """`x` with its rows from `q_start` replaced by `rows` (typed like `rows` under explicit axes)."""
    if rows.shape == x.shape:
        return rows
    return jax.lax.dynamic_update_slice_in_dim(explicit_axes.like(x, rows), rows, q_start, axis=axis)


def add_at(acc: jax.Array, x: jax.Array, starts, *, overwrite: bool = False) -> jax.Array:
    """`acc` with `x` added at `starts`, or written there when `overwrite` (no other tile touches that part); typed
    like `x` under explicit axes."""
    if x.shape == acc.shape:
        return x if overwrite else acc + x
    acc = explicit_axes.like(acc, x)
    starts = tuple(jnp.asarray(i, jnp.int32) for i in starts)  # one index type (Python ints are int64 under x64)
    if not overwrite:
        x = jax.lax.dynamic_slice(acc, starts, x.shape) + x
    return jax.lax.dynamic_update_slice(acc, x, starts)
