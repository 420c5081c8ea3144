"""The checks of `attention`'s argument groups beyond the shapes of query, key and value: their dtypes and FP8,
padding lengths, packed rows (segment ids), `bias` and `mask`, `score_mod` / `mask_mod`, and the scalars and flags.

Each takes the call's `geometry.Geometry` where it needs sizes; messages in `validation`'s style (see
`argument_checks`).
"""

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import argument_checks, fp8 as fp8_lib, geometry, modifiers as modifiers_lib


def qkv_dtypes(query: Any, key: Any, value: Any, fp8: Any) -> tuple[str | None, fp8_lib.Fp8Scales | None]:
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
        if not argument_checks.is_float(x.dtype) or x.dtype not in argument_checks.FLOAT_DTYPES:
            raise TypeError(
                f"`{name}` must have dtype float16, bfloat16, float32 or float64. Got {name}.dtype={x.dtype}."
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            "`query`, `key` and `value` must share one dtype. "
            f"Got query.dtype={query.dtype}, key.dtype={key.dtype}, value.dtype={value.dtype}."
        )
    return fp8_mode, fp8_scales


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
        if shape not in ((), (1,)) or not argument_checks.is_float(dtype):
            raise ValueError(
                f"`fp8.{field}` must be a float scalar (shape () or (1,)). Got shape {shape}, dtype {dtype}."
            )
    if np.dtype(fp8.output_dtype) not in [np.dtype(d) for d in argument_checks.FLOAT_DTYPES[:3]]:
        raise TypeError(
            f"`fp8.output_dtype` must be float16, bfloat16 or float32. Got output_dtype={fp8.output_dtype!r}."
        )
    return "scaled", fp8


def ragged_paged_limits(bias: Any, mask: Any, score_mod_args: Any, dropout_rate: Any) -> None:
    """What ragged queries against a paged cache (`cu_seqlens_q` with `page_table`) do not take: a
    `NotImplementedError` naming it."""
    for name, given in (("`bias`", bias is not None), ("`mask`", mask is not None),
                        ("`score_mod_args`", bool(score_mod_args)), ("dropout", dropout_rate > 0)):  # fmt: skip
        if given:
            raise NotImplementedError(
                f"{name} with ragged queries against a paged KV cache (`cu_seqlens_q` with `page_table`) is not "
                "supported: pass the queries as [B, T, N, H] with `query_seq_lengths` for it."
            )


def padding_lengths(g: geometry.Geometry, query_seq_lengths: Any, key_value_seq_lengths: Any) -> None:
    """Padding lengths: int `[*B]` in [0, T] / [0, S] (checked when concrete; traced values are clamped)."""
    batch_shape, T, S = g.batch_shape, g.T, g.S
    for name, x, limit, letter in (
        ("query_seq_lengths", query_seq_lengths, T, "T"),
        ("key_value_seq_lengths", key_value_seq_lengths, S, "S"),
    ):
        if x is not None:
            argument_checks.require_int_array(name, x)
            argument_checks.require_shape(name, x, batch_shape, "*B")
            if argument_checks.is_concrete(x):
                values = np.asarray(x)
                outside = (values < 0) | (values > limit)
                if outside.any():
                    index = tuple(int(i) for i in np.argwhere(outside)[0])
                    raise ValueError(
                        f"`{name}` must be in [0, {letter}={limit}]. Got {name}{list(index)}={int(values[index])} "
                        f"({name}={values.tolist()})."
                    )


def segments(g: geometry.Geometry, q_segment_ids: Any, kv_segment_ids: Any, max_segments_per_row: Any) -> int | None:
    """Packed rows: segment ids `[*B, T]` / `[*B, S]` and their bound. Returns `max_segments_per_row`."""
    layout, batch_shape, T, S = g.layout, g.batch_shape, g.T, g.S
    if kv_segment_ids is not None and q_segment_ids is None:
        raise ValueError("`kv_segment_ids` requires `q_segment_ids`. Got q_segment_ids=None.")
    if q_segment_ids is not None:
        if layout == "paged":
            raise ValueError("`q_segment_ids` cannot be combined with `page_table`. Got both.")
        argument_checks.require_int_array("q_segment_ids", q_segment_ids)
        argument_checks.require_shape("q_segment_ids", q_segment_ids, batch_shape + (T,), "[*B, T]")
        if kv_segment_ids is not None:
            argument_checks.require_int_array("kv_segment_ids", kv_segment_ids)
            argument_checks.require_shape("kv_segment_ids", kv_segment_ids, batch_shape + (S,), "[*B, S]")
        elif S != T:
            raise ValueError(
                f"Without `kv_segment_ids`, keys reuse `q_segment_ids`, so S must equal T. Got T={T}, S={S}."
            )
    if max_segments_per_row is not None:
        max_segments_per_row = argument_checks.require_positive_int("max_segments_per_row", max_segments_per_row)
        if q_segment_ids is None:
            raise ValueError("`max_segments_per_row` needs `q_segment_ids`. Got q_segment_ids=None.")
    return max_segments_per_row


def bias_and_mask(g: geometry.Geometry, bias: Any, mask: Any) -> None:
    """`bias` (float) and `mask` (bool) broadcastable to `[*B, N, T, S]`."""
    batch_shape, N, T, S = g.batch_shape, g.N, g.T, g.S
    target = batch_shape + (N, T, S)
    if bias is not None:
        if not argument_checks.is_float(bias.dtype):
            raise TypeError(f"`bias` must have a floating dtype. Got bias.dtype={bias.dtype}.")
        argument_checks.check_broadcastable("bias", bias, target, "[*B, N, T, S]")
    if mask is not None:
        if mask.dtype != jnp.bool_:
            raise TypeError(f"`mask` must be boolean (True = may attend). Got mask.dtype={mask.dtype}.")
        argument_checks.check_broadcastable("mask", mask, target, "[*B, N, T, S]")


def modifiers(g: geometry.Geometry, score_mod: Any, mask_mod: Any, score_mod_args: Any) -> tuple[tuple, Any]:
    """`score_mod` / `mask_mod`, traced once on scalars; each argument broadcastable like `bias`. Returns the
    arguments as arrays and the modifiers' description."""
    layout, batch_shape, N, T, S = g.layout, g.batch_shape, g.N, g.T, g.S
    target = batch_shape + (N, T, S)
    score_mod_args = modifiers_lib.as_arrays(score_mod_args)
    modifiers = modifiers_lib.describe(score_mod, mask_mod, score_mod_args)
    args_meaning = "[N, T, S]" if layout == "thd" else "[*B, N, T, S]"
    for i, arg in enumerate(score_mod_args):
        argument_checks.check_broadcastable(f"score_mod_args[{i}]", arg, target, args_meaning)
    return score_mod_args, modifiers


def scalars(
    g: geometry.Geometry, scale: Any, is_causal: Any, return_residual: Any, deterministic_backward: Any,
    diagonal_alignment: Any, local_window_size: Any, logits_soft_cap: Any, sinks: Any, dropout_rate: Any,
    dropout_key: Any,
) -> tuple[Any, tuple[int, int] | None]:  # fmt: skip
    """Scalars and flags, the window and `sinks` `[N]`. Returns the scale (default `1/sqrt(H)`; a 0-d array as given)
    and the window."""
    H, N = g.H, g.N
    scale = argument_checks.parse_scale(scale, H)
    argument_checks.require_bool("is_causal", is_causal)
    argument_checks.require_bool("return_residual", return_residual)
    argument_checks.require_bool("deterministic_backward", deterministic_backward)
    argument_checks.require_alignment(diagonal_alignment)
    window = argument_checks.parse_window(local_window_size)
    if logits_soft_cap is not None and (
        isinstance(logits_soft_cap, bool)
        or not isinstance(logits_soft_cap, numbers.Real)
        or not math.isfinite(logits_soft_cap)
        or logits_soft_cap <= 0
    ):
        raise ValueError(f"`logits_soft_cap` must be a positive finite float. Got {logits_soft_cap!r}.")
    if sinks is not None:
        argument_checks.require_sinks(sinks, N)
    if (
        isinstance(dropout_rate, bool)
        or not isinstance(dropout_rate, numbers.Real)
        or not (0.0 <= dropout_rate < 1.0)
    ):
        raise ValueError(f"`dropout_rate` must be a float in [0, 1). Got {dropout_rate!r}.")
    if dropout_rate > 0 and dropout_key is None:
        raise ValueError(f"`dropout_rate`={dropout_rate} > 0 needs a `dropout_key`. Got dropout_key=None.")
    return scale, window
