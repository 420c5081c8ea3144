"""Argument checks for `attnlib.attention`: every rule, one message style, at trace time.

Messages name the argument in backticks, say what was required, and end with what was given
("… Got query.shape=(2, 7, 6, 8)."). Shapes and values raise `ValueError`, dtypes and kinds `TypeError`.
Checks look only at shapes and dtypes (so `jax.ShapeDtypeStruct`s work), except the few structural value checks
on concrete (non-traced) `cu_seqlens` and `page_table` arrays.
"""

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import band, fp8 as fp8_lib, modifiers as modifiers_lib, precision, varying
from .config import AttentionConfig, AttentionInputs


_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def _require_int_array(name: str, x: Any) -> None:
    if not _is_int(x.dtype):
        raise TypeError(f"`{name}` must have an integer dtype. Got {name}.dtype={x.dtype}.")


def int_array(name: str, x: Any, shape: tuple[int, ...], meaning: str) -> jax.Array:
    """`x` as an int32 array of `shape` (`meaning` names its axes in the message), or a `TypeError` / `ValueError`
    naming `name`."""
    x = jnp.asarray(x)
    _require_int_array(name, x)
    _require_shape(name, x, shape, meaning)
    return x.astype(jnp.int32)


def _require_shape(name: str, x: Any, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"`{name}` must have shape {meaning}={tuple(expected)}. Got {name}.shape={tuple(x.shape)}.")


def require_bool(name: str, value: Any) -> None:
    """A `TypeError` naming `name` unless `value` is a Python (or NumPy) bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a Python bool. Got {value!r} of type {type(value).__name__}.")


def require_positive_int(name: str, value: Any) -> int:
    """`value` as an int, or a `ValueError` naming `name` when it is not a positive Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive Python int. Got {value!r}.")
    return int(value)


def _is_concrete(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def _check_broadcastable(name: str, x: Any, target: tuple[int, ...], meaning: str) -> None:
    shape = tuple(x.shape)
    ok = len(shape) <= len(target) and all(
        d == 1 or d == t for d, t in zip(shape[::-1], target[::-1], strict=False)
    )
    if not ok:
        raise ValueError(
            f"`{name}` must be broadcastable to {meaning}={target}. Got {name}.shape={shape}."
        )


def _fp8(fp8: Any, query: Any, key: Any, value: Any) -> tuple[str | None, fp8_lib.Fp8Scales | None]:
    """`(mode, scales)` of the `fp8` argument: None, `"current"` or an `Fp8Scales` for float8_e4m3fn inputs."""
    if fp8 is None:
        return None, None
    if isinstance(fp8, str) and fp8 == "current":
        if query.dtype == jnp.float64:
            raise TypeError("`fp8='current'` quantizes float16, bfloat16 or float32 inputs. Got query.dtype=float64.")
        return "current", None
    if not isinstance(fp8, fp8_lib.Fp8Scales):
        raise ValueError(f"`fp8` must be None, 'current' or an attnlib.Fp8Scales. Got fp8={fp8!r}.")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dtype != fp8_lib.E4M3:
            raise TypeError(
                f"`{name}` must have dtype float8_e4m3fn with fp8=Fp8Scales(...) (use fp8='current' to quantize "
                f"16-bit inputs). Got {name}.dtype={x.dtype}."
            )
    for field in ("q", "k", "v"):
        scale = getattr(fp8, field)
        shape = tuple(getattr(scale, "shape", np.shape(scale)))
        dtype = getattr(scale, "dtype", np.asarray(scale).dtype)
        if shape not in ((), (1,)) or not _is_float(dtype):
            raise ValueError(
                f"`fp8.{field}` must be a float scalar (shape () or (1,)). Got shape {shape}, dtype {dtype}."
            )
    if np.dtype(fp8.output_dtype) not in [np.dtype(d) for d in _FLOAT_DTYPES[:3]]:
        raise TypeError(
            f"`fp8.output_dtype` must be float16, bfloat16 or float32. Got output_dtype={fp8.output_dtype!r}."
        )
    return "scaled", fp8


def require_alignment(diagonal_alignment: Any) -> None:
    """A `ValueError` naming `diagonal_alignment` unless it is 'top_left' or 'bottom_right'."""
    if diagonal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"`diagonal_alignment` must be 'top_left' or 'bottom_right'. Got {diagonal_alignment!r}."
        )


def require_sinks(sinks: Any, num_q_heads: int) -> None:
    """A `TypeError` / `ValueError` naming `sinks` unless it is a float array of shape `[N]=(num_q_heads,)`."""
    if not _is_float(sinks.dtype):
        raise TypeError(f"`sinks` must have a floating dtype. Got sinks.dtype={sinks.dtype}.")
    _require_shape("sinks", sinks, (num_q_heads,), "[N]")


def parse_window(local_window_size: Any) -> tuple[int, int] | None:
    """`local_window_size` as `(left, right)` (None stays None); a `ValueError` naming it when it is not a
    non-negative int or a pair of them."""
    if local_window_size is None:
        return None
    is_count = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0
    if is_count(local_window_size):
        return int(local_window_size), int(local_window_size)
    if (
        isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(is_count(v) for v in local_window_size)
    ):
        return int(local_window_size[0]), int(local_window_size[1])
    raise ValueError(
        "`local_window_size` must be a non-negative int or a pair (left, right) of non-negative ints. "
        f"Got {local_window_size!r}."
    )


def _check_cu_seqlens(name: str, cu: Any, num_tokens: int, tensor: str) -> None:
    _require_int_array(name, cu)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"`{name}` must be 1-D with B+1 >= 2 cumulative sequence lengths. Got {name}.shape={tuple(cu.shape)}."
        )
    if _is_concrete(cu):
        values = np.asarray(cu)
        if values[0] < 0 or np.any(np.diff(values) < 0) or values[-1] > num_tokens:
            raise ValueError(
                f"`{name}` must be non-decreasing, start at >= 0 and end at <= the {num_tokens} tokens of "
                f"`{tensor}`. Got {name}={values.tolist()}."
            )


@dataclasses.dataclass(frozen=True)
class _Geometry:
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


def validate(
    query: Any,
    key: Any,
    value: Any,
    bias: Any,
    mask: Any,
    *,
    scale: Any,
    is_causal: Any,
    query_seq_lengths: Any,
    key_value_seq_lengths: Any,
    local_window_size: Any,
    return_residual: Any,
    diagonal_alignment: Any,
    q_segment_ids: Any,
    kv_segment_ids: Any,
    max_segments_per_row: Any,
    cu_seqlens_q: Any,
    cu_seqlens_kv: Any,
    max_seqlen_q: Any,
    max_seqlen_kv: Any,
    page_table: Any,
    logits_soft_cap: Any,
    sinks: Any,
    dropout_rate: Any,
    dropout_key: Any,
    deterministic_backward: Any,
    score_mod: Any = None,
    mask_mod: Any = None,
    score_mod_args: Any = (),
    fp8: Any = None,
    return_max_logit: bool = False,
    pool_layout: Any = None,
) -> tuple[AttentionConfig, AttentionInputs]:
    """Check every argument of `attention` and describe the call statically.

    Array arguments may be arrays or `jax.ShapeDtypeStruct`s; `pool_layout` is a `PagedKVCache`'s layout (None:
    token-major page pools, or no cache). Returns the static configuration and the arrays. Each group of arguments
    has its own check below; a new option goes into the group it belongs to (or a new one).
    """
    fp8_mode, fp8_scales = _qkv_dtypes(query, key, value, fp8)
    g = _geometry(query, key, value, cu_seqlens_q, cu_seqlens_kv, page_table, key_value_seq_lengths, pool_layout)
    num_sequences, max_q, max_kv = _packed_layout(
        g, key, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
        query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids,
    )  # fmt: skip
    _padding_lengths(g, query_seq_lengths, key_value_seq_lengths)
    max_segments_per_row = _segments(g, q_segment_ids, kv_segment_ids, max_segments_per_row)
    _bias_and_mask(g, bias, mask)
    score_mod_args, modifiers = _modifiers(g, score_mod, mask_mod, score_mod_args)
    scale, window = _scalars(
        g, scale, is_causal, return_residual, deterministic_backward, diagonal_alignment, local_window_size,
        logits_soft_cap, sinks, dropout_rate, dropout_key,
    )  # fmt: skip
    if fp8_mode is not None and not isinstance(scale, float):
        raise NotImplementedError(
            "`scale` as an array (traced or learned) together with FP8 attention (`fp8=`) is not supported; pass a "
            "Python float."
        )
    if fp8_mode is not None and dropout_rate > 0:
        raise NotImplementedError(
            f"dropout together with FP8 attention (`fp8=`) is not supported. Got dropout_rate={dropout_rate}."
        )

    if g.ragged_queries:
        _ragged_paged_limits(bias, mask, score_mod_args, dropout_rate)
    if not g.ragged_queries and band.causal_mask_is_a_no_op(is_causal, diagonal_alignment, g.T, g.layout, q_segment_ids):
        is_causal = False
    config = AttentionConfig(
        layout=g.layout,
        batch_shape=() if g.ragged_queries else g.batch_shape,
        unbatched=g.unbatched,
        q_len=g.T,
        kv_len=g.S,
        num_q_heads=g.N,
        num_kv_heads=g.K,
        head_dim=g.H,
        value_head_dim=g.Hv,
        dtype=np.dtype(query.dtype),
        scale=scale if isinstance(scale, float) else None,
        is_causal=bool(is_causal),
        diagonal_alignment=diagonal_alignment,
        window=window,
        bias_shape=None if bias is None else tuple(bias.shape),
        mask_shape=None if mask is None else tuple(mask.shape),
        has_q_lengths=query_seq_lengths is not None,
        has_kv_lengths=key_value_seq_lengths is not None,
        has_segments=q_segment_ids is not None,
        separate_kv_structure=kv_segment_ids is not None or cu_seqlens_kv is not None,
        max_segments_per_row=max_segments_per_row,
        num_sequences=num_sequences,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        page_size=g.page_size,
        pages_per_seq=g.pages_per_seq,
        num_pages=g.num_pages,
        logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
        has_sinks=sinks is not None,
        dropout_rate=float(dropout_rate),
        return_residual=bool(return_residual),
        deterministic_backward=bool(deterministic_backward),
        modifiers=modifiers,
        fp8=fp8_mode,
        fp8_output_dtype=None if fp8_scales is None else np.dtype(fp8_scales.output_dtype),
        max_logit=bool(return_max_logit),
        typed_varying=bool(varying.union_axes(query, key, value)),
        matmul_precision=precision.requested(),
        ragged_queries=g.ragged_queries,
        kv_layout=g.kv_layout,
    )
    inputs = AttentionInputs(
        query=query,
        key=key,
        value=value,
        bias=bias,
        mask=mask,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_kv=cu_seqlens_kv,
        page_table=page_table,
        sinks=sinks,
        dropout_key=dropout_key,
        score_mod_args=score_mod_args,
        fp8_scales=fp8_scales,
        scale=None if isinstance(scale, float) else scale,
    )
    return config, inputs


def _qkv_dtypes(query: Any, key: Any, value: Any, fp8: Any) -> tuple[str | None, fp8_lib.Fp8Scales | None]:
    """`query`, `key`, `value` share one float dtype (E4M3 only with `fp8=Fp8Scales`); the FP8 mode and scales."""
    fp8_mode, fp8_scales = _fp8(fp8, query, key, value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if fp8_mode == "scaled":
            continue
        if x.dtype == fp8_lib.E4M3:
            raise TypeError(
                f"`{name}` of dtype float8_e4m3fn needs `fp8=attnlib.Fp8Scales(q=..., k=..., v=...)` (the "
                f"dequantization scales). Got {name}.dtype={x.dtype} with fp8={fp8!r}."
            )
        if not _is_float(x.dtype) or x.dtype not in _FLOAT_DTYPES:
            raise TypeError(
                f"`{name}` must have dtype float16, bfloat16, float32 or float64. Got {name}.dtype={x.dtype}."
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "`query`, `key` and `value` must share one dtype. "
            f"Got query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}."
        )
    return fp8_mode, fp8_scales


def _geometry(
    query: Any, key: Any, value: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any, page_table: Any,
    key_value_seq_lengths: Any, pool_layout: Any,
) -> _Geometry:  # fmt: skip
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
        _require_int_array("page_table", page_table)
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
        if _is_concrete(page_table):
            pt = np.asarray(page_table)
            if pt.size and (pt.min() < 0 or pt.max() >= num_pages):
                raise ValueError(
                    f"`page_table` entries must lie in [0, {num_pages}) (the P pages of the pool). "
                    f"Got entries in [{pt.min()}, {pt.max()}]."
                )
        S = pages_per_seq * page_size
    else:
        S = int(key.shape[-3])
    return _Geometry(
        layout, batch_shape, unbatched, T, N, H, K, Hv, S, page_size, pages_per_seq, num_pages, num_sequences,
        ragged_queries, kv_layout,
    )


def _packed_layout(
    g: _Geometry, key: Any, cu_seqlens_q: Any, cu_seqlens_kv: Any, max_seqlen_q: Any, max_seqlen_kv: Any,
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
    max_q = None if max_seqlen_q is None else require_positive_int("max_seqlen_q", max_seqlen_q)
    max_kv = None if max_seqlen_kv is None else require_positive_int("max_seqlen_kv", max_seqlen_kv)
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


def _ragged_paged_limits(bias: Any, mask: Any, score_mod_args: Any, dropout_rate: Any) -> None:
    """What ragged queries against a paged cache (`cu_seqlens_q` with `page_table`) do not take: a
    `NotImplementedError` naming it."""
    for name, given in (("`bias`", bias is not None), ("`mask`", mask is not None),
                        ("`score_mod_args`", bool(score_mod_args)), ("dropout", dropout_rate > 0)):  # fmt: skip
        if given:
            raise NotImplementedError(
                f"{name} with ragged queries against a paged KV cache (`cu_seqlens_q` with `page_table`) is not "
                "supported: pass the queries as [B, T, N, H] with `query_seq_lengths` for it."
            )


def _padding_lengths(g: _Geometry, query_seq_lengths: Any, key_value_seq_lengths: Any) -> None:
    """Padding lengths: int `[*B]` in [0, T] / [0, S] (checked when concrete; traced values are clamped)."""
    batch_shape, T, S = g.batch_shape, g.T, g.S
    for name, x, limit, letter in (
        ("query_seq_lengths", query_seq_lengths, T, "T"),
        ("key_value_seq_lengths", key_value_seq_lengths, S, "S"),
    ):
        if x is not None:
            _require_int_array(name, x)
            _require_shape(name, x, batch_shape, "*B")
            if _is_concrete(x):
                values = np.asarray(x)
                outside = (values < 0) | (values > limit)
                if outside.any():
                    index = tuple(int(i) for i in np.argwhere(outside)[0])
                    raise ValueError(
                        f"`{name}` must be in [0, {letter}={limit}]. Got {name}{list(index)}={int(values[index])} "
                        f"({name}={values.tolist()})."
                    )


def _segments(g: _Geometry, q_segment_ids: Any, kv_segment_ids: Any, max_segments_per_row: Any) -> int | None:
    """Packed rows: segment ids `[*B, T]` / `[*B, S]` and their bound. Returns `max_segments_per_row`."""
    layout, batch_shape, T, S = g.layout, g.batch_shape, g.T, g.S
    if kv_segment_ids is not None and q_segment_ids is None:
        raise ValueError("`kv_segment_ids` requires `q_segment_ids`. Got q_segment_ids=None.")
    if q_segment_ids is not None:
        if layout == "paged":
            raise ValueError("`q_segment_ids` cannot be combined with `page_table`. Got both.")
        _require_int_array("q_segment_ids", q_segment_ids)
        _require_shape("q_segment_ids", q_segment_ids, batch_shape + (T,), "[*B, T]")
        if kv_segment_ids is not None:
            _require_int_array("kv_segment_ids", kv_segment_ids)
            _require_shape("kv_segment_ids", kv_segment_ids, batch_shape + (S,), "[*B, S]")
        elif S != T:
            raise ValueError(
                f"Without `kv_segment_ids`, keys reuse `q_segment_ids`, so S must equal T. Got T={T}, S={S}."
            )
    if max_segments_per_row is not None:
        max_segments_per_row = require_positive_int("max_segments_per_row", max_segments_per_row)
        if q_segment_ids is None:
            raise ValueError("`max_segments_per_row` needs `q_segment_ids`. Got q_segment_ids=None.")
    return max_segments_per_row


def _bias_and_mask(g: _Geometry, bias: Any, mask: Any) -> None:
    """`bias` (float) and `mask` (bool) broadcastable to `[*B, N, T, S]`."""
    batch_shape, N, T, S = g.batch_shape, g.N, g.T, g.S
    target = batch_shape + (N, T, S)
    if bias is not None:
        if not _is_float(bias.dtype):
            raise TypeError(f"`bias` must have a floating dtype. Got bias.dtype={bias.dtype}.")
        _check_broadcastable("bias", bias, target, "[*B, N, T, S]")
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(f"`mask` must be boolean (True = may attend). Got mask.dtype={mask.dtype}.")
        _check_broadcastable("mask", mask, target, "[*B, N, T, S]")


def _modifiers(g: _Geometry, score_mod: Any, mask_mod: Any, score_mod_args: Any) -> tuple[tuple, Any]:
    """`score_mod` / `mask_mod`, traced once on scalars; each argument broadcastable like `bias`. Returns the
    arguments as arrays and the modifiers' description."""
    layout, batch_shape, N, T, S = g.layout, g.batch_shape, g.N, g.T, g.S
    target = batch_shape + (N, T, S)
    score_mod_args = modifiers_lib.as_arrays(score_mod_args)
    modifiers = modifiers_lib.describe(score_mod, mask_mod, score_mod_args)
    args_meaning = "[N, T, S]" if layout == "thd" else "[*B, N, T, S]"
    for i, arg in enumerate(score_mod_args):
        _check_broadcastable(f"score_mod_args[{i}]", arg, target, args_meaning)
    return score_mod_args, modifiers


def _scalars(
    g: _Geometry, scale: Any, is_causal: Any, return_residual: Any, deterministic_backward: Any,
    diagonal_alignment: Any, local_window_size: Any, logits_soft_cap: Any, sinks: Any, dropout_rate: Any,
    dropout_key: Any,
) -> tuple[Any, tuple[int, int] | None]:  # fmt: skip
    """Scalars and flags, the window and `sinks` `[N]`. Returns the scale (default `1/sqrt(H)`; a 0-d array as given)
    and the window."""
    H, N = g.H, g.N
    scale = _scale(scale, H)
    require_bool("is_causal", is_causal)
    require_bool("return_residual", return_residual)
    require_bool("deterministic_backward", deterministic_backward)
    require_alignment(diagonal_alignment)
    window = parse_window(local_window_size)
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, numbers.Real)
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(f"`logits_soft_cap` must be a positive finite float. Got {logits_soft_cap!r}.")
    if sinks is not None:
        require_sinks(sinks, N)
    if (
        isinstance(dropout_rate, bool)
        or not isinstance(dropout_rate, numbers.Real)
        or not (0.0 <= dropout_rate < 1.0)
    ):
        raise ValueError(f"`dropout_rate` must be a float in [0, 1). Got {dropout_rate!r}.")
    if dropout_rate > 0 and dropout_key is None:
        raise ValueError(f"`dropout_rate`={dropout_rate} > 0 needs a `dropout_key`. Got dropout_key=None.")
    return scale, window


def _scale(scale: Any, H: int) -> Any:
    """`scale`: None (`1/sqrt(H)`), a finite real number (static: baked into graphs) or a 0-d float array, traced or
    not (a runtime scale: one graph for every value, differentiable). Returns the float or the array."""
    if scale is None:
        return 1.0 / math.sqrt(H)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"`scale` must be a float or a 0-d float array, not a bool. Got {scale!r}.")
    if isinstance(scale, numbers.Real):
        if not math.isfinite(scale):
            raise ValueError(f"`scale` must be finite. Got {scale!r}.")
        return float(scale)
    shape, dtype = getattr(scale, "shape", None), getattr(scale, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"`scale` must be a float or a 0-d float array. Got {type(scale).__name__} {scale!r}.")
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype) == fp8_lib.E4M3:
        raise TypeError(
            f"`scale` must be a float or a 0-d float array (float16/bfloat16/float32/float64). Got dtype={dtype}."
        )
    if tuple(shape) != ():
        raise ValueError(f"`scale` must be a scalar: a 0-d array, shape (). Got shape={tuple(shape)}.")
    if isinstance(scale, np.ndarray | np.generic) or (
        isinstance(scale, jax.Array) and not isinstance(scale, jax.core.Tracer)
    ):
        if not math.isfinite(float(scale)):
            raise ValueError(f"`scale` must be finite. Got {scale!r}.")
    return scale
