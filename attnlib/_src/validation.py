"""Argument checks for `attnlib.attention`: every rule, one message style, at trace time.

`validate` runs the checks of each argument group (`geometry`: the layout and shapes; `feature_checks`: dtypes, FP8,
lengths, segments, bias and mask, modifiers, scalars; both built on `argument_checks`), the rules that tie groups
together, and describes the call as an `AttentionConfig` and its `AttentionInputs`.

Messages name the argument in backticks, say what was required, and end with what was given
("… Got query.shape=(2, 7, 6, 8)."). Shapes and values raise `ValueError`, dtypes and kinds `TypeError`.
Checks look only at shapes and dtypes (so `jax.ShapeDtypeStruct`s work), except the few structural value checks
on concrete (non-traced) `cu_seqlens` and `page_table` arrays.
"""

from typing import Any

import numpy as np

from . import band, feature_checks as checks, geometry, precision, varying
from .config import AttentionConfig, AttentionInputs


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
    fp8_mode, fp8_scales = checks.qkv_dtypes(query, key, value, fp8)
    g = geometry.check_shapes(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, page_table, key_value_seq_lengths, pool_layout
    )
    num_sequences, max_q, max_kv = geometry.packed_layout(
        g, key, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
        query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids,
    )  # fmt: skip
    checks.padding_lengths(g, query_seq_lengths, key_value_seq_lengths)
    max_segments_per_row = checks.segments(g, q_segment_ids, kv_segment_ids, max_segments_per_row)
    checks.bias_and_mask(g, bias, mask)
    score_mod_args, modifiers = checks.modifiers(g, score_mod, mask_mod, score_mod_args)
    scale, window = checks.scalars(
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
        checks.ragged_paged_limits(bias, mask, score_mod_args, dropout_rate)
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
