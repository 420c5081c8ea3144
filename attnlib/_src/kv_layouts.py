"""Memory layouts of paged key/value pools: their shapes, how tokens are written and read, and conversion.

Each paged kernel reads its own layout; a `PagedKVCache` holds its pools in one of them, chosen at `create`, so no
call ever re-lays-out a pool:

- `"token_major"`: keys `[P, page_size, K, H]`, values `[P, page_size, K, Hv]` (attnlib's bare-array form; cuDNN's
  paged graphs and the plain-JAX implementations read it directly).
- `"head_major"`: keys `[K, P, page_size, H']`, values `[K, P, page_size, Hv']` (JAX's Pallas TPU `paged_attention`).
- `"combined"`: one pool `[P, page_size, 2K, D']`, keys at even and values at odd head slots (JAX's Pallas TPU
  `ragged_paged_attention`: mixed prefill and decode).

`H'`, `Hv'`, `D'` are the head dims padded with zeros to a multiple of 128 lanes (`D' >= max(H, Hv)`): what the TPU
kernels need, paid once at `create` (zero columns change no score or output).
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from . import explicit_axes
from .backends import placement


LayoutName = Literal["token_major", "head_major", "combined"]
LAYOUTS: tuple[str, ...] = ("token_major", "head_major", "combined")

LANES = 128
"""Padded layouts round head dims up to this (the TPU's lanes)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_layout() -> LayoutName:
    """The layout the fastest paged kernel of the default device reads: `"combined"` on a TPU (JAX's ragged
    paged-attention kernel serves decode and mixed prefill + decode, `docs/performance.md`), `"token_major"`
    elsewhere (cuDNN and the plain-JAX implementations)."""
    return "combined" if placement.placement_platform() == "tpu" else "token_major"


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """One layout with the true head dims of the cache it describes (static: part of a cache's pytree metadata).

    Attributes:
        name: one of `LAYOUTS`.
        head_dim: `H`, the key head dim before padding.
        value_head_dim: `Hv`, the value head dim before padding.
    """

    name: LayoutName
    head_dim: int
    value_head_dim: int

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise ValueError(f"`layout` must be one of {LAYOUTS} or None. Got layout={self.name!r}.")

    @property
    def padded(self) -> bool:
        return self.name != "token_major"

    def pool_shapes(self, num_pages: int, page_size: int, num_kv_heads: int) -> tuple[tuple[int, ...], ...]:
        """The shapes of the pools a cache holds: `(keys, values)`, or `(combined,)`."""
        P, page, K, H, Hv = num_pages, page_size, num_kv_heads, self.head_dim, self.value_head_dim
        if self.name == "token_major":
            return (P, page, K, H), (P, page, K, Hv)
        if self.name == "head_major":
            return (K, P, page, _round_up(H, LANES)), (K, P, page, _round_up(Hv, LANES))
        return ((P, page, 2 * K, _round_up(max(H, Hv), LANES)),)

    def geometry(self, key: jax.Array) -> tuple[int, int, int]:
        """`(P, page_size, K)` of a key pool (the combined pool for `"combined"`)."""
        if self.name == "head_major":
            K, P, page, _ = key.shape
            return int(P), int(page), int(K)
        P, page, heads, _ = key.shape
        return int(P), int(page), int(heads) // (2 if self.name == "combined" else 1)

    def gather(self, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Dense rows from the pools: keys `[B, S, K, H]`, values `[B, S, K, Hv]` with `S = pages_per_seq *
        page_size`. Page-table entries outside `[0, P)` are clamped (their tokens must lie past the row's length)."""
        table = page_table.astype(jnp.int32)
        B, pages_per_seq = table.shape
        if self.name == "head_major":
            k = jnp.take(k_pool, table, axis=1, mode="clip")  # [K, B, pps, page, H']
            v = jnp.take(v_pool, table, axis=1, mode="clip")
            to_rows = lambda x, d: jnp.reshape(jnp.moveaxis(x, 0, 3), (B, -1, x.shape[0], x.shape[-1]))[..., :d]
            return to_rows(k, self.head_dim), to_rows(v, self.value_head_dim)
        pages = jnp.take(k_pool, table, axis=0, mode="clip")  # [B, pps, page, heads, D]
        rows = jnp.reshape(pages, (B, -1) + pages.shape[3:])
        if self.name == "combined":
            return rows[:, :, 0::2, : self.head_dim], rows[:, :, 1::2, : self.value_head_dim]
        return rows, jnp.reshape(jnp.take(v_pool, table, axis=0, mode="clip"), (B, -1) + v_pool.shape[2:])

    def write(
        self, pools: tuple[jax.Array, ...], page: jax.Array, slot: jax.Array, k_new: jax.Array, v_new: jax.Array
    ) -> tuple[jax.Array, ...]:
        """`pools` with token `t` of `k_new [T, K, H]` / `v_new [T, K, Hv]` written at page `page[t]`, slot
        `slot[t]`; tokens whose page is out of range (`P`) are dropped. Under explicit mesh axes the tokens are
        typed as the scatter writes them: whole, their heads split as the pool's."""
        if self.name == "token_major":
            k_pool, v_pool = pools
            k_new, v_new = (explicit_axes.like_dims(x, pool, (None, 2, 3)) for x, pool in zip((k_new, v_new), pools))
            return (
                k_pool.at[page, slot].set(k_new.astype(k_pool.dtype), mode="drop"),
                v_pool.at[page, slot].set(v_new.astype(v_pool.dtype), mode="drop"),
            )
        if self.name == "head_major":
            k_pool, v_pool = pools
            pad = lambda x, d: jnp.pad(x, ((0, 0), (0, 0), (0, d - x.shape[-1])))
            k_rows = jnp.swapaxes(pad(k_new, k_pool.shape[-1]), 0, 1)  # [K, T, H']
            v_rows = jnp.swapaxes(pad(v_new, v_pool.shape[-1]), 0, 1)
            k_rows, v_rows = (explicit_axes.like_dims(x, p, (0, None, 3)) for x, p in zip((k_rows, v_rows), pools))
            return (
                k_pool.at[:, page, slot].set(k_rows.astype(k_pool.dtype), mode="drop"),
                v_pool.at[:, page, slot].set(v_rows.astype(v_pool.dtype), mode="drop"),
            )
        (pool,) = pools
        D = pool.shape[-1]
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, D - x.shape[-1]))).astype(pool.dtype)
        T, K = k_new.shape[:2]
        both = jnp.reshape(jnp.stack([pad(k_new), pad(v_new)], axis=2), (T, 2 * K, D))  # k, v interleaved
        both = explicit_axes.like_dims(both, pool, (None, 2, 3))
        return (pool.at[page, slot].set(both, mode="drop"),)

    def to_token_major(self, pools: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        """The pools as token-major `[P, page_size, K, H]`, `[P, page_size, K, Hv]` (a copy)."""
        if self.name == "token_major":
            return pools
        if self.name == "head_major":
            k_pool, v_pool = pools
            return (
                jnp.transpose(k_pool, (1, 2, 0, 3))[..., : self.head_dim],
                jnp.transpose(v_pool, (1, 2, 0, 3))[..., : self.value_head_dim],
            )
        (pool,) = pools
        return pool[:, :, 0::2, : self.head_dim], pool[:, :, 1::2, : self.value_head_dim]

    def from_token_major(self, k_pool: jax.Array, v_pool: jax.Array) -> tuple[jax.Array, ...]:
        """Token-major pools `[P, page_size, K, H]`, `[P, page_size, K, Hv]` in this layout (a copy)."""
        if self.name == "token_major":
            return k_pool, v_pool
        P, page, K, _ = k_pool.shape
        empty = tuple(jnp.zeros(shape, k_pool.dtype) for shape in self.pool_shapes(P, page, K))
        tokens = lambda x: jnp.reshape(x, (P * page,) + x.shape[2:])
        pages = jnp.repeat(jnp.arange(P, dtype=jnp.int32), page)
        slots = jnp.tile(jnp.arange(page, dtype=jnp.int32), P)
        return self.write(empty, pages, slots, tokens(k_pool), tokens(v_pool))
