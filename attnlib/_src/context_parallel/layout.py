"""Context parallelism: the load-balanced token layout (`reorder` / `restore`, the "dual chunk" order)."""

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import argument_checks


# ----------------------------------------------------------------------------------------------------------------
# Load-balanced layout


def _chunk_order(num_shards: int) -> np.ndarray:
    """Global chunk index of each load-balanced slot: device r holds chunks r and 2D-1-r."""
    D = num_shards
    return np.array([c for r in range(D) for c in (r, 2 * D - 1 - r)], np.int32)


def _permute_chunks(x: Any, num_shards: Any, axis: int, name: str, inverse: bool) -> jax.Array:
    x = jnp.asarray(x)
    D = argument_checks.require_positive_int("num_shards", num_shards)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"`axis` must be an int in [-{x.ndim}, {x.ndim}) for `x` of rank {x.ndim}. Got {axis!r}.")
    ax = axis % x.ndim
    L = x.shape[ax]
    if L % (2 * D):
        raise ValueError(
            f"`{name}` splits the sequence axis into 2 * num_shards = {2 * D} equal chunks, so its length must be "
            f"a multiple of {2 * D}. Got x.shape={tuple(x.shape)}, axis={axis}, num_shards={D}."
        )
    order = _chunk_order(D)
    if inverse:
        order = np.argsort(order).astype(np.int32)
    chunks = jnp.reshape(x, x.shape[:ax] + (2 * D, L // (2 * D)) + x.shape[ax + 1 :])
    return jnp.reshape(jnp.take(chunks, order, axis=ax), x.shape)


def reorder(x: Any, num_shards: int, axis: int = -3) -> jax.Array:
    """Global token order -> the load-balanced order that `attention(..., load_balanced=True)` expects.

    The sequence is cut into `2 * num_shards` equal chunks and laid out so that shard `r` (the `r`-th contiguous
    slice after sharding) holds chunks `r` and `2 * num_shards - 1 - r`: under a causal mask every shard then
    has the same amount of work. With `num_shards=4` and 16 tokens the order is
    `[0 1 | 14 15 | 2 3 | 12 13 | 4 5 | 10 11 | 6 7 | 8 9]`.

    Args:
        x: array whose axis `axis` is the sequence: `[*B, T, N, H]` with `axis=-3` (the default) for queries,
            keys, values and outputs; `[*B, T]` with `axis=-1` for segment ids.
        num_shards: the size `D` of the mesh axis the sequence will be sharded over.
        axis: the sequence axis. Defaults to -3.

    Returns:
        `x` with its sequence axis permuted (same shape and dtype).

    Raises:
        ValueError: the sequence length is not a multiple of `2 * num_shards`, or `num_shards` / `axis` is
            invalid.
    """
    return _permute_chunks(x, num_shards, axis, "reorder", inverse=False)


def restore(x: Any, num_shards: int, axis: int = -3) -> jax.Array:
    """The inverse of `reorder`: load-balanced order -> global token order.

    Args:
        x: array in the load-balanced order along `axis` (e.g. the output of `attention`).
        num_shards: the `num_shards` given to `reorder`.
        axis: the sequence axis. Defaults to -3 (`axis=-1` for segment ids and for `lse` `[*B, T, N]` use -2).

    Returns:
        `x` in global token order.

    Raises:
        ValueError: the sequence length is not a multiple of `2 * num_shards`, or `num_shards` / `axis` is
            invalid.
    """
    return _permute_chunks(x, num_shards, axis, "restore", inverse=True)
