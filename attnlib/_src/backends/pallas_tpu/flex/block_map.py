"""Block sparsity: which (query block, key block) tiles the flex kernels visit, as scalar-prefetched lists.

A tile whose every (query, key) pair is hidden is neither loaded nor computed. For each query block the kernels
get the ordered list of the key blocks to visit and its length (`kv_list`, `kv_count`; for the dK/dV kernel the
transpose, `q_list`, `q_count`): the grid's inner axis walks the list, and past its end the index map repeats the
last entry (Pallas skips the copy of a block whose index did not change) while the body does nothing.

- Where the masks depend on the indices alone (no padding lengths, segments, THD or mask arrays: causal, windows,
  the padded tail, a `mask_mod` without arguments or traced constants), the map is computed at trace time in NumPy
  (`static_visits`) and the grid's inner axis shrinks to the longest list.
- Where they read runtime data (segment ids, lengths, `cu_seqlens`, a boolean `mask`), the map is reduced on the
  device (`runtime_visits`): per block the range of segment ids and of aligned positions (a tile is kept when the
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
    """int32 lists `kv_list [Bm, nq * width_k]`, `kv_count [Bm, nq]`, `q_list [Bm, nk * width_q]`,
    `q_count [Bm, nk]` (`Bm` = B when `per_batch`, else 1; each kernel call flattens its shard's lists for SMEM)."""

    kv_list: jax.Array | np.ndarray
    kv_count: jax.Array | np.ndarray
    q_list: jax.Array | np.ndarray
    q_count: jax.Array | np.ndarray
    per_batch: bool
    width_k: int
    width_q: int


def _lists(visits, width: int, xp):
    """`(list, count)` of `visits [Bm, n, m]`: the visited indices in order, padded with the last one."""
    order = xp.argsort(~visits, axis=-1, stable=True).astype(np.int32)
    count = xp.sum(visits, axis=-1).astype(np.int32)
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    j = xp.arange(width, dtype=np.int32)
    chosen = xp.where(j < count[..., None], order[..., :width], last)
    Bm = visits.shape[0]
    return chosen.reshape(Bm, -1).astype(np.int32), count.reshape(Bm, -1).astype(np.int32)


def from_visits(visits, *, per_batch: bool, static: bool) -> BlockMap:
    """The lists of a bool visit map `[Bm, nq, nk]` (NumPy when `static`: the grid then shrinks to the longest)."""
    xp = np if static else jnp
    nq, nk = visits.shape[1:]
    width_k = max(1, int(visits.sum(-1).max())) if static else nk
    width_q = max(1, int(visits.sum(-2).max())) if static else nq
    kv_list, kv_count = _lists(visits, width_k, xp)
    q_list, q_count = _lists(xp.swapaxes(visits, 1, 2), width_q, xp)
    return BlockMap(kv_list, kv_count, q_list, q_count, per_batch, width_k, width_q)


def static_visits(plan: Plan, offset: int, mask_mod_tiles_: np.ndarray | None) -> np.ndarray:
    """bool `[1, nq, nk]` on the host: tiles holding a real query row `i < T` and key `j < S` with `j - (i + offset)`
    in the band (per tile, from the range of `j - i`: its rows and keys are contiguous) and, with
    `mask_mod_tiles_ [nq, nk]` (`static_mask_mod`), the `mask_mod` true somewhere in the tile."""
    i0 = np.arange(plan.nq)[:, None] * plan.block_q
    i1 = np.minimum(i0 + plan.block_q, plan.T) - 1
    j0 = np.arange(plan.nk)[None, :] * plan.block_k
    j1 = np.minimum(j0 + plan.block_k, plan.S) - 1
    visible = (i0 <= i1) & (j0 <= j1)
    if plan.band is not None:
        left, right = plan.band
        lo, hi = j0 - i1 - offset, j1 - i0 - offset  # the offsets `j - (i + offset)` the tile holds
        if left is not None:
            lo = np.maximum(lo, -left)
        if right is not None:
            hi = np.minimum(hi, right)
        visible = visible & (lo <= hi)
    if mask_mod_tiles_ is not None:
        visible = visible & mask_mod_tiles_
    return visible[None]


@functools.lru_cache(maxsize=64)
def static_mask_mod(modifiers, B: int, N: int, T: int, S: int, offset: int, block_q: int, block_k: int):
    """bool `[nq, nk]`: the tiles of `block_q` queries by `block_k` keys where `mask_mod` (no arguments, concrete
    constants) lets some (batch, head) see a pair, on positions `i + offset`, `j`; evaluated on the host a band of
    query blocks at a time (`CHUNK_ELEMENTS`); None when that takes more than `MAX_STATIC_MASK_MOD_ELEMENTS`."""
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
    tiles = []
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        for start in range(0, nq * block_q, rows):
            i = np.arange(start, start + rows, dtype=np.int32)
            q = (i + offset)[None, None, :, None]
            seen = np.asarray(fn(b, h, q, k)).any(axis=(0, 1)) & (i[:, None] < T) & (k[0, 0] < S)
            tiles.append(seen.reshape(rows // block_q, block_q, nk, block_k).any(axis=(1, 3)))
    return np.concatenate(tiles)[:nq]


def _block_range(values, valid, block: int):
    """`(min, max)` per block of `values [B, L]` over its `valid` entries (`_BIG`, `-_BIG` for an empty block)."""
    B, L = values.shape
    v = values.reshape(B, L // block, block)
    ok = valid.reshape(B, L // block, block)
    return jnp.min(jnp.where(ok, v, _BIG), axis=-1), jnp.max(jnp.where(ok, v, -_BIG), axis=-1)


def runtime_visits(plan: Plan, q_seg, q_pos, kv_seg, kv_pos, mask) -> jax.Array:
    """bool `[B, nq, nk]` on the device from the padded per-token segment ids / positions (`[B, T']`, `[B, S']`)
    and the grouped mask (`[B|1, K|1, G|1, T'|1, S'|1]` int8, or None)."""
    bq, bk = plan.block_q, plan.block_k
    q_ok, kv_ok = q_seg != 0, kv_seg != 0
    q_lo, q_hi = _block_range(q_seg, q_ok, bq)
    k_lo, k_hi = _block_range(kv_seg, kv_ok, bk)
    visits = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    if plan.band is not None:
        qp_lo, qp_hi = _block_range(q_pos, q_ok, bq)
        kp_lo, kp_hi = _block_range(kv_pos, kv_ok, bk)
        left, right = plan.band
        lo = kp_lo[:, None, :] - qp_hi[:, :, None]  # a range holding every offset `kv_pos - q_pos` of the tile
        hi = kp_hi[:, None, :] - qp_lo[:, :, None]
        if left is not None:
            lo = jnp.maximum(lo, -left)
        if right is not None:
            hi = jnp.minimum(hi, right)
        visits = visits & (lo <= hi)
    if mask is not None:
        b, k, g, t, s = mask.shape
        tq, tk = (plan.nq, bq) if t != 1 else (1, 1), (plan.nk, bk) if s != 1 else (1, 1)
        any_ = jnp.reshape(mask != 0, (b, k, g, *tq, *tk)).any(axis=(1, 2, 4, 6))
        visits = visits & any_
    return visits


def mask_mod_tiles(plan: Plan, q_seg, q_pos, kv_pos, args) -> jax.Array:
    """bool `[B, nq, nk]`: tiles where the `mask_mod` lets some (head, query, key) through, evaluated on the device
    on the padded positions (`[B, T']`, `[B, S']`) and grouped `score_mod_args` (`[B|1, K|1, G|1, T'|1, S'|1]`)."""
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
    return tiles.any(axis=(1, 3, 5))
