"""Paged key/value caches: page gathering and the `PagedKVCache` pytree."""

import dataclasses
import functools

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


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def _is_concrete(*xs) -> bool:
    return all(not isinstance(x, jax.core.Tracer) for x in xs)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_pages", "v_pages", "page_table", "lengths", "free_pages", "num_used_pages"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """A paged key/value cache: a pytree, so it works under `jit` and can be donated.

    Pages are handed out from a free list (`free_pages[num_used_pages:]` are still free) as sequences grow; a
    sequence's pages need not be contiguous or ordered. Attend over it with

    ```python
    out = attnlib.attention(q, cache.k_pages, cache.v_pages, page_table=cache.page_table,
                            key_value_seq_lengths=cache.lengths, is_causal=True,
                            diagonal_alignment="bottom_right")
    ```

    Attributes:
        k_pages: `[P, page_size, K, H]` key pool.
        v_pages: `[P, page_size, K, Hv]` value pool.
        page_table: int32 `[B, max_pages_per_seq]`; entries past a sequence's used pages are 0 (never read:
            they lie past its length).
        lengths: int32 `[B]` cached tokens per sequence.
        free_pages: int32 `[P]`, the allocation order of pages.
        num_used_pages: int32 scalar, pages handed out so far.
    """

    k_pages: jax.Array
    v_pages: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    free_pages: jax.Array
    num_used_pages: jax.Array

    @classmethod
    def create(
        cls,
        batch_size: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        value_head_dim: int | None = None,
        dtype=jnp.bfloat16,
        max_pages_per_seq: int | None = None,
    ) -> "PagedKVCache":
        """An empty cache.

        Args:
            batch_size: `B`, sequences in the cache.
            num_pages: `P`, pages in each pool.
            page_size: tokens per page.
            num_kv_heads: `K`.
            head_dim: `H`.
            value_head_dim: `Hv`. Defaults to `head_dim`.
            dtype: pool dtype. Defaults to bfloat16.
            max_pages_per_seq: page-table width. Defaults to `num_pages`.
        """
        for name, value in (("batch_size", batch_size), ("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int. Got {value!r}.")
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        max_pages_per_seq = num_pages if max_pages_per_seq is None else max_pages_per_seq
        for name, value in (("value_head_dim", value_head_dim), ("max_pages_per_seq", max_pages_per_seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{name}` must be a positive int. Got {value!r}.")
        return cls(
            k_pages=jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype),
            v_pages=jnp.zeros((num_pages, page_size, num_kv_heads, value_head_dim), dtype),
            page_table=jnp.zeros((batch_size, max_pages_per_seq), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            free_pages=jnp.arange(num_pages, dtype=jnp.int32),
            num_used_pages=jnp.zeros((), jnp.int32),
        )

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    def append(self, k_new: jax.Array, v_new: jax.Array, lengths: jax.Array | None = None) -> "PagedKVCache":
        """Write new tokens after each sequence's current length, taking pages from the free list.

        Args:
            k_new: `[B, T_new, K, H]`.
            v_new: `[B, T_new, K, Hv]`.
            lengths: int `[B]`: append only the first `lengths[b]` new tokens of sequence `b`. Defaults to all.

        Returns:
            The updated cache (the arrays are new; donate the old cache under `jit` to update in place).

        Raises:
            ValueError: bad shapes, or (with concrete values) the pool's `num_pages` or `max_pages_per_seq` is
                exhausted. Under `jit` the values are not known: a sequence whose tokens do not fit is left
                unchanged (its length does not grow) and no page is written — check `lengths`.
        """
        B, max_pages = self.page_table.shape
        P, page = self.num_pages, self.page_size
        k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
        if k_new.ndim != 4 or k_new.shape[0] != B or k_new.shape[2:] != self.k_pages.shape[2:]:
            raise ValueError(
                f"`k_new` must have shape [B, T_new, K, H] with B={B}, (K, H)={self.k_pages.shape[2:]}. "
                f"Got k_new.shape={k_new.shape}."
            )
        if v_new.shape[:3] != k_new.shape[:3] or v_new.shape[3:] != self.v_pages.shape[3:]:
            raise ValueError(
                f"`v_new` must have shape [B, T_new, K, Hv]={k_new.shape[:3] + self.v_pages.shape[3:]}. "
                f"Got v_new.shape={v_new.shape}."
            )
        T_new = k_new.shape[1]
        if lengths is None:
            count = jnp.full((B,), T_new, jnp.int32)
        else:
            count = jnp.asarray(lengths)
            if count.shape != (B,) or not jnp.issubdtype(count.dtype, jnp.integer):
                raise ValueError(f"`lengths` must be int [B]=({B},). Got shape {count.shape}, dtype {count.dtype}.")
            count = jnp.clip(count.astype(jnp.int32), 0, T_new)

        old_pages = _ceil_div(self.lengths, page)
        new_pages = _ceil_div(self.lengths + count, page)
        need = new_pages - old_pages
        offset = jnp.cumsum(need) - need
        fits = (self.num_used_pages + offset + need <= P) & (new_pages <= max_pages)
        if _is_concrete(fits) and not bool(jnp.all(fits)):
            raise ValueError(
                f"PagedKVCache.append: out of pages. The pool has `num_pages`={P} with "
                f"{int(P - self.num_used_pages)} free and the page table holds `max_pages_per_seq`={max_pages}; "
                f"appending {count.tolist()} tokens to lengths {self.lengths.tolist()} needs "
                f"{int(jnp.sum(need))} new pages and up to {int(jnp.max(new_pages))} pages per sequence."
            )
        # Sequences that do not fit take nothing: the prefix sums are recomputed without them.
        need = jnp.where(fits, need, 0)
        count = jnp.where(fits, count, 0)
        offset = jnp.cumsum(need) - need
        new_pages = old_pages + need

        slot = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
        is_new = (slot >= old_pages[:, None]) & (slot < new_pages[:, None])
        take = self.num_used_pages + offset[:, None] + slot - old_pages[:, None]
        allocated = self.free_pages[jnp.clip(take, 0, P - 1)]
        page_table = jnp.where(is_new, allocated, self.page_table)

        position = self.lengths[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None, :]  # [B, T_new]
        valid = jnp.arange(T_new)[None, :] < count[:, None]
        page_index = jnp.take_along_axis(page_table, jnp.clip(position // page, 0, max_pages - 1), axis=1)
        page_index = jnp.where(valid, page_index, P)  # out of range: dropped by the scatter
        within = position % page
        write = lambda pool, new: pool.at[page_index, within].set(new.astype(pool.dtype), mode="drop")
        return PagedKVCache(
            k_pages=write(self.k_pages, k_new),
            v_pages=write(self.v_pages, v_new),
            page_table=page_table,
            lengths=self.lengths + count,
            free_pages=self.free_pages,
            num_used_pages=self.num_used_pages + jnp.sum(need),
        )
