"""Paged key/value caches: page gathering (and, later, the `PagedKVCache` pytree)."""

import jax
import jax.numpy as jnp


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Dense rows from a page pool.

    Args:
        pool: `[P, page_size, K, D]`.
        page_table: int `[B, pages_per_seq]`; key token `j` of row `b` is `pool[page_table[b, j // page_size],
            j % page_size]`. Entries outside `[0, P)` are clamped (their tokens must lie past the row's length).

    Returns:
        `[B, pages_per_seq * page_size, K, D]`.
    """
    B, pages_per_seq = page_table.shape
    _, page_size, K, D = pool.shape
    pages = jnp.take(pool, page_table.astype(jnp.int32), axis=0, mode="clip")  # [B, pps, page, K, D]
    return jnp.reshape(pages, (B, pages_per_seq * page_size, K, D))
