"""The flex kernels' operands: laying the canonical problem out in blocks, and their `BlockSpec`s.

`Operands` holds every array a kernel may read, already laid out (`plan.py` describes the shapes); `specs` gives
each present operand a `BlockSpec` whose index map is written in block coordinates `(b, kh, qi, kj)` — the grid of
each kernel maps its own indices (and its scalar-prefetched block lists) to those coordinates. Outputs are laid
out back with `from_rows` and `grouped_gradient`.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .plan import ArraySpec, Plan


class Operands(NamedTuple):
    """Arrays the kernels read (None where absent)."""

    q: jax.Array  # [B, K, nq * rows, H'] (first: the partitioned calls read the batch and heads from it)
    k: jax.Array  # [B, K, S', H']
    v: jax.Array  # [B, K, S', Hv']
    scale: jax.Array  # f32 [1] (SMEM)
    seeds: jax.Array | None  # uint32 [2] (SMEM)
    q_seg: jax.Array  # int32 [B, nq * rows, 1]
    q_pos: jax.Array | None  # int32 [B, nq * rows, 1]
    kv_seg: jax.Array  # int32 [B, 1, S']
    kv_pos: jax.Array | None  # int32 [B, 1, S']
    head: jax.Array  # int32 [K, rows, 1]: the query head of each row (global: right on every shard)
    batch: jax.Array  # int32 [B, 1, 1]: the canonical batch row (global: right on every shard)
    q_token: jax.Array | None  # int32 [nq * rows, 1]: the query token index of each row (dropout)
    sinks: jax.Array | None  # f32 [K, rows, 1]
    bias: jax.Array | None  # [B|1, K|1, G|1, T'|1, S'|1]
    mask: jax.Array | None  # int8, likewise
    args: tuple[jax.Array, ...]  # likewise, each in its storage dtype


def to_rows(plan: Plan, x: jax.Array, dim: int) -> jax.Array:
    """`[B, T, N, D]` -> `[B, K, nq * rows, dim]` (zero-padded)."""
    B, T, N, D = x.shape
    x = jnp.pad(x, ((0, 0), (0, plan.Tp - T), (0, 0), (0, dim - D)))
    x = jnp.reshape(x, (B, plan.nq, plan.block_q, plan.K, plan.G, dim))
    x = jnp.transpose(x, (0, 3, 1, 4, 2, 5))
    return jnp.reshape(x, (B, plan.K, plan.nq * plan.rows, dim))


def from_rows(plan: Plan, x: jax.Array, dim: int) -> jax.Array:
    """`[B, K, nq * rows, D']` -> `[B, T, N, dim]` (padding dropped)."""
    B, D = x.shape[0], x.shape[-1]
    x = jnp.reshape(x, (B, plan.K, plan.nq, plan.G, plan.block_q, D))
    x = jnp.transpose(x, (0, 2, 4, 1, 3, 5))
    x = jnp.reshape(x, (B, plan.Tp, plan.K * plan.G, D))
    return x[:, : plan.T, :, :dim]


def token_rows(plan: Plan, x: jax.Array) -> jax.Array:
    """Per-query-token `[B, T']` -> per-row `[B, nq * rows, 1]` (each token once per head of the group)."""
    B = x.shape[0]
    x = jnp.reshape(x, (B, plan.nq, 1, plan.block_q))
    x = jnp.broadcast_to(x, (B, plan.nq, plan.G, plan.block_q))
    return jnp.reshape(x, (B, plan.nq * plan.rows, 1))


def head_rows(plan: Plan) -> np.ndarray:
    """int32 `[K, rows, 1]`: the query head `kh · G + g` of each row of each key/value head's blocks."""
    g = np.repeat(np.arange(plan.G, dtype=np.int32), plan.block_q)[None, :, None]
    return (np.arange(plan.K, dtype=np.int32)[:, None, None] * plan.G + g).astype(np.int32)


def batch_rows(plan: Plan) -> np.ndarray:
    return np.arange(plan.B, dtype=np.int32)[:, None, None]


def q_token_rows(plan: Plan) -> np.ndarray:
    t = np.arange(plan.Tp, dtype=np.int32).reshape(plan.nq, 1, plan.block_q)
    return np.broadcast_to(t, (plan.nq, plan.G, plan.block_q)).reshape(-1, 1).copy()


def sinks_rows(plan: Plan, sinks: jax.Array) -> jax.Array:
    """`[N]` -> f32 `[K, rows, 1]`."""
    s = jnp.reshape(sinks.astype(jnp.float32), (plan.K, plan.G, 1))
    return jnp.reshape(jnp.broadcast_to(s, (plan.K, plan.G, plan.block_q)), (plan.K, plan.rows, 1))


def grouped(plan: Plan, x: jax.Array, spec: ArraySpec) -> jax.Array:
    """Rank-4 `[B|1, N|1, T|1, S|1]` -> `spec.shape` in `spec.dtype` (padded with zeros)."""
    b, n, t, s = x.shape
    x = jnp.reshape(x, (b, *spec.shape[1:3], t, s)).astype(spec.dtype)
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, spec.shape[3] - t), (0, spec.shape[4] - s)))


Coords = Callable[..., tuple]
"""`(*grid indices, *prefetch refs) -> (b, kh, qi, kj)`."""


def _grouped_spec(plan: Plan, spec: ArraySpec, coords: Coords) -> pl.BlockSpec:
    _, _, G, T, S = spec.shape
    block = (None, None, G, plan.block_q if T != 1 else 1, plan.block_k if S != 1 else 1)

    def index(*idx):
        b, kh, qi, kj = coords(*idx)
        return (b if spec.has_batch else 0, kh if spec.has_heads else 0, 0, qi if spec.has_q else 0,
                kj if spec.has_k else 0)  # fmt: skip

    return pl.BlockSpec(block, index)


def specs(plan: Plan, named: dict, coords: Coords) -> tuple[list, list, list[str]]:
    """`(arrays, specs, names)` of the present (not None) operands of `named`, in its order. Names: the fields of
    `Operands` (`args` expands to `arg0`, `arg1`, ...) and the backward's `do`, `lse`, `di`."""
    rows, bk = plan.rows, plan.block_k
    H, Hv = plan.head_dim, plan.value_head_dim

    def at(f):
        return lambda *idx: f(*coords(*idx))

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    row_block = lambda b, kh, qi, kj: (b, kh, qi, 0)
    table = {
        "scale": smem,
        "seeds": smem,
        "q": pl.BlockSpec((None, None, rows, H), at(row_block)),
        "k": pl.BlockSpec((None, None, bk, H), at(lambda b, kh, qi, kj: (b, kh, kj, 0))),
        "v": pl.BlockSpec((None, None, bk, Hv), at(lambda b, kh, qi, kj: (b, kh, kj, 0))),
        "q_seg": pl.BlockSpec((None, rows, 1), at(lambda b, kh, qi, kj: (b, qi, 0))),
        "q_pos": pl.BlockSpec((None, rows, 1), at(lambda b, kh, qi, kj: (b, qi, 0))),
        "kv_seg": pl.BlockSpec((None, 1, bk), at(lambda b, kh, qi, kj: (b, 0, kj))),
        "kv_pos": pl.BlockSpec((None, 1, bk), at(lambda b, kh, qi, kj: (b, 0, kj))),
        "head": pl.BlockSpec((None, rows, 1), at(lambda b, kh, qi, kj: (kh, 0, 0))),
        "batch": pl.BlockSpec((None, 1, 1), at(lambda b, kh, qi, kj: (b, 0, 0))),
        "q_token": pl.BlockSpec((rows, 1), at(lambda b, kh, qi, kj: (qi, 0))),
        "sinks": pl.BlockSpec((None, rows, 1), at(lambda b, kh, qi, kj: (kh, 0, 0))),
        "do": pl.BlockSpec((None, None, rows, Hv), at(row_block)),
        "lse": pl.BlockSpec((None, None, rows, 1), at(row_block)),
        "di": pl.BlockSpec((None, None, rows, 1), at(row_block)),
    }
    arrays, block_specs, kept = [], [], []
    for name, x in named.items():
        if name == "args":
            for i, (a, spec) in enumerate(zip(x, plan.args, strict=True)):
                arrays.append(a), block_specs.append(_grouped_spec(plan, spec, coords)), kept.append(f"arg{i}")
        elif x is None:
            continue
        elif name in ("bias", "mask"):
            arrays.append(x), block_specs.append(_grouped_spec(plan, getattr(plan, name), coords)), kept.append(name)
        else:
            arrays.append(x), block_specs.append(table[name]), kept.append(name)
    return arrays, block_specs, kept


def gradient_shape(plan: Plan, spec: ArraySpec) -> tuple[int, ...]:
    """Where the dQ kernel writes the gradient of a grouped array. An array with no broadcast dim
    (`ArraySpec.in_place`): the gradient itself, `spec.shape` in `spec.dtype` (each tile writes its own block once).
    Otherwise per-tile float32 partials `[B, K, nq, nk, R, C]` with `R = G|1 * block_q|1`, `C = block_k|1` (one block
    per tile, summed over the broadcast dims by `grouped_gradient`)."""
    if spec.in_place:
        return spec.shape
    tq = plan.block_q if spec.has_q else 1
    tk = plan.block_k if spec.has_k else 1
    g = plan.G if spec.has_heads else 1
    return (plan.B, plan.K, plan.nq, plan.nk, g * tq, tk)


def gradient_dtype(spec: ArraySpec):
    return spec.dtype if spec.in_place else np.dtype("float32")


def gradient_spec(plan: Plan, spec: ArraySpec, coords: Coords) -> pl.BlockSpec:
    if spec.in_place:
        return _grouped_spec(plan, spec, coords)
    shape = gradient_shape(plan, spec)
    return pl.BlockSpec((None, None, None, None, *shape[4:]), lambda *idx: (*coords(*idx), 0, 0))


def grouped_gradient(plan: Plan, written: jax.Array, spec: ArraySpec, shape4: tuple[int, ...]) -> jax.Array:
    """The dQ kernel's gradient output (`gradient_shape`) -> the gradient of the rank-4 array of shape `shape4`."""
    b, n, t, s = shape4
    if spec.in_place:
        return jnp.reshape(written, (b, n) + spec.shape[3:])[:, :, :t, :s]
    g = plan.G if spec.has_heads else 1
    tq = plan.block_q if spec.has_q else 1
    tk = plan.block_k if spec.has_k else 1
    x = jnp.reshape(written, (plan.B, plan.K, plan.nq, plan.nk, g, tq, tk))
    x = jnp.transpose(x, (0, 1, 4, 2, 5, 3, 6))  # [B, K, g, nq, tq, nk, tk]
    if not spec.has_q:
        x = jnp.sum(x, axis=3, keepdims=True)
    if not spec.has_k:
        x = jnp.sum(x, axis=5, keepdims=True)
    x = jnp.reshape(x, (plan.B, plan.K, g, x.shape[3] * tq, x.shape[5] * tk))
    if not spec.has_heads:
        x = jnp.sum(x, axis=1, keepdims=True)
    if not spec.has_batch:
        x = jnp.sum(x, axis=0, keepdims=True)
    x = jnp.reshape(x, (x.shape[0], n, x.shape[3], x.shape[4]))
    return x[:, :, :t, :s]
