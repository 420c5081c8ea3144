"""What `attnlib.attention` reads from a paged key/value cache passed as `key`: the base class of `PagedKVCache`.

`attention` recognizes a cache by this class, so it needs no import of `paged.py`, whose `PagedKVCache.attend` calls
`attention`.
"""

from typing import TYPE_CHECKING

import jax


if TYPE_CHECKING:
    from .kv_layouts import PoolLayout


class PagedPools:
    """A paged key/value cache as `attnlib.attention(q, cache, None, ...)` reads it (`attnlib.PagedKVCache`).

    Attributes:
        pools: the pools in `pool_layout`: `(keys, values)`, or `(combined,)` for `"combined"`.
        page_table: int32 `[B, max_pages_per_seq]`.
        lengths: int32 `[B]` cached tokens per sequence.
        pool_layout: the pools' layout and true head dims.
    """

    pools: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    pool_layout: "PoolLayout"
