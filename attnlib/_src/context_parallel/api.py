"""Context parallelism: `attention`, its argument checks, and the choice of strategy."""

import math
from typing import Any

import jax
import jax.numpy as jnp

from .. import argument_checks
from ..attention import ARGUMENT_DEFAULTS
from ..backends.base import Implementation
from ..band import Band
from .all_gather import _all_gather
from .planner import _Layout, _make_plan, _Rule
from .ring import _Options, _ring


_STRATEGIES = ("ring", "all_gather")

# Options forwarded unchanged to every per-step `attnlib.attention` call.
_FORWARDED = ("scale", "logits_soft_cap", "implementation", "deterministic_backward")
# Options interpreted here.
_HANDLED = (
    "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size", "return_residual",
    "diagonal_alignment", "q_segment_ids", "kv_segment_ids", "max_segments_per_row", "sinks",
)  # fmt: skip
# Options of `attnlib.attention` that context parallelism cannot serve yet (checked for non-default values).
_UNSUPPORTED = {
    "bias": "a `bias` would have to be sharded along both sequence axes",
    "mask": "a dense `mask` would have to be sharded along both sequence axes; use segment ids, lengths, "
    "`is_causal` or `local_window_size`",
    "dropout_rate": "dropout masks are indexed by local, not global, positions",
    "dropout_key": "dropout masks are indexed by local, not global, positions",
    "cu_seqlens_q": "the THD layout (`cu_seqlens_q`) is not sharded by context parallelism; use segment ids",
    "cu_seqlens_kv": "the THD layout (`cu_seqlens_kv`) is not sharded by context parallelism; use segment ids",
    "max_seqlen_q": "the THD layout (`max_seqlen_q`) is not sharded by context parallelism",
    "max_seqlen_kv": "the THD layout (`max_seqlen_kv`) is not sharded by context parallelism",
    "page_table": "paged key/value caches (`page_table`) are for decoding, not context parallelism",
    "fp8": "per-tensor FP8 scales would have to be agreed across the shards",
    "return_max_logit": "the largest logit would have to be reduced across the shards",
}
# `score_mod` / `mask_mod` would see shard-local positions and blocks (checked for anything but None / empty).
_UNSUPPORTED_MODIFIERS = ("score_mod", "mask_mod", "score_mod_args")


# ----------------------------------------------------------------------------------------------------------------
# Public entry point


def attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    axis_name: Any,
    strategy: str = "ring",
    load_balanced: bool = True,
    **attention_kwargs: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""`attnlib.attention` over a sequence sharded across the mesh axis `axis_name`; call inside `shard_map`.

    Each device holds `T_l = T / D` query tokens and `S_l = S / D` key/value tokens of every sequence (`D` =
    size of `axis_name`): contiguous shards with `load_balanced=False`, the order of `reorder` with
    `load_balanced=True`. The result on each device is its rows of `attnlib.attention` on the whole sequence
    (in the same layout), forward and backward.

    Shapes (local, per device): `B` batch, `T_l` local query length, `S_l` local key/value length, `N` query
    heads, `K` key/value heads, `H` query/key head dim, `Hv` value head dim.

    Args:
        query: `[*B, T_l, N, H]`.
        key: `[*B, S_l, K, H]`.
        value: `[*B, S_l, K, Hv]`.
        axis_name: the `shard_map` mesh axis the sequence axis is sharded over.
        strategy: `"ring"` (key/value blocks circulate with `ppermute`; memory O(S / D) per device, forward and
            backward) or `"all_gather"` (keys/values gathered once; memory O(S)). Defaults to `"ring"`.
        load_balanced: the tokens are laid out with `reorder` (device `r` holds chunks `r` and `2D - 1 - r`), so
            causal work is equal on every device. Needs `T_l` and `S_l` even. Defaults to True.
        **attention_kwargs: options of `attnlib.attention`, with *global* meaning: `scale`, `is_causal`,
            `local_window_size`, `diagonal_alignment` (`"bottom_right"` only without lengths or segment ids),
            `query_seq_lengths` / `key_value_seq_lengths` (int `[*B]`, global valid lengths, replicated),
            `q_segment_ids` `[*B, T_l]` / `kv_segment_ids` `[*B, S_l]` (global ids, sharded like the tokens),
            `max_segments_per_row` (accepted; unused since segment steps use a mask), `logits_soft_cap`,
            `sinks` `[N]` (replicated), `implementation`, `return_residual`, `deterministic_backward`.

    Returns:
        `out` `[*B, T_l, N, Hv]` in `query.dtype`; with `return_residual=True`, `(out, lse)` with the global
        float32 `lse` `[*B, T_l, N]` (differentiable).

    Raises:
        ValueError: a shape or value is invalid (names the argument and shows what was given), or `axis_name` is
            not a mesh axis bound by `shard_map`.
        TypeError: an unknown option or a non-integer segment id / length array.
        NotImplementedError: an option context parallelism cannot serve yet (`bias`, `mask`, dropout, THD
            `cu_seqlens_*`, `page_table`, `score_mod` / `mask_mod`, `diagonal_alignment="bottom_right"` with
            lengths or segment ids).

    !!! Example
        ```python
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("sp",))
        spec = jax.sharding.PartitionSpec(None, "sp")
        f = jax.shard_map(
            lambda q, k, v: attnlib.context_parallel.attention(q, k, v, axis_name="sp", is_causal=True),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
        )
        out = attnlib.context_parallel.restore(
            f(*(attnlib.context_parallel.reorder(x, 8) for x in (q, k, v))), 8
        )
        ```
    """
    with jax.named_scope("attnlib.context_parallel.attention"):
        return _attention_impl(query, key, value, axis_name, strategy, load_balanced, attention_kwargs)


def _attention_impl(query, key, value, axis_name, strategy, load_balanced, kwargs):
    for name in _UNSUPPORTED_MODIFIERS:
        given = kwargs.get(name)
        if given is not None and not (isinstance(given, (tuple, list)) and len(given) == 0):
            raise NotImplementedError(
                f"context parallelism does not support `{name}` yet: `score_mod` / `mask_mod` would see "
                "shard-local positions and blocks, not the global sequence. Use `attnlib.attention` on the whole "
                "sequence, or the built-in masks (`is_causal`, `local_window_size`, segment ids)."
            )
    for name in kwargs:
        if name in _UNSUPPORTED_MODIFIERS:
            continue
        if name not in _FORWARDED and name not in _HANDLED and name not in _UNSUPPORTED:
            raise TypeError(f"`attnlib.context_parallel.attention` got an unexpected keyword argument `{name}`.")
    for name, why in _UNSUPPORTED.items():
        value_ = kwargs.get(name)
        if value_ is not None and (hasattr(value_, "shape") or value_ != ARGUMENT_DEFAULTS[name]):
            raise NotImplementedError(f"context parallelism does not support `{name}` yet: {why}.")
    if getattr(query, "dtype", None) == jnp.float64:
        raise NotImplementedError(
            "context parallelism does not support float64 inputs yet (it merges partial results in float32); use "
            "attnlib.attention on the whole sequence."
        )
    if strategy not in _STRATEGIES:
        raise ValueError(f"`strategy` must be one of {list(_STRATEGIES)}. Got {strategy!r}.")
    argument_checks.require_bool("load_balanced", load_balanced)
    is_causal = kwargs.get("is_causal", False)
    argument_checks.require_bool("is_causal", is_causal)
    return_residual = kwargs.get("return_residual", False)
    argument_checks.require_bool("return_residual", return_residual)
    try:
        D = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"`axis_name` must name a mesh axis bound by the enclosing `shard_map`. Got axis_name={axis_name!r}."
        ) from None

    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "`query`, `key` and `value` must be `[*B, T_l, N, H]`, `[*B, S_l, K, H]`, `[*B, S_l, K, Hv]` with the "
            f"same rank >= 3. Got query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}."
        )
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape or key.shape[-3] != value.shape[-3]:
        raise ValueError(
            "`query`, `key` and `value` must share the batch dims and `key`, `value` the sequence length. "
            f"Got query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}."
        )
    T_l, S_l = query.shape[-3], key.shape[-3]
    if load_balanced and (T_l % 2 or S_l % 2):
        raise ValueError(
            "With `load_balanced=True` each device holds two equal chunks, so the local query and key lengths "
            f"must be even. Got query.shape={query.shape}, key.shape={key.shape} (local)."
        )
    T, S = T_l * D, S_l * D
    B = math.prod(batch_shape)
    flat = lambda x: jnp.reshape(x, (B,) + x.shape[len(batch_shape) :])

    # Non-differentiable per-call arrays: `q_seg [B, T_l]`, `kv_seg [B, S_l]`, `q_len [B]`, `kv_len [B]`.
    aux: dict[str, jax.Array] = {}
    for name, meaning in (("query_seq_lengths", "q_len"), ("key_value_seq_lengths", "kv_len")):
        if kwargs.get(name) is not None:
            aux[meaning] = jnp.reshape(argument_checks.int_array(name, kwargs[name], batch_shape, "[*B]"), (B,))
    q_seg = kwargs.get("q_segment_ids")
    kv_seg = kwargs.get("kv_segment_ids")
    if kv_seg is not None and q_seg is None:
        raise ValueError("`kv_segment_ids` requires `q_segment_ids`. Got q_segment_ids=None.")
    if q_seg is not None:
        aux["q_seg"] = flat(argument_checks.int_array("q_segment_ids", q_seg, batch_shape + (T_l,), "[*B, T_l]"))
        if kv_seg is None:
            if T_l != S_l:
                raise ValueError(
                    "Without `kv_segment_ids`, keys reuse `q_segment_ids`, so S must equal T. "
                    f"Got T_l={T_l}, S_l={S_l} (local)."
                )
            aux["kv_seg"] = aux["q_seg"]
        else:
            aux["kv_seg"] = flat(argument_checks.int_array("kv_segment_ids", kv_seg, batch_shape + (S_l,), "[*B, S_l]"))
    sinks = kwargs.get("sinks")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        argument_checks.require_sinks(sinks, query.shape[-2])

    alignment = kwargs.get("diagonal_alignment", "top_left")
    argument_checks.require_alignment(alignment)
    window = argument_checks.parse_window(kwargs.get("local_window_size"))
    band = Band.from_flags(is_causal=is_causal, window=window, diagonal_alignment=alignment)
    dynamic_rows = q_seg is not None or "q_len" in aux or "kv_len" in aux
    if band.bottom_right and dynamic_rows:
        raise NotImplementedError(
            'context parallelism does not support `diagonal_alignment="bottom_right"` together with '
            "`query_seq_lengths`, `key_value_seq_lengths` or segment ids yet: the diagonal would depend on "
            "per-sequence lengths across shards."
        )
    rule = _Rule(band, T, S)

    q_layout = _Layout(D, T_l, bool(load_balanced))
    k_layout = _Layout(D, S_l, bool(load_balanced))
    plan = _make_plan(
        strategy, D, q_layout, k_layout, rule, allow_bottom_right=not dynamic_rows, segments=q_seg is not None
    )
    forwarded = tuple((name, kwargs[name]) for name in _FORWARDED if kwargs.get(name) is not None)
    if "implementation" in dict(forwarded) and not isinstance(
        dict(forwarded)["implementation"], (str, Implementation)
    ):
        forwarded = tuple((n, tuple(x) if n == "implementation" else x) for n, x in forwarded)
    opts = _Options(axis_name, D, rule, forwarded, plan)

    q, k, v = flat(query), flat(key), flat(value)
    if strategy == "ring":
        out, lse = _ring(opts, q, k, v, sinks, aux)
    else:
        out, lse = _all_gather(opts, q, k, v, sinks, aux, bool(load_balanced))
    out = jnp.reshape(out, batch_shape + out.shape[1:])
    if return_residual:
        return out, jnp.reshape(lse, batch_shape + lse.shape[1:])
    return out
