"""Block sparsity: which (query block, key block) tiles the flex kernels visit, as scalar-prefetched lists.

A tile whose every (query, key) pair is hidden is neither loaded nor computed. For each query block the kernels
get the ordered list of the key blocks to visit and its length (`kv_list`, `kv_count`; for the dK/dV kernel the
transpose, `q_list`, `q_count`): the grid's inner axis walks the list, and past its end the index map repeats the
last entry (Pallas skips the copy of a block whose index did not change) while the body does nothing. A third list
(`kv_full`, `q_full`) marks the tiles whose every pair is visible: the kernels compute those without any mask (no
segment, band, mask-array or `mask_mod` evaluation), as splash does its unmasked blocks.

- Where the masks depend on the indices alone (no padding lengths, segments, THD or mask arrays: causal, windows,
  the padded tail, a `mask_mod` without arguments or traced constants), the map is computed at trace time in NumPy
  (`static_tiles`) and the grid's inner axis shrinks to the longest list.
- Where they read runtime data (segment ids, lengths, `cu_seqlens`, a boolean `mask`), the map is reduced on the
  device (`runtime_tiles`): per block the range of segment ids and of aligned positions (a tile is kept when the
  ranges can meet: conservative, never wrong), `any` of the mask over the tile, and `any` of the `mask_mod` over the
  tile (`mask_mod_tiles`: evaluated by XLA on the positions and `score_mod_args`, fused into the reduction). The
  grid keeps every key block; skipped steps cost a grid step but no copy and no compute.
"""

import functools
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from ... import placement
from . import elementwise
from .plan import Plan


MAX_STATIC_MASK_MOD_ELEMENTS = 2**30
"""A `mask_mod` is evaluated on the host over at most this many (batch, head, query, key) elements for the static
map (`CHUNK_ELEMENTS` at a time); a larger one is applied in the kernel only (its tiles are computed)."""

CHUNK_ELEMENTS = 2**22
"""Host evaluations of a `mask_mod` per step: bounded memory (a few arrays of this many elements)."""

_BIG = 2**29
"""Sentinel of an empty block's ranges: differences of two stay inside int32."""


class BlockMap(NamedTuple):
    """int32 lists `kv_list [Bm, nq * width_k]`, `kv_count [Bm, nq]`, `kv_full [Bm, nq * width_k]` (1: the entry's
    tile is wholly visible), `q_list [Bm, nk * width_q]`, `q_count [Bm, nk]`, `q_full [Bm, nk * width_q]` (`Bm` = B
    when `per_batch`, else 1; each kernel call flattens its shard's lists for SMEM). `any_full` / `any_partial`:
    whether some visited tile is wholly visible / partly hidden (static maps; both True for runtime ones), so the
    kernels are traced with the tile kinds they meet; `every_tile`: a static map that visits every tile."""

    kv_list: jax.Array | np.ndarray
    kv_count: jax.Array | np.ndarray
    kv_full: jax.Array | np.ndarray
    q_list: jax.Array | np.ndarray
    q_count: jax.Array | np.ndarray
    q_full: jax.Array | np.ndarray
    per_batch: bool
    width_k: int
    width_q: int
    any_full: bool = True
    any_partial: bool = True
    every_tile: bool = False


class Tiles(NamedTuple):
    """bool `[Bm, nq, nk]` maps: `visits` (some pair visible) and `full` (every pair visible; within `visits`, as
    `static_tiles` and `runtime_tiles` make it and `&` keeps it)."""

    visits: jax.Array | np.ndarray
    full: jax.Array | np.ndarray

    def __and__(self, other: "Tiles") -> "Tiles":
        return Tiles(self.visits & other.visits, self.full & other.full)


def _lists(tiles: Tiles, width: int, xp):
    """`(list, count, full)` of `tiles [Bm, n, m]`: the visited indices in order, padded with the last one, and
    whether each entry's tile is wholly visible (0 past the end)."""
    visits = tiles.visits
    order = xp.argsort(~visits, axis=-1, stable=True).astype(np.int32)
    count = xp.sum(visits, axis=-1).astype(np.int32)
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    j = xp.arange(width, dtype=np.int32)
    inside = j < count[..., None]
    chosen = xp.where(inside, order[..., :width], last)
    full = xp.take_along_axis(tiles.full, chosen, axis=-1) & inside
    Bm = visits.shape[0]
    flat = lambda x: x.reshape(Bm, -1).astype(np.int32)
    return flat(chosen), flat(count), flat(full)


def from_tiles(tiles: Tiles, *, per_batch: bool, static: bool) -> BlockMap:
    """The lists of `tiles` (NumPy when `static`: the grid then shrinks to the longest list)."""
    xp = np if static else jnp
    visits = tiles.visits
    nq, nk = visits.shape[1:]
    width_k = max(1, int(visits.sum(-1).max())) if static else nk
    width_q = max(1, int(visits.sum(-2).max())) if static else nq
    kv_list, kv_count, kv_full = _lists(tiles, width_k, xp)
    q_list, q_count, q_full = _lists(Tiles(*(xp.swapaxes(x, 1, 2) for x in tiles)), width_q, xp)
    any_full = bool(tiles.full.any()) if static else True
    any_partial = bool((visits & ~tiles.full).any()) if static else True
    every_tile = bool(visits.all()) if static else False
    return BlockMap(kv_list, kv_count, kv_full, q_list, q_count, q_full, per_batch, width_k, width_q, any_full,
                    any_partial, every_tile)  # fmt: skip


def static_tiles(plan: Plan, offset: int, mask_mod_tiles_: Tiles | None) -> Tiles:
    """`[1, nq, nk]` on the host. Visited: tiles holding a real query row `i < T` and key `j < S` with
    `j - (i + offset)` in the band (per tile, from the range of `j - i`: its rows and keys are contiguous) and, with
    `mask_mod_tiles_ [nq, nk]` (`static_mask_mod`), the `mask_mod` true somewhere in the tile. Full: no padded row or
    key, the whole range inside the band, the `mask_mod` true everywhere (none where the plan's `mask_mod` was not
    evaluated here: the kernel then applies it on every tile)."""
    i0 = np.arange(plan.nq)[:, None] * plan.block_q
    i1 = np.minimum(i0 + plan.block_q, plan.T) - 1
    j0 = np.arange(plan.nk)[None, :] * plan.block_k
    j1 = np.minimum(j0 + plan.block_k, plan.S) - 1
    visible = (i0 <= i1) & (j0 <= j1)
    full = (i0 + plan.block_q <= plan.T) & (j0 + plan.block_k <= plan.S)
    if plan.band is not None:
        some, every = _band_tiles(plan.band, j0 - i1 - offset, j1 - i0 - offset)  # its offsets `j - (i + offset)`
        visible, full = visible & some, full & every
    if mask_mod_tiles_ is not None:
        visible, full = visible & mask_mod_tiles_.visits, full & mask_mod_tiles_.full
    elif plan.mask_mod is not None:
        full = np.zeros_like(full)
    return Tiles(visible[None], (full & visible)[None])


def _band_tiles(band: tuple[int | None, int | None], lo, hi):
    """`(some, every)` for tiles whose offsets (key position minus query position) span `[lo, hi]` (NumPy or JAX
    arrays): whether some offset lies in the band `[-left, right]` (the two ranges meet) and whether all do."""
    left, right = band
    some, every = lo <= hi, None
    if left is not None:
        some, every = some & (hi >= -left), lo >= -left
    if right is not None:
        some = some & (lo <= right)
        every = hi <= right if every is None else every & (hi <= right)
    if left is not None and right is not None and -left > right:  # an empty band
        some = some & False
    return some, every


@functools.lru_cache(maxsize=64)
def static_mask_mod(modifiers, B: int, N: int, T: int, S: int, offset: int, block_q: int, block_k: int):
    """`Tiles` `[nq, nk]` of `block_q` queries by `block_k` keys: where `mask_mod` (no arguments, concrete constants)
    lets some (batch, head) see a pair, on positions `i + offset`, `j`, and where it lets every (batch, head) see every
    real pair; evaluated on the host a band of query blocks at a time (`CHUNK_ELEMENTS`); None when that takes more
    than `MAX_STATIC_MASK_MOD_ELEMENTS`."""
    closed = modifiers.mask_jaxpr
    nb = B if elementwise.reads(closed, 0) else 1
    nh = N if elementwise.reads(closed, 1) else 1
    if nb * nh * T * S > MAX_STATIC_MASK_MOD_ELEMENTS:
        return None
    fn = jnp.vectorize(lambda *x: jex.jaxpr_as_fun(closed)(*x)[0])
    nq, nk = -(-T // block_q), -(-S // block_k)
    Sp = nk * block_k
    rows = max(1, CHUNK_ELEMENTS // (nb * nh * Sp * block_q)) * block_q  # query rows per step, whole blocks
    b = np.arange(nb, dtype=np.int32)[:, None, None, None]
    h = np.arange(nh, dtype=np.int32)[None, :, None, None]
    k = np.arange(Sp, dtype=np.int32)[None, None, None, :]
    def evaluate() -> Tiles:
        some, every = [], []
        with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
            for start in range(0, nq * block_q, rows):
                i = np.arange(start, start + rows, dtype=np.int32)
                q = (i + offset)[None, None, :, None]
                keep = np.asarray(fn(b, h, q, k)).astype(bool)
                real = (i[:, None] < T) & (k[0, 0] < S)
                by_tile = lambda x, reduce: reduce(x.reshape(rows // block_q, block_q, nk, block_k), axis=(1, 3))
                some.append(by_tile(keep.any(axis=(0, 1)) & real, np.any))
                every.append(by_tile(keep.all(axis=(0, 1)) | ~real, np.all))
        return Tiles(np.concatenate(some)[:nq], np.concatenate(every)[:nq])

    return placement.built_on_host(evaluate)


def _block_range(values, valid, block: int):
    """`(min, max)` per block of `values [B, L]` over its `valid` entries (`_BIG`, `-_BIG` for an empty block)."""
    B, L = values.shape
    v = values.reshape(B, L // block, block)
    ok = valid.reshape(B, L // block, block)
    return jnp.min(jnp.where(ok, v, _BIG), axis=-1), jnp.max(jnp.where(ok, v, -_BIG), axis=-1)


def runtime_tiles(plan: Plan, q_seg, q_pos, kv_seg, kv_pos, mask) -> Tiles:
    """`[B, nq, nk]` on the device from the padded per-token segment ids / positions (`[B, T']`, `[B, S']`)
    and the grouped mask (`[B|1, K|1, G|1, T'|1, S'|1]` int8, or None). Full: one segment id on both sides and no
    padding, the whole range of offsets inside the band, the mask true everywhere."""
    bq, bk = plan.block_q, plan.block_k
    q_ok, kv_ok = q_seg != 0, kv_seg != 0
    q_lo, q_hi = _block_range(q_seg, q_ok, bq)
    k_lo, k_hi = _block_range(kv_seg, kv_ok, bk)
    visits = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    whole = lambda ok, block: ok.reshape(ok.shape[0], -1, block).all(axis=-1)
    one_q = whole(q_ok, bq) & (q_lo == q_hi)
    one_k = whole(kv_ok, bk) & (k_lo == k_hi)
    full = one_q[:, :, None] & one_k[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
    if plan.band is not None:
        qp_lo, qp_hi = _block_range(q_pos, q_ok, bq)
        kp_lo, kp_hi = _block_range(kv_pos, kv_ok, bk)
        lo = kp_lo[:, None, :] - qp_hi[:, :, None]  # a range holding every offset `kv_pos - q_pos` of the tile
        hi = kp_hi[:, None, :] - qp_lo[:, :, None]
        some, every = _band_tiles(plan.band, lo, hi)
        visits, full = visits & some, full & every
    if mask is not None:
        b, k, g, t, s = mask.shape
        tq, tk = (plan.nq, bq) if t != 1 else (1, 1), (plan.nk, bk) if s != 1 else (1, 1)
        by_tile = jnp.reshape(mask != 0, (b, k, g, *tq, *tk))
        visits = visits & by_tile.any(axis=(1, 2, 4, 6))
        full = full & by_tile.all(axis=(1, 2, 4, 6))
    return Tiles(visits, full & visits)


def mask_mod_tiles(plan: Plan, q_seg, q_pos, kv_pos, args) -> Tiles:
    """`[B, nq, nk]`: tiles where the `mask_mod` lets some (head, query, key) through, and every one, evaluated on
    the device on the padded positions (`[B, T']`, `[B, S']`) and grouped `score_mod_args`
    (`[B|1, K|1, G|1, T'|1, S'|1]`; padded pairs are never in a full tile: `runtime_tiles`)."""
    closed = plan.mask_mod
    heads = plan.K * plan.G
    per_head = elementwise.reads(closed, 1) or any(spec.has_heads for spec in plan.args)
    nh = heads if per_head else 1
    shape = (plan.B, nh, plan.Tp, plan.Sp)
    if plan.thd:
        batch = jnp.maximum(q_seg - 1, 0)[:, None, :, None]
    else:
        batch = jnp.arange(plan.B, dtype=jnp.int32)[:, None, None, None]
    head = jnp.arange(nh, dtype=jnp.int32)[None, :, None, None]
    q_idx, kv_idx = q_pos[:, None, :, None], kv_pos[:, None, None, :]
    flat = []
    for a, spec, dtype in zip(args, plan.args, plan.modifiers.arg_dtypes, strict=True):
        b, k, g, t, s = a.shape
        flat.append(jnp.reshape(a, (b, k * g, t, s)).astype(dtype))
    visible = elementwise.evaluate(closed, closed.consts, (batch, head, q_idx, kv_idx, *flat), shape).astype(bool)
    tiles = jnp.reshape(visible, (plan.B, nh, plan.nq, plan.block_q, plan.nk, plan.block_k))
    return Tiles(tiles.any(axis=(1, 3, 5)), tiles.all(axis=(1, 3, 5)))
