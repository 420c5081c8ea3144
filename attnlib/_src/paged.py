"""The `PagedKVCache` pytree: pools in a kernel's layout, page allocation from a free list, appends and releases."""

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from . import logs, positions
from .attention import attention
from .kv_layouts import default_layout, LayoutName, PoolLayout
from .paged_pools import PagedPools


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def _is_concrete(*xs) -> bool:
    return all(not isinstance(x, jax.core.Tracer) for x in xs)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["pools", "page_table", "lengths", "free_pages", "num_used_pages"],
    meta_fields=["pool_layout"],
)
@dataclasses.dataclass(frozen=True)
class PagedKVCache(PagedPools):
    """A paged key/value cache: a pytree, so it works under `jit` and can be donated.

    Pages are handed out from a free list (`free_pages[num_used_pages:]` are still free) as sequences grow and go
    back to it when a sequence is released; a sequence's pages need not be contiguous or ordered. The pools are
    held in the memory layout the paged kernel of the device reads (`layout`, chosen at `create`), so attending
    over the cache never copies them. Attend over it with

    ```python
    cache = cache.append(k_new, v_new)                       # the new tokens first: a query sees itself
    out = cache.attend(q)                                    # causal, bottom-right: the same as
    out = attnlib.attention(q, cache, None, is_causal=True, diagonal_alignment="bottom_right")
    ```

    The bare-array form `attnlib.attention(q, cache.k_pages, cache.v_pages, page_table=cache.page_table,
    key_value_seq_lengths=cache.lengths, ...)` means the same on every layout: `k_pages` / `v_pages` are token-major
    on every layout (a copy of the pools where the layout is another one, logged once).

    Attributes:
        pools: the pools in the cache's own layout: keys `[P, page_size, K, H]` and values `[P, page_size, K, Hv]`
            (`"token_major"`), `[K, P, page_size, H']` and `[K, P, page_size, Hv']` (`"head_major"`), or one pool of
            keys and values `[P, page_size, 2K, D']` (`"combined"`: keys at even, values at odd head slots); `H'`,
            `D'` padded to a multiple of 128 (docs/api/paged.md).
        page_table: int32 `[B, max_pages_per_seq]`; entries past a sequence's used pages are 0 (never read:
            they lie past its length).
        lengths: int32 `[B]` cached tokens per sequence.
        free_pages: int32 `[P]`, the allocation order of pages.
        num_used_pages: int32 scalar, pages handed out and not released.
        pool_layout: the layout and the true head dims (static metadata).
    """

    pools: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    free_pages: jax.Array
    num_used_pages: jax.Array
    pool_layout: PoolLayout

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
        layout: LayoutName | None = None,
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
            layout: the pools' memory layout, `"token_major"`, `"head_major"` or `"combined"`; None picks the
                one the fastest paged kernel of the default device reads (`"combined"` on a TPU, `"token_major"`
                elsewhere). Change it later with `to_layout` (a copy).
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
        pool_layout = PoolLayout(default_layout() if layout is None else layout, head_dim, value_head_dim)
        pools = tuple(jnp.zeros(shape, dtype) for shape in pool_layout.pool_shapes(num_pages, page_size, num_kv_heads))
        return cls(
            pools=pools,
            page_table=jnp.zeros((batch_size, max_pages_per_seq), jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            free_pages=jnp.arange(num_pages, dtype=jnp.int32),
            num_used_pages=jnp.zeros((), jnp.int32),
            pool_layout=pool_layout,
        )

    @property
    def layout(self) -> str:
        """The pools' memory layout: `"token_major"`, `"head_major"` or `"combined"`."""
        return self.pool_layout.name

    @property
    def page_size(self) -> int:
        return self.pool_layout.geometry(self.pools[0])[1]

    @property
    def num_pages(self) -> int:
        return self.pool_layout.geometry(self.pools[0])[0]

    @property
    def num_kv_heads(self) -> int:
        return self.pool_layout.geometry(self.pools[0])[2]

    @property
    def k_pages(self) -> jax.Array:
        """The keys as token-major pages `[P, page_size, K, H]` on every layout (`../shared/API.md`'s bare-array
        form); a copy where the layout is not `"token_major"`."""
        return self._token_major()[0]

    @property
    def v_pages(self) -> jax.Array:
        """The values as token-major pages `[P, page_size, K, Hv]` on every layout; a copy where the layout is not
        `"token_major"`."""
        return self._token_major()[1]

    def _token_major(self) -> tuple[jax.Array, jax.Array]:
        if self.pool_layout.name != "token_major":
            logs.log_once(
                ("PagedKVCache.token_major", self.pool_layout.name), logging.WARNING,
                "PagedKVCache.k_pages / v_pages of a %r cache are token-major copies of its pools, made on every "
                "access. Attend with cache.attend(q, ...) or attnlib.attention(q, cache, None, ...) to read the "
                "pools in place (cache.pools holds them in the cache's own layout).", self.pool_layout.name,
            )  # fmt: skip
        return self.pool_layout.to_token_major(self.pools)

    def _with_pools(self, pools: tuple[jax.Array, ...], **changes: Any) -> "PagedKVCache":
        return dataclasses.replace(self, pools=tuple(pools), **changes)

    def to_layout(self, layout: LayoutName) -> "PagedKVCache":
        """The same cache with its pools in `layout` (`"token_major"`, `"head_major"` or `"combined"`): a copy of
        both pools, the only place attnlib converts one. Page table, lengths and free list are unchanged."""
        target = PoolLayout(layout, self.pool_layout.head_dim, self.pool_layout.value_head_dim)
        if target == self.pool_layout:
            return self
        pools = target.from_token_major(*self.pool_layout.to_token_major(self.pools))
        return dataclasses.replace(self._with_pools(pools), pool_layout=target)

    def attend(self, query: jax.Array, **attention_kwargs: Any) -> Any:
        """`attnlib.attention(query, self, None, **attention_kwargs)` with `is_causal=True` and
        `diagonal_alignment="bottom_right"` unless given: each sequence's last query sits on its last cached key.

        Args:
            query: `[B, T, N, H]`, or THD `[T_total, N, H]` with `cu_seqlens_q` (int `[B + 1]`: sequence `b`'s
                queries are rows `cu_seqlens_q[b]:cu_seqlens_q[b + 1]`; a mixed batch of prefill chunks and
                single-token decodes).
            **attention_kwargs: any other keyword argument of `attnlib.attention`.

        Returns:
            What `attnlib.attention` returns: `[B, T, N, Hv]` (THD `[T_total, N, Hv]`) by default.
        """
        attention_kwargs.setdefault("is_causal", True)
        attention_kwargs.setdefault("diagonal_alignment", "bottom_right")
        return attention(query, self, None, **attention_kwargs)

    def append(
        self,
        k_new: jax.Array,
        v_new: jax.Array,
        lengths: jax.Array | None = None,
        *,
        cu_seqlens: jax.Array | None = None,
    ) -> "PagedKVCache":
        """Write new tokens after each sequence's current length, taking pages from the free list.

        Args:
            k_new: `[B, T_new, K, H]`; with `cu_seqlens`, packed tokens `[T_total, K, H]`.
            v_new: `[B, T_new, K, Hv]`; with `cu_seqlens`, `[T_total, K, Hv]`.
            lengths: int `[B]`: append only the first `lengths[b]` new tokens of sequence `b`. Defaults to all.
            cu_seqlens: int `[B + 1]`: the new tokens of sequence `b` are rows `cu_seqlens[b]:cu_seqlens[b + 1]` of
                `k_new` / `v_new` (a ragged chunk: some sequences prefill, some decode one token, some take none);
                rows past `cu_seqlens[-1]` are padding and not written.

        Returns:
            The updated cache (the arrays are new; donate the old cache under `jit` to update in place).

        Raises:
            ValueError: bad shapes, or (with concrete values) the pool's `num_pages` or `max_pages_per_seq` is
                exhausted. Under `jit` the values are not known: a sequence whose tokens do not fit is left
                unchanged (its length does not grow) and no page is written — check `lengths`.
        """
        B, max_pages = self.page_table.shape
        P, page, K = self.num_pages, self.page_size, self.num_kv_heads
        H, Hv = self.pool_layout.head_dim, self.pool_layout.value_head_dim
        k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
        if cu_seqlens is None:
            if k_new.ndim != 4 or k_new.shape[0] != B or k_new.shape[2:] != (K, H):
                raise ValueError(
                    f"`k_new` must have shape [B, T_new, K, H] with B={B}, (K, H)={(K, H)}. Got k_new.shape={k_new.shape}."
                )
            if v_new.shape != k_new.shape[:3] + (Hv,):
                raise ValueError(
                    f"`v_new` must have shape [B, T_new, K, Hv]={k_new.shape[:3] + (Hv,)}. Got v_new.shape={v_new.shape}."
                )
            T_new = k_new.shape[1]
            if lengths is None:
                count = jnp.full((B,), T_new, jnp.int32)
            else:
                count = jnp.asarray(lengths)
                if count.shape != (B,) or not jnp.issubdtype(count.dtype, jnp.integer):
                    raise ValueError(
                        f"`lengths` must be int [B]=({B},). Got shape {count.shape}, dtype {count.dtype}."
                    )
                count = jnp.clip(count.astype(jnp.int32), 0, T_new)
            sequence = jnp.repeat(jnp.arange(B, dtype=jnp.int32), T_new)
            offset = jnp.tile(jnp.arange(T_new, dtype=jnp.int32), B)
            k_tokens = jnp.reshape(k_new, (B * T_new, K, H))
            v_tokens = jnp.reshape(v_new, (B * T_new, K, Hv))
        else:
            if lengths is not None:
                raise ValueError("`lengths` and `cu_seqlens` cannot be combined (cu_seqlens gives the counts). Got both.")
            if k_new.ndim != 3 or k_new.shape[1:] != (K, H):
                raise ValueError(
                    f"With `cu_seqlens`, `k_new` must be packed tokens [T_total, K, H] with (K, H)={(K, H)}. "
                    f"Got k_new.shape={k_new.shape}."
                )
            if v_new.shape != k_new.shape[:2] + (Hv,):
                raise ValueError(
                    f"With `cu_seqlens`, `v_new` must have shape [T_total, K, Hv]={k_new.shape[:2] + (Hv,)}. "
                    f"Got v_new.shape={v_new.shape}."
                )
            sequence, offset, count = _ragged_tokens(cu_seqlens, B, k_new.shape[0])
            k_tokens, v_tokens = k_new, v_new

        old_pages = _ceil_div(self.lengths, page)
        new_pages = _ceil_div(self.lengths + count, page)
        need = new_pages - old_pages
        first = jnp.cumsum(need) - need
        fits = (self.num_used_pages + first + need <= P) & (new_pages <= max_pages)
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
        first = jnp.cumsum(need) - need
        new_pages = old_pages + need

        slot = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
        is_new = (slot >= old_pages[:, None]) & (slot < new_pages[:, None])
        take = self.num_used_pages + first[:, None] + slot - old_pages[:, None]
        allocated = self.free_pages[jnp.clip(take, 0, P - 1)]
        page_table = jnp.where(is_new, allocated, self.page_table)

        row = jnp.clip(sequence, 0, B - 1)
        position = self.lengths[row] + offset  # [T_tokens]
        valid = (sequence >= 0) & (offset < count[row])
        page_index = page_table[row, jnp.clip(position // page, 0, max_pages - 1)]
        page_index = jnp.where(valid, page_index, P)  # out of range: dropped by the scatter
        pools = self.pool_layout.write(self.pools, page_index, position % page, k_tokens, v_tokens)
        return self._with_pools(
            pools,
            page_table=page_table,
            lengths=self.lengths + count,
            num_used_pages=self.num_used_pages + jnp.sum(need, dtype=jnp.int32),  # int32 under x64 too
        )

    def release(self, done: jax.Array) -> "PagedKVCache":
        """Free finished sequences: their pages go back to the free list, their lengths and page-table rows to 0.

        The slot can then take a new sequence (continuous batching). Pool contents are not cleared (pages past a
        sequence's length are never read).

        Args:
            done: bool `[B]`: the sequences to release.

        Returns:
            The updated cache.
        """
        B, max_pages = self.page_table.shape
        done = jnp.asarray(done)
        if done.shape != (B,) or done.dtype != jnp.bool_:
            raise ValueError(f"`done` must be bool [B]=({B},). Got shape {done.shape}, dtype {done.dtype}.")
        held = jnp.where(done, _ceil_div(self.lengths, self.page_size), 0)  # [B]
        released = jnp.sum(held, dtype=jnp.int32)
        first = jnp.cumsum(held) - held
        slot = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
        # The free list is a stack: `free_pages[num_used_pages:]` are free. Released pages go just below its top.
        where = self.num_used_pages - released + first[:, None] + slot
        where = jnp.where(slot < held[:, None], where, self.num_pages)  # out of range: dropped
        free_pages = self.free_pages.at[where].set(self.page_table, mode="drop")
        return dataclasses.replace(
            self,
            page_table=jnp.where(done[:, None], 0, self.page_table),
            lengths=jnp.where(done, 0, self.lengths),
            free_pages=free_pages,
            num_used_pages=self.num_used_pages - released,
        )


def _ragged_tokens(cu_seqlens: Any, batch: int, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For packed new tokens: each token's sequence (-1 for padding), its offset in the sequence's chunk, and the
    chunk length per sequence `[B]`."""
    cu = jnp.asarray(cu_seqlens)
    if cu.shape != (batch + 1,) or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(
            f"`cu_seqlens` must be int [B + 1]=({batch + 1},) (B = the cache's sequences). "
            f"Got shape {cu.shape}, dtype {cu.dtype}."
        )
    cu = cu.astype(jnp.int32)
    if _is_concrete(cu):
        values = [int(c) for c in cu.tolist()]
        if values[0] < 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > num_tokens:
            raise ValueError(
                f"`cu_seqlens` must be non-decreasing from >= 0 to at most the {num_tokens} tokens given. Got {values}."
            )
    tokens = positions.packed_tokens(cu, num_tokens)
    return jnp.where(tokens.inside, tokens.sequence, -1), tokens.offset, jnp.maximum(cu[1:] - cu[:-1], 0)
