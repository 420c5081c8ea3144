"""The static plan of one call of attnlib's flex kernel: sizes, blocks and which optional operands it carries.

A `Plan` is everything static the kernels are traced from (hashable: the `custom_vjp` takes it as a static
argument). Shapes the kernels see:

- Query rows: the `G = N // K` query heads of one key/value head and `block_q` query tokens are one block of
  `rows = G * block_q` rows (`[B, K, nq * rows, H']`: rows of block `qi` are `g * block_q + t` for token
  `qi * block_q + t`), so grouped-query attention never repeats a key/value head.
- Keys: `[B, K, S', H']` / `[B, K, S', Hv']` in blocks of `block_k`.
- Per-token integers (segment ids, aligned positions) of the query rows `[B, nq * rows, 1]` and of the keys
  `[B, 1, S']`.
- Arrays broadcastable to `[B, N, T, S]` (`bias`, the boolean `mask`, each of `score_mod_args`) as
  `[B|1, K|1, G|1, T'|1, S'|1]` (`ArraySpec`): each gets its own blocks, of size 1 along its broadcast dims.

`T` and `S` are padded to whole blocks (`T'`, `S'`) and head dims to 128 lanes; padded query rows and keys carry
segment id 0 (seen by nothing).
"""

import dataclasses
from typing import Any

import jax
import numpy as np

from .... import argument_checks
from ....config import AttentionConfig
from ... import scores
from .. import blocks


LANES = blocks.LANES
TILE_ROWS = 1024
"""Query rows per tile the default blocks aim at (`G · block_q`, `block_q` a multiple of 128, at least 128)."""
TILE_KEYS = 1024
"""Keys per tile by default (fewer for shorter key sequences). On a v5e (plain causal, bf16, 2026-12-07) 1024 x 1024
tiles ran GQA 32/8 at 8k in 12.0 / 42.5 ms forward / forward + backward against 19.2 / 56.1 with 512 x 512, and MHA
at 4k in 2.0 / 7.2 against 2.8 / 8.6 (the block sweep in `bench_tpu_features_v5e.json`)."""

RAISED_VMEM = 96 * 2**20
"""Scoped VMEM the kernels may use where Mosaic's default is too small (a v5e core has 128 MiB): `vmem_limit`."""


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """An array broadcastable to `[B, N, T, S]`, grouped `[B|1, K|1, G|1, T'|1, S'|1]` (`shape`) in `dtype` (the
    kernel's storage dtype: float arrays as given, integers as int32, bools as int8). `in_place`: the array has no
    broadcast dim (its shape is the whole problem's), so the dQ kernel writes its gradient in place, each tile its own
    block, rather than as per-tile partials summed afterwards (`operands.gradient_shape`); decided on the whole problem
    and kept by each shard's plan, whose local sizes could make a broadcast dim look whole."""

    shape: tuple[int, int, int, int, int]
    dtype: Any
    in_place: bool = False

    @property
    def has_batch(self) -> bool:
        return self.shape[0] != 1

    @property
    def has_heads(self) -> bool:
        return self.shape[1:3] != (1, 1)

    @property
    def has_q(self) -> bool:
        return self.shape[3] != 1

    @property
    def has_k(self) -> bool:
        return self.shape[4] != 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """Attributes:
    B, K, G, T, S: batch, key/value heads, group size, query and key lengths of the canonical problem.
    block_q, block_k: tokens per query / key block.
    head_dim, value_head_dim: padded head dims `H'`, `Hv'`.
    dtype: query / key / value dtype.
    band: `(left, right)` on aligned positions (None: unbounded side), or None without causal / window.
    soft_cap: `logits_soft_cap` or None.
    bias, mask: `ArraySpec` or None.
    args: one `ArraySpec` per `score_mod_args`.
    arg_grads: the indices of the float `score_mod_args` whose gradient the backward computes.
    modifiers: the call's `Modifiers` (the jaxprs the kernels evaluate), or None.
    thd: packed THD rows (`batch` of the modifiers is each query's sequence).
    dropout_rate: 0 without dropout.
    sinks: per-head sinks given.
    precision: of the kernels' matrix products.
    interpret: Pallas interpret mode.
    map_per_batch: the block map differs per batch row (read from runtime data).
    width_q, width_k: the grid's inner extent: most query blocks a key block visits (`dkv` kernel) and most key
        blocks a query block visits (forward and `dq` kernels).
    any_full, any_partial: some visited tile is wholly visible / partly hidden (`block_map.BlockMap`): the kernels
        hold the unmasked and the masked body only where they can meet them.
    every_tile: the (static) block map visits every tile: no gradient block is left for zeros to fill.
    """

    B: int
    K: int
    G: int
    T: int
    S: int
    block_q: int
    block_k: int
    head_dim: int
    value_head_dim: int
    dtype: Any
    band: tuple[int | None, int | None] | None
    soft_cap: float | None
    bias: ArraySpec | None
    mask: ArraySpec | None
    args: tuple[ArraySpec, ...]
    arg_grads: tuple[int, ...]
    modifiers: Any
    thd: bool
    dropout_rate: float
    sinks: bool
    precision: Any
    interpret: bool
    map_per_batch: bool = False
    width_q: int = 0
    width_k: int = 0
    any_full: bool = True
    any_partial: bool = True
    every_tile: bool = False

    @property
    def Tp(self) -> int:
        return blocks.round_up(self.T, self.block_q)

    @property
    def Sp(self) -> int:
        return blocks.round_up(self.S, self.block_k)

    @property
    def nq(self) -> int:
        return self.Tp // self.block_q

    @property
    def nk(self) -> int:
        return self.Sp // self.block_k

    @property
    def rows(self) -> int:
        return self.G * self.block_q

    @property
    def needs_positions(self) -> bool:
        return self.band is not None or self.modifiers is not None

    @property
    def score_mod(self):
        return None if self.modifiers is None else self.modifiers.score_jaxpr

    @property
    def mask_mod(self):
        return None if self.modifiers is None else self.modifiers.mask_jaxpr


def vmem_limit(plan: Plan, *, backward: bool) -> int | None:
    """The scoped VMEM of a kernel (None: Mosaic's default). The backward kernels' float32 temporaries (and a bias
    block's gradient) at 1024 x 1024 tiles ran out of the default on a v5e (ALiBi, bias, dropout, MLA, float32); the
    forward fitted, and ran 4–15 % slower under the raised limit, so it keeps the default up to that tile size."""
    if backward or plan.rows * plan.block_k > TILE_ROWS * TILE_KEYS:
        return RAISED_VMEM
    return None


def precision_of(config: AttentionConfig) -> jax.lax.Precision:
    """Float32 products at full precision when the caller asks for more than the default (`precision.py`)."""
    if np.dtype(config.dtype) == np.dtype("float32") and config.matmul_precision is not None:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT


def storage_dtype(dtype) -> Any:
    """How an array broadcastable to the scores is stored for the kernel: floats as they are (64-bit narrowed),
    bools as int8, other integers as int32 (`argument_checks.is_float`: NumPy's `issubdtype` misses bfloat16)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.dtype("int8")
    if argument_checks.is_float(dtype):
        return np.dtype("float32") if dtype == np.float64 else dtype
    if dtype == np.uint32:
        return dtype
    return np.dtype("int32")


def array_spec(shape4: tuple[int, int, int, int], dtype, plan_sizes: tuple[int, int, int, int, int]) -> ArraySpec:
    """The grouped, padded spec of a rank-4 `[B|1, N|1, T|1, S|1]` array (`plan_sizes`: `(B, K, G, T', S')`)."""
    B, K, G, Tp, Sp = plan_sizes
    b, n, t, s = shape4
    heads = (K, G) if n != 1 else (1, 1)
    grouped = (b, *heads, Tp if t != 1 else 1, Sp if s != 1 else 1)
    return ArraySpec(grouped, storage_dtype(dtype), in_place=grouped == plan_sizes)


def hidden() -> float:
    return scores.hidden_score(np.float32)
