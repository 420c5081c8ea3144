"""One tile's scores inside a flex kernel, in attnlib's order of operations (as `scores.py`):

    s = scale · q·kᵀ + bias → score_mod → logits_soft_cap → masks (segments / padding, band on aligned
    positions, the boolean `mask`, mask_mod, score_mod's -inf) → softmax (the kernels) → dropout → @ v

Everything is a `[rows, block_k]` array (`rows = G · block_q`: the query heads of one key/value head times the
block's query tokens). The modifiers' jaxprs run over the tile (`elementwise.py`) on int32 index blocks: `batch`
(the grid's batch row; THD: the query's sequence), `head` (`kh · G + g`), `q_idx` / `kv_idx` (aligned positions
within the sequence), and the tile's blocks of `score_mod_args`. `Tile.backward` is the chain rule back from the
capped score to the raw one (`jax.vjp` of the modifier evaluation) and to the float `score_mod_args`.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .... import dropout as dropout_lib
from . import elementwise
from .plan import hidden, Plan


@dataclasses.dataclass
class Tile:
    """Scores of one tile.

    Attributes:
        s: f32 `[rows, bk]` final scores (after the soft cap).
        allowed: bool `[rows, bk]`, or None where all are.
        backward: `ds (w.r.t. s) -> (ds_raw (w.r.t. scale·q·kᵀ + bias), [d arg for plan.arg_grads])`.
    """

    s: jax.Array
    allowed: jax.Array
    backward: Callable


def _grouped_block(plan: Plan, ref, dtype) -> jax.Array:
    """A `(G|1, bq|1, bk|1)` block as `[rows, bk]` in `dtype` (via 32 bits: bools and int8 as int32)."""
    x = ref[...]
    wide = jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32
    x = jnp.broadcast_to(x.astype(wide), (plan.G, plan.block_q, plan.block_k))
    return jnp.reshape(x, (plan.rows, plan.block_k)).astype(dtype)


def dot_t(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """`a @ bᵀ` in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)  # fmt: skip


def dot(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)  # fmt: skip


def dot_tn(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """`aᵀ @ b` in float32."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=precision)  # fmt: skip


def tile(plan: Plan, refs: dict, *, full: bool, backward: bool = False) -> Tile:
    """The scores and visibility of the tile whose query and key blocks are loaded in `refs`; `full`: a tile every
    pair of which is visible (`block_map.py`: no mask is evaluated, only `score_mod`'s -inf still hides); `backward`:
    with the chain rule back through the modifiers (`Tile.backward`, the `score_mod` evaluated once, under
    `jax.vjp`)."""
    shape = (plan.rows, plan.block_k)
    allowed = None
    q_pos = kv_pos = None
    if plan.needs_positions:
        q_pos, kv_pos = refs["q_pos"][...], refs["kv_pos"][...]
    if not full:
        q_seg, kv_seg = refs["q_seg"][...], refs["kv_seg"][...]  # [rows, 1], [1, bk]
        allowed = (q_seg != 0) & (q_seg == kv_seg)
        if plan.band is not None:
            offset = kv_pos - q_pos
            left, right = plan.band
            if left is not None:
                allowed = allowed & (offset >= -left)
            if right is not None:
                allowed = allowed & (offset <= right)
        if plan.mask is not None:
            allowed = allowed & (_grouped_block(plan, refs["mask"], jnp.int32) != 0)

    s = dot_t(refs["q"][...], refs["k"][...], plan.precision) * refs["scale"][0]
    if plan.bias is not None:
        s = s + _grouped_block(plan, refs["bias"], jnp.float32)

    args: list = []
    indices: tuple = ()
    if plan.modifiers is not None:
        batch = jnp.maximum(refs["q_seg"][...] - 1, 0) if plan.thd else refs["batch"][...]
        head = refs["head"][...]
        indices = (batch, head, q_pos, kv_pos)
        args = [_grouped_block(plan, refs[f"arg{i}"], dtype) for i, dtype in enumerate(plan.modifiers.arg_dtypes)]
        if plan.mask_mod is not None and not full:
            keep = elementwise.evaluate(plan.mask_mod, plan.mask_mod.consts, (*indices, *args), shape)
            allowed = allowed & keep.astype(bool)

    s_raw = s
    grads = plan.arg_grads

    def modified(s_raw, *float_args):
        all_args = list(args)
        for i, a in zip(grads, float_args, strict=True):
            all_args[i] = a
        out = elementwise.evaluate(plan.score_mod, plan.score_mod.consts, (s_raw, *indices, *all_args), shape)
        return out.astype(jnp.float32)

    vjp = None
    if plan.score_mod is not None:
        float_args = tuple(args[i] for i in grads)
        if backward:
            s, vjp = jax.vjp(modified, s_raw, *float_args)
        else:
            s = modified(s_raw, *float_args)
        finite = s >= np.finfo(np.float32).min
        allowed = finite if allowed is None else allowed & finite
    if plan.soft_cap is not None:
        c = jnp.float32(plan.soft_cap)
        s = c * jnp.tanh(s / c)

    def chain(ds):
        if plan.soft_cap is not None:
            ds = ds * (1.0 - jnp.square(s / jnp.float32(plan.soft_cap)))
        if vjp is None:
            return ds, []
        ds_raw, *d_args = vjp(ds)
        return ds_raw, [d.astype(jnp.float32) for d in d_args]

    return Tile(s, allowed, chain)


def dropout_keep(plan: Plan, refs: dict, kj) -> jax.Array:
    """bool `[rows, bk]`: the probabilities of the tile that survive dropout (`dropout.keep_mask_from_seeds` on the
    canonical batch row, query head, query token and key token: the plain-JAX implementations' mask)."""
    seeds = (refs["seeds"][0], refs["seeds"][1])
    q_token = refs["q_token"][...]
    k_token = kj * plan.block_k + jax.lax.broadcasted_iota(jnp.int32, (1, plan.block_k), 1)
    return dropout_lib.keep_mask_from_seeds(
        seeds, plan.dropout_rate, refs["batch"][...], refs["head"][...], q_token, k_token
    )


def each_tile_kind(plan: Plan, visited, full_flag, step: Callable[[bool], None]) -> None:
    """Run `step(full)` for a visited grid step: the unmasked body on a wholly visible tile (`full_flag` 1), the
    masked one otherwise; each body is traced only where the block map holds such tiles (`Plan.any_full`,
    `Plan.any_partial`)."""
    if plan.any_full and plan.any_partial:
        pl.when(visited & (full_flag != 0))(lambda: step(True))
        pl.when(visited & (full_flag == 0))(lambda: step(False))
    else:
        pl.when(visited)(lambda: step(plan.any_full))


def masked(t: Tile) -> jax.Array:
    return t.s if t.allowed is None else jnp.where(t.allowed, t.s, hidden())


def row_shift(row_max: jax.Array) -> jax.Array:
    """As `scores.row_shift`: the row max, or 0 where nothing is visible."""
    return jnp.where(row_max > hidden(), row_max, 0.0)
