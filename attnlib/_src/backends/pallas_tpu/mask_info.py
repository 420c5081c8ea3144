"""Splash's `MaskInfo` tables of attnlib's static masks, built from the masks' structure.

Splash's own `make_splash_mha` builds its block tables (`splash_attention_mask_info._process_mask`) by evaluating the
mask block by block in Python: `(T'/bq) * (S'/bkv)` slices for each of the forward, dQ and dK/dV tables, about 53 s
of a first call at 128k tokens with 512-blocks, growing with the square of the length (issue #77). attnlib's masks are
bands on the diagonal offset `d = k - q` of a key from a query: every key with `lo <= d <= hi` is visible
(`CausalMask(offset)`: `hi = offset`; `LocalMask((left, right), offset)`: `lo = offset - left`, `hi = offset + right`,
a None side unbounded; `FullMask`: both unbounded). A block of queries `[q0, q0 + bq)` and keys `[k0, k0 + bkv)`
holds every offset from `k0 - q0 - bq + 1` to `k0 - q0 + bkv - 1`, so whether it is hidden, partly or wholly visible
follows from comparing these two offsets with `lo` and `hi`, and the visible key blocks of a query block (the
visible query blocks of a key block) are a range given in closed form. The tables come out of a few vectorised
NumPy passes over these ranges (the grids splash keeps, at most `[T'/bq, S'/bkv]`), with no Python loop over blocks
and no mask element evaluated: milliseconds at 128k tokens, a fraction of a second at 512k.

The result is array for array what `make_splash_mha(MultiHeadMask([mask]), head_shards=1, q_seq_shards=1)` builds
(`tests/test_splash_mask_info.py`): one table row for every head (one mask shared by all heads), grids shrunk to the
visible blocks (forward and dQ: each query block's visible key blocks, left-aligned; dK/dV: each key block's visible
query blocks, bottom-aligned; not for dK/dV with a fused backward), scalar-memory tables downcast to the smallest
integer type that holds them. Causal and local masks carry their `mask_function` (the kernel computes a partly
visible block's mask from `q_sequence` and the key index), so, as in splash, they have no `mask_next` and no
`partial_mask_blocks`; a full mask has no partly visible block.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np


class MaskInfos(NamedTuple):
    """Splash's tables of one mask for one set of block sizes, and what its kernel needs with them.

    Attributes:
        fwd: the forward's `MaskInfo` (`block_q`, `block_kv`).
        dq: the dQ kernel's (`block_q_dq`, `block_kv_dq`); None with a fused backward or without backward blocks.
        dkv: the dK/dV kernel's (`block_q_dkv`, `block_kv_dkv`); None without backward blocks.
        mask_function: the mask's `mask_function` (causal, local), which the kernels evaluate on partly visible
            blocks; None for a full mask.
    """

    fwd: Any
    dq: Any | None
    dkv: Any | None
    mask_function: Callable[..., Any] | None


def band(spec: Any) -> tuple[int | None, int | None]:
    """`(lo, hi)`: the key-minus-query offsets `spec` (a `masks.MaskSpec`) shows, None for an unbounded side."""
    if spec.kind == "full":
        return None, None
    if spec.kind == "causal":
        return None, spec.offset
    if spec.kind == "local":
        assert spec.window is not None
        left, right = spec.window
        return (None if left is None else spec.offset - left), (None if right is None else spec.offset + right)
    raise ValueError(f"`spec.kind` must be one of 'full', 'causal', 'local'. Got {spec.kind!r}.")


def _clipped(spec: Any) -> tuple[int, int]:
    """`band(spec)` with unbounded sides made finite: offsets outside `[-T', S']` hold no element of any block, so
    a side beyond them behaves as unbounded, and the arithmetic stays small."""
    lo, hi = band(spec)
    lo_ = -spec.q_len if lo is None else min(max(lo, -spec.q_len), spec.kv_len)
    hi_ = spec.kv_len if hi is None else min(max(hi, -spec.q_len), spec.kv_len)
    return lo_, hi_


def _classify(lo: int, hi: int, block_shape: tuple[int, int], i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """int32, `i` and `j` broadcast: 0 where query block `i` and key block `j` hold no visible element of the band
    `lo <= k - q <= hi`, 1 where some, 2 where all."""
    bq, bkv = block_shape
    d_min = j * bkv - i * bq - (bq - 1)  # the block's smallest k - q
    d_max = j * bkv - i * bq + (bkv - 1)  # its largest (every offset between is in the block)
    some = np.maximum(d_min, lo) <= np.minimum(d_max, hi)
    every = (lo <= d_min) & (d_max <= hi)
    return np.where(every, 2, np.where(some, 1, 0)).astype(np.int32)


def block_mask(spec: Any, block_shape: tuple[int, int]) -> np.ndarray:
    """int32 `[T'/bq, S'/bkv]`: splash's `block_mask` of `spec` for one head before its grid is shrunk (0: a hidden
    block, 1: partly visible, 2: wholly visible)."""
    bq, bkv = block_shape
    i = np.arange(spec.q_len // bq, dtype=np.int64)[:, None]
    j = np.arange(spec.kv_len // bkv, dtype=np.int64)[None, :]
    return _classify(*_clipped(spec), block_shape, i, j)


def _visible_ranges(spec: Any, block_shape: tuple[int, int], *, by_key: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(first, count)`, int64: for each query block (each key block where `by_key`), the first block on the other
    axis with a visible element and how many follow it (a band's visible blocks along a row or column are
    consecutive)."""
    lo, hi = _clipped(spec)
    bq, bkv = block_shape
    q_blocks, kv_blocks = spec.q_len // bq, spec.kv_len // bkv
    if by_key:  # rows i with d_max >= lo and d_min <= hi, for each column j
        j = np.arange(kv_blocks, dtype=np.int64)
        first = -((-(j * bkv - (bq - 1) - hi)) // bq)  # ceil
        last = (j * bkv + (bkv - 1) - lo) // bq
        size = q_blocks
    else:  # columns j, for each row i
        i = np.arange(q_blocks, dtype=np.int64)
        first = -((-(lo + i * bq - (bkv - 1))) // bkv)
        last = (hi + i * bq + (bq - 1)) // bkv
        size = kv_blocks
    first, last = np.maximum(first, 0), np.minimum(last, size - 1)
    count = np.maximum(last - first + 1, 0) if lo <= hi else np.zeros_like(first)
    return first, count


def _shrunk(spec: Any, block_shape: tuple[int, int], *, is_dkv: bool) -> tuple[np.ndarray, np.ndarray]:
    """int32 `(block_mask, data_next)` of one head's shrunk grid, as splash's `_shrink_mask_info` (forward, dQ: each
    query block's visible key blocks moved to the left in order, `[T'/bq, width]`) or `_shrink_mask_info_dkv` (dK/dV:
    each key block's visible query blocks moved to the bottom, `[height, S'/bkv]`) leaves them; the slots past a
    block's visible ones hold 0. A visible entry's `data_next` is its own block on the walked axis."""
    lo, hi = _clipped(spec)
    first, count = _visible_ranges(spec, block_shape, by_key=is_dkv)
    width = int(count.max(initial=0))
    if width == 0:
        raise ValueError("The mask hides every block; splash cannot build its tables for it.")
    slot = np.arange(width, dtype=np.int64)
    if is_dkv:  # [height, kv_blocks], the visible rows at the bottom
        pad = width - count[None, :]
        valid = slot[:, None] >= pad
        i = first[None, :] + slot[:, None] - pad
        j = np.arange(first.size, dtype=np.int64)[None, :]
        data = i
    else:  # [q_blocks, width], the visible columns at the left
        valid = slot[None, :] < count[:, None]
        i = np.arange(first.size, dtype=np.int64)[:, None]
        j = first[:, None] + slot[None, :]
        data = j
    table = np.where(valid, _classify(lo, hi, block_shape, i, j), 0).astype(np.int32)
    return table, np.where(valid, data, 0).astype(np.int32)


def _next_visible(visible: np.ndarray, minor: int) -> np.ndarray:
    """int32, `visible`'s shape: for each entry of `visible` in C order, the index along the minor axis (of size
    `minor`) of the first visible entry at or after it, wrapping round to the first visible entry (0 if none):
    splash's `data_next` before shrinking."""
    flat = visible.reshape(-1)
    n = flat.size
    position = np.where(flat, np.arange(n), n)
    following = np.minimum.accumulate(position[::-1])[::-1]
    first = following[0] if n else n
    following = np.where(following == n, first if first < n else 0, following)
    return (following % minor).astype(np.int32).reshape(visible.shape)


def _downcast(array: np.ndarray) -> np.ndarray:
    """Splash's `_downcast_to_small_type`: int8 or int16 where the (non-negative) values fit."""
    if array.size == 0:
        return array
    top = int(array.max())
    if top <= np.iinfo(np.int8).max:
        return array.astype(np.int8)
    if top <= np.iinfo(np.int16).max:
        return array.astype(np.int16)
    return array


def _one(
    spec: Any,
    block_shape: tuple[int, int],
    *,
    is_dkv: bool,
    shrink_grid: bool,
    downcast_smem_data: bool,
    q_sequence: np.ndarray | None,
) -> Any:
    """One `MaskInfo`, as splash's `process_mask` (`process_mask_dkv` where `is_dkv`) gives it for one shared head,
    `head_shards=1`, `q_seq_shards=1`."""
    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info import MaskInfo

    bq, bkv = block_shape
    if spec.q_len % bq:
        raise ValueError(f"`block_q`={bq} must divide the padded query length {spec.q_len}.")
    if spec.kv_len % bkv:
        raise ValueError(f"`block_kv`={bkv} must divide the padded key length {spec.kv_len}.")
    if shrink_grid:
        table, data_next = _shrunk(spec, block_shape, is_dkv=is_dkv)
    else:
        table = block_mask(spec, block_shape)
        q_blocks, kv_blocks = table.shape
        if is_dkv:  # splash walks the grid key block by key block
            data_next = _next_visible(table.T != 0, q_blocks).T
        else:
            data_next = _next_visible(table != 0, kv_blocks)
    table, data_next = table[None], np.ascontiguousarray(data_next)[None]
    if downcast_smem_data:
        table, data_next = _downcast(table), _downcast(data_next)
    return MaskInfo(
        data_next=data_next, mask_next=None, block_mask=table, partial_mask_blocks=None, q_sequence=q_sequence
    )


@functools.lru_cache(maxsize=128)
def splash_mask(spec: Any) -> Any:
    """Splash's `MultiHeadMask` of `spec` (a `masks.MaskSpec`): one head, shared by every head. Cached, so that the
    kernels of one mask share its `mask_function` (a static argument of splash's kernels), as splash's own cached
    mask processing made them."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    shape = (spec.q_len, spec.kv_len)
    if spec.kind == "causal":
        mask = splash.CausalMask(shape, offset=spec.offset)
    elif spec.kind == "local":
        assert spec.window is not None
        mask = splash.LocalMask(shape, window_size=spec.window, offset=spec.offset)
    else:
        mask = splash.FullMask(shape)
    return splash.MultiHeadMask([mask])  # one head: every head shares it


def mask_infos(spec: Any, block_sizes: Any, *, downcast_smem_data: bool = True) -> MaskInfos:
    """Splash's forward, dQ and dK/dV `MaskInfo`s of the static mask `spec` (a `masks.MaskSpec`) for `block_sizes`
    (splash `BlockSizes`), as `make_splash_mha(MultiHeadMask([mask]), block_sizes=block_sizes, head_shards=1,
    q_seq_shards=1, downcast_smem_data=downcast_smem_data)` builds them, as NumPy arrays.

    Raises:
        ValueError: a block does not divide its padded length, or the mask hides every block.
    """
    mask = splash_mask(spec).masks[0]
    mask_function = getattr(mask, "mask_function", None)
    q_sequence = getattr(mask, "q_sequence", None)
    one = lambda shape, is_dkv, shrink=True: _one(
        spec, shape, is_dkv=is_dkv, shrink_grid=shrink, downcast_smem_data=downcast_smem_data, q_sequence=q_sequence
    )
    fwd = one((block_sizes.block_q, block_sizes.block_kv), False)
    dq = dkv = None
    if block_sizes.has_backward_blocks:
        if not block_sizes.use_fused_bwd_kernel:
            dq = one((block_sizes.block_q_dq, block_sizes.block_kv_dq), False)
        dkv = one((block_sizes.block_q_dkv, block_sizes.block_kv_dkv), True, not block_sizes.use_fused_bwd_kernel)
    return MaskInfos(fwd, dq, dkv, mask_function)


def splash_kernel(
    spec: Any,
    block_sizes: Any,
    *,
    save_residuals: bool,
    attn_logits_soft_cap: float | None,
    interpret: bool,
    downcast_smem_data: bool = True,
) -> Any:
    """The `SplashAttentionKernel` that `make_splash_mha(MultiHeadMask([mask]), block_sizes=block_sizes,
    save_residuals=..., attn_logits_soft_cap=..., head_shards=1, q_seq_shards=1, interpret=...)` builds for the
    static mask `spec`, its tables made by `mask_infos`. As there, the tables become `jnp` arrays (concrete: call it
    under `jax.ensure_compile_time_eval()` inside a trace)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    infos = mask_infos(spec, block_sizes, downcast_smem_data=downcast_smem_data)
    to_device = lambda info: None if info is None else jax.tree.map(jnp.array, info)
    return sk.SplashAttentionKernel(
        to_device(infos.fwd),
        to_device(infos.dq),
        to_device(infos.dkv),
        block_sizes=block_sizes,
        is_mqa=False,
        save_residuals=save_residuals,
        mask_value=sk.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=attn_logits_soft_cap,
        residual_checkpoint_name=None,
        mask_function=infos.mask_function,
        interpret=interpret,
    )
