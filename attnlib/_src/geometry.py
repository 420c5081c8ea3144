"""The layout of a call (dense, THD, paged, ragged queries against a paged cache) and its sizes, from the shapes.

`check_shapes` reads the layout from which of `cu_seqlens_q` / `page_table` are given, checks the shapes it requires
of query, key and value (and the page table and page pools) and returns the `Geometry`; `packed_layout` checks the
THD layout's cumulative and maximum lengths. Messages in `validation`'s style (see `argument_checks`).
"""

import dataclasses
from typing import Any

import numpy as np

from . import argument_checks


def _check_cu_seqlens(name: str, cu: Any, num_tokens: int, tensor: str) -> None:
    argument_checks.require_int_array(name, cu)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"`{name}` must be 1-D with B+1 >= 2 cumulative sequence lengths. Got {name}.shape={tuple(cu.shape)}."
        )
    if argument_checks.is_concrete(cu):
        values = np.asarray(cu)
        if values[0] < 0 or np.any(np.diff(values) < 0) or values[-1] > num_tokens:
            raise ValueError(
                f"`{name}` must be non-decreasing, start at >= 0 and end at <= the {num_tokens} tokens of "
                f"`{tensor}`. Got {name}={values.tolist()}."
            )


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The layout of a call and its sizes (letters as in `attnlib.attention`'s docstring)."""

    layout: str
    batch_shape: tuple[int, ...]
    unbatched: bool
    T: int
    N: int
    H: int
    K: int
    Hv: int
    S: int
    page_size: int | None
    pages_per_seq: int | None
    num_pages: int | None
    num_sequences: int | None
    ragged_queries: bool = False
    kv_layout: str = "token_major"


def check_shapes(
    query: Any, key: Any, value: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any, page_table: Any,
    key_value_seq_lengths: Any, pool_layout: Any,
) -> Geometry:  # fmt: skip
    """The layout (dense, THD with `cu_seqlens_q`, paged with `page_table`, its queries ragged with both), the shapes
    it requires of query / key / value, and the paged cache's geometry."""
    got_qkv = f"Got query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}."
    if cu_seqlens_kv is not None and cu_seqlens_q is None:
        raise ValueError("`cu_seqlens_kv` requires `cu_seqlens_q` (THD layout). Got cu_seqlens_q=None.")
    ragged_queries = page_table is not None and cu_seqlens_q is not None
    if page_table is not None:
        layout = "paged"
    elif cu_seqlens_q is not None:
        layout = "thd"
    else:
        layout = "dense"
    if ragged_queries and cu_seqlens_kv is not None:
        raise ValueError(
            "`cu_seqlens_kv` cannot be combined with `page_table`: the cache's keys per sequence are "
            "`key_value_seq_lengths`. Got both."
        )

    if layout == "thd":
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.ndim != 3:
                raise ValueError(
                    f"With `cu_seqlens_q` (THD layout) `{name}` must be packed tokens of rank 3 "
                    f"([T, N, H] / [S, K, H] / [S, K, Hv]). {got_qkv}"
                )
        batch_shape: tuple[int, ...] = ()
    elif layout == "paged":
        if ragged_queries and query.ndim != 3:
            raise ValueError(
                "With `page_table` and `cu_seqlens_q` (ragged queries) `query` must be packed tokens of rank 3 "
                f"[T, N, H]. Got query.shape={tuple(query.shape)}."
            )
        if not ragged_queries and query.ndim != 4:
            raise ValueError(
                f"With `page_table` `query` must have rank 4 [B, T, N, H]. Got query.shape={tuple(query.shape)}."
            )
        for name, x in (("key", key), ("value", value)):
            if x.ndim != 4:
                raise ValueError(
                    f"With `page_table` `{name}` must be a page pool of rank 4 [P, page_size, K, H|Hv]. {got_qkv}"
                )
        if pool_layout is None and key.shape[:2] != value.shape[:2]:
            raise ValueError(
                "With `page_table` `key` and `value` pools must have the same [P, page_size]. " + got_qkv
            )
        batch_shape = () if ragged_queries else tuple(query.shape[:1])
    else:
        if query.ndim < 3:
            raise ValueError(
                f"`query` must have shape [*B, T, N, H] or [T, N, H] (rank >= 3). Got query.shape={tuple(query.shape)}."
            )
        if key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"`key` and `value` must have the same rank as `query`. {got_qkv}")
        if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
            raise ValueError(f"`query`, `key` and `value` must share the batch dims *B. {got_qkv}")
        batch_shape = tuple(query.shape[:-3])
    unbatched = layout == "dense" and query.ndim == 3

    T, N, H = (int(d) for d in query.shape[-3:])
    K, Hk = int(key.shape[-2]), int(key.shape[-1])
    Hv = int(value.shape[-1])
    kv_layout = "token_major"
    if pool_layout is not None:  # a PagedKVCache's pools: shapes from its layout, true head dims from its metadata
        kv_layout = pool_layout.name
        _, _, K = pool_layout.geometry(key)
        Hk, Hv = pool_layout.head_dim, pool_layout.value_head_dim
    if Hk != H:
        raise ValueError(f"`query` and `key` must have the same head dim H. Got H={H} and {Hk}. {got_qkv}")
    if pool_layout is None and value.shape[-2] != K:
        raise ValueError(f"`key` and `value` must have the same number of heads K. {got_qkv}")
    if layout != "paged" and key.shape[-3] != value.shape[-3]:
        raise ValueError(f"`key` and `value` must have the same length S. {got_qkv}")
    if K == 0 or N % K != 0:
        raise ValueError(
            f"`query` has N={N} heads but `key` has K={K}; N must be a multiple of K. "
            f"Got query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}."
        )
    if H == 0 or Hv == 0:
        raise ValueError(f"Head dims must be positive. {got_qkv}")

    page_size = pages_per_seq = num_pages = None
    num_sequences = None
    if layout == "paged":
        argument_checks.require_int_array("page_table", page_table)
        if ragged_queries:
            _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, "query")
            if page_table.ndim != 2 or page_table.shape[0] + 1 != cu_seqlens_q.shape[0]:
                raise ValueError(
                    "With ragged queries `page_table` must have shape [B, pages_per_seq] with one row per sequence "
                    f"of `cu_seqlens_q` (B={cu_seqlens_q.shape[0] - 1}). Got page_table.shape={tuple(page_table.shape)}."
                )
            batch_shape = tuple(page_table.shape[:1])  # for `key_value_seq_lengths` [B]
        elif page_table.ndim != 2 or page_table.shape[0] != query.shape[0]:
            raise ValueError(
                f"`page_table` must have shape [B, pages_per_seq] with B={query.shape[0]} rows (query's batch). "
                f"Got page_table.shape={tuple(page_table.shape)}."
            )
        if pool_layout is None:
            num_pages, page_size = int(key.shape[0]), int(key.shape[1])
        else:
            num_pages, page_size, _ = pool_layout.geometry(key)
        pages_per_seq = int(page_table.shape[1])
        num_sequences = int(page_table.shape[0])
        if key_value_seq_lengths is None:
            raise ValueError(
                "`page_table` needs `key_value_seq_lengths` (the number of valid cached tokens per sequence). "
                "Got key_value_seq_lengths=None."
            )
        if argument_checks.is_concrete(page_table):
            pt = np.asarray(page_table)
            if pt.size and (pt.min() < 0 or pt.max() >= num_pages):
                raise ValueError(
                    f"`page_table` entries must lie in [0, {num_pages}) (the P pages of the pool). "
                    f"Got entries in [{pt.min()}, {pt.max()}]."
                )
        S = pages_per_seq * page_size
    else:
        S = int(key.shape[-3])
    return Geometry(
        layout, batch_shape, unbatched, T, N, H, K, Hv, S, page_size, pages_per_seq, num_pages, num_sequences,
        ragged_queries, kv_layout,
    )


def packed_layout(
    g: Geometry, key: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any, max_seqlen_q: Any, max_seqlen_kv: Any,
    query_seq_lengths: Any, key_value_seq_lengths: Any, q_segment_ids: Any, kv_segment_ids: Any,
) -> tuple[int | None, int | None, int | None]:  # fmt: skip
    """THD: the cumulative lengths and the maximum sequence lengths. Returns `(num_sequences, max_q, max_kv)`."""
    layout, T, S, num_sequences = g.layout, g.T, g.S, g.num_sequences
    if layout == "thd":
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, "query")
        if cu_seqlens_kv is not None:
            _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, S, "key")
            if cu_seqlens_kv.shape != cu_seqlens_q.shape:
                raise ValueError(
                    "`cu_seqlens_q` and `cu_seqlens_kv` must describe the same number of sequences. "
                    f"Got cu_seqlens_q.shape={tuple(cu_seqlens_q.shape)}, "
                    f"cu_seqlens_kv.shape={tuple(cu_seqlens_kv.shape)}."
                )
        elif S != T:
            raise ValueError(
                f"Without `cu_seqlens_kv`, keys are packed like queries and `key` must have T={T} tokens. "
                f"Got key.shape={tuple(key.shape)}."
            )
        num_sequences = int(cu_seqlens_q.shape[0]) - 1
        for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths),
                        ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if x is not None:
                raise ValueError(
                    f"`{name}` cannot be combined with `cu_seqlens_q` (THD): sequence boundaries come from the "
                    "cumulative lengths. Got both."
                )
    if g.ragged_queries and query_seq_lengths is not None:
        raise ValueError(
            "`query_seq_lengths` cannot be combined with `cu_seqlens_q`: each sequence's queries are its rows of the "
            "cumulative lengths. Got both."
        )
    max_q = None if max_seqlen_q is None else argument_checks.require_positive_int("max_seqlen_q", max_seqlen_q)
    max_kv = None if max_seqlen_kv is None else argument_checks.require_positive_int("max_seqlen_kv", max_seqlen_kv)
    if (max_q is not None or max_kv is not None) and layout != "thd" and not g.ragged_queries:
        raise ValueError("`max_seqlen_q` / `max_seqlen_kv` apply only to the THD layout (with `cu_seqlens_q`).")
    if g.ragged_queries:
        if max_kv is not None:
            raise ValueError("`max_seqlen_kv` does not apply to a paged cache (its bound is the page table's width).")
        return num_sequences, T if max_q is None else max_q, None
    if layout == "thd":
        max_q = T if max_q is None else max_q
        max_kv = S if max_kv is None else max_kv
    return num_sequences, max_q, max_kv
