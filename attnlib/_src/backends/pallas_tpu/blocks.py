"""Splash attention block sizes per shape: the table `PallasTpu(block_sizes=None)` uses, and padded lengths.

Splash tiles the query and key axes in blocks that must divide the (padded) lengths, and its key blocks must be
multiples of 128 lanes. attnlib pads `T` and `S` to a multiple of 128 (`padded_length`) and picks, for each axis, the
largest of 512, 256, 128 that divides the padded length. Every block is at least splash's default (128), so the
table never asks for more grid steps than `BlockSizes.get_default()`; whether larger blocks are faster on every
shape is not measured on a TPU yet (docs/implementations.md).
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp


LANES = 128
"""Splash's key blocks are whole multiples of the TPU's 128 lanes; attnlib pads lengths and head dims to it."""

CANDIDATES = (512, 256, 128)
"""Block sizes the table tries, largest first."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def heads_major(x, length: int, dim: int):
    """`[B, L, heads, D]` -> `[B, heads, length, dim]`, zero-padded (the Pallas kernels' key / value operands; zero
    columns change no score, padded positions are hidden by the kernels)."""
    x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dim - x.shape[3])))
    return jnp.transpose(x, (0, 2, 1, 3))


def _largest_dividing(length: int) -> int:
    return next(b for b in CANDIDATES if length % b == 0)


def default_block_sizes(q_len: int, kv_len: int) -> Any:
    """attnlib's table: splash `BlockSizes` for padded lengths `q_len`, `kv_len` (multiples of 128), forward and
    backward (separate dK/dV and dQ kernels)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

    bq, bkv = _largest_dividing(q_len), _largest_dividing(kv_len)
    return BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv,
        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
        block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip


def with_backward_blocks(block_sizes: Any) -> Any:
    """A caller's `BlockSizes` with the backward blocks it left unset taken from its forward blocks."""
    if block_sizes.has_backward_blocks:
        return block_sizes
    bq, bkv = block_sizes.block_q, block_sizes.block_kv
    fill = dict(block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=block_sizes.block_kv_compute)
    if not block_sizes.use_fused_bwd_kernel:
        fill.update(block_q_dq=bq, block_kv_dq=bkv)
    return dataclasses.replace(block_sizes, **{k: v for k, v in fill.items() if getattr(block_sizes, k) is None})


def _blocks(block_sizes: Any, names: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(b for b in (getattr(block_sizes, n) for n in names) if b is not None)


Q_BLOCKS = ("block_q", "block_q_dkv", "block_q_dq")
KV_BLOCKS = ("block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute", "block_kv_dq")


def padded_lengths(q_len: int, kv_len: int, block_sizes: Any | None) -> tuple[int, int]:
    """`(T', S')`: the lengths splash runs on. Multiples of 128 for attnlib's table; for a caller's `BlockSizes`,
    multiples of every block on that axis (so each block divides its axis and none exceeds it)."""
    if block_sizes is None:
        return round_up(q_len, LANES), round_up(kv_len, LANES)
    q_multiple = math.lcm(LANES, *_blocks(block_sizes, Q_BLOCKS))
    kv_multiple = math.lcm(LANES, *_blocks(block_sizes, KV_BLOCKS))
    return round_up(q_len, q_multiple), round_up(kv_len, kv_multiple)


def check_user_block_sizes(block_sizes: Any) -> None:
    """`ValueError` unless `block_sizes` is a splash `BlockSizes` whose blocks are positive multiples of 128."""
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

    if not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            "`block_sizes` must be None or a `jax.experimental.pallas.ops.tpu.splash_attention.BlockSizes`. "
            f"Got {block_sizes!r}."
        )
    bad = {n: b for n in Q_BLOCKS + KV_BLOCKS if (b := getattr(block_sizes, n)) is not None and (b <= 0 or b % LANES)}
    if bad:
        raise ValueError(f"`block_sizes` must have blocks that are positive multiples of {LANES}. Got {bad}.")
