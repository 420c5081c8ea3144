"""`dot_product_attention`: Flax's attention function, computed by `attnlib.attention`."""

import contextlib
from collections.abc import Callable
from typing import Any

import jax

from .. import _common
from . import _arguments, _sow


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable | None = None,
    qk_attn_weights_einsum: Callable | None = None,
    attn_weights_value_einsum: Callable | None = None,
    *,
    promote_dtype: Callable | None = None,
    is_causal: bool = False,
    **attention_kwargs: Any,
) -> Any:
    """Dot-product attention with `flax.linen.dot_product_attention`'s signature, computed by `attnlib.attention`.

    Pass it as the `attention_fn` of `flax.linen.MultiHeadDotProductAttention` (and `MultiHeadAttention`,
    `SelfAttention`) or of `flax.nnx.MultiHeadAttention`, or call it where you called
    `flax.linen.dot_product_attention` / `flax.nnx.dot_product_attention`: the same arguments give Flax's result
    (to the rounding of the dtype), without materialising the `[*B, N, T, S]` attention weights.

    The positional arguments are linen's, in linen's order; `promote_dtype` and `is_causal` are
    `flax.nnx.dot_product_attention`'s (keyword-only here), so one function serves both APIs. Any other keyword
    goes to `attnlib.attention` (`scale`, `local_window_size`, `logits_soft_cap`, `sinks`, `implementation`, …),
    so `functools.partial(attnlib.flax.dot_product_attention, local_window_size=(128, 0))` is an `attention_fn`
    with a sliding window.

    Shapes: `B` batch (any number of leading dims, or none), `T` query length, `S` key/value length, `N` query
    heads, `K` key/value heads (`N % K == 0`: grouped-query attention, as `flax.nnx.MultiHeadAttention`'s
    `num_kv_heads`), `H` query/key head dim, `Hv` value head dim.

    !!! Example
        ```python
        import functools
        import flax.linen as nn
        import attnlib.flax

        layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=attnlib.flax.dot_product_attention)
        causal = nn.MultiHeadDotProductAttention(
            num_heads=8, attention_fn=functools.partial(attnlib.flax.dot_product_attention, is_causal=True)
        )
        ```

    !!! faq "Differences from Flax's `dot_product_attention`"
        - A query row whose mask is all False outputs zeros (Flax averages all values uniformly).
        - Dropout draws attnlib's mask: one independent draw per batch row, head, query and key, also with
          `broadcast_dropout=True` (Flax then shares one `[T, S]` mask across batch and heads); same rate and
          `1 / (1 - rate)` scaling, different bits. `dropout_rate` must be a concrete Python float.
        - The softmax is always computed in float32 (`force_fp32_for_softmax` is accepted and changes nothing).
        - `query`, `key`, `value` must have the same leading dims (Flax asserts this too); complex dtypes are not
          supported.

    Args:
        query: `[*B, T, N, H]` (or `[T, N, H]`).
        key: `[*B, S, K, H]`.
        value: `[*B, S, K, Hv]`.
        bias: broadcastable to `[*B, N, T, S]`; added to the scaled logits before masking. Defaults to None.
        mask: broadcastable to `[*B, N, T, S]` (fewer leading dims broadcast); nonzero / True = may attend, any
            dtype (Flax's masks are often float32). Defaults to None.
        broadcast_dropout: accepted; attnlib draws an independent dropout mask per element either way (see above).
            Defaults to True.
        dropout_rng: PRNG key for dropout (typed or raw `uint32[2]`); required when dropout is active. Defaults to
            None.
        dropout_rate: dropout probability on the attention weights, in `[0, 1)`. Defaults to 0.
        deterministic: True switches dropout off (Flax's rule: dropout runs when `not deterministic and
            dropout_rate > 0`). Defaults to False.
        dtype: the dtype of the computation: `query`, `key`, `value` are cast to it (default: their promoted
            dtype, as Flax's `promote_dtype`). The result has this dtype. Defaults to None.
        precision: the precision of the matrix products, applied as `jax.default_matmul_precision` around the call:
            a `jax.lax.Precision`, a name (`"highest"`, `"float32"`, `"bfloat16"`, …), a
            `jax.lax.DotAlgorithmPreset`, or a pair of equal ones. attnlib's plain-JAX implementations already
            multiply float32 inputs at full precision. Defaults to None (the caller's setting).
        module: the Flax module that sows the attention weights (the layers pass it when called with
            `sow_weights=True`). Then Flax's own `dot_product_attention_weights` computes the weights, apart from
            the fused call (an extra `[*B, N, T, S]` array), and sows them as Flax does (before dropout). Defaults
            to None (nothing sown, nothing materialised).
        force_fp32_for_softmax: accepted (attnlib's softmax is float32 for every input dtype); used for the sown
            weights. Defaults to False.
        einsum_dot_general: must be None (`NotImplementedError` otherwise).
        qk_attn_weights_einsum: must be None (`NotImplementedError` otherwise).
        attn_weights_value_einsum: must be None (`NotImplementedError` otherwise).
        promote_dtype: flax.nnx's dtype promotion function, called as `promote_dtype((query, key, value),
            dtype=dtype)`. Defaults to None (Flax's standard promotion). (Keyword only.)
        is_causal: causal mask, top-left aligned (query `i` sees keys `j <= i`), ANDed with `mask`; as
            `flax.nnx.dot_product_attention`'s. Defaults to False. (Keyword only.)
        **attention_kwargs: forwarded to `attnlib.attention` (except `dropout_key`: pass `dropout_rng`).

    Returns:
        `[*B, T, N, Hv]` in the computation dtype (with `return_residual=True` in `attention_kwargs`:
        `(out, lse)` as `attnlib.attention`).

    Raises:
        NotImplementedError: `einsum_dot_general`, `qk_attn_weights_einsum` or `attn_weights_value_einsum` is
            given; `precision` is a pair of different precisions or a custom `jax.lax.DotAlgorithm`; `module` is
            given together with an attnlib option that changes the weights; or the requested implementation cannot
            serve the call.
        ValueError: a flag is not a bool, `dropout_rate` is not a float in `[0, 1)` (when dropout is active),
            `dropout_rng` is missing when dropout is active, `precision` is unknown, or a shape is invalid (as
            `attnlib.attention`).
        TypeError: `dropout_rng` is not a PRNG key, `module` is not a Flax module, `promote_dtype` is not
            callable, `dropout_key` is passed, or a dtype is invalid (as `attnlib.attention`).
    """
    with jax.named_scope("attnlib.flax.dot_product_attention"):
        _arguments.decline_einsums(
            einsum_dot_general=einsum_dot_general,
            qk_attn_weights_einsum=qk_attn_weights_einsum,
            attn_weights_value_einsum=attn_weights_value_einsum,
        )
        _arguments.flag("broadcast_dropout", broadcast_dropout)
        _arguments.flag("force_fp32_for_softmax", force_fp32_for_softmax)
        deterministic = _arguments.flag("deterministic", deterministic)
        is_causal = _arguments.flag("is_causal", is_causal)
        options = _arguments.attention_kwargs(attention_kwargs)
        setting = _arguments.matmul_precision(precision)
        rate, dropout_key = _arguments.dropout(dropout_rate, dropout_rng, deterministic)
        query, key, value = _arguments.promote(query, key, value, dtype, promote_dtype)
        mask = _common.bool_mask(mask)
        if module is not None:
            _sow.sow_attention_weights(
                module,
                query,
                key,
                bias,
                mask,
                is_causal=is_causal,
                precision=precision,
                force_fp32_for_softmax=force_fp32_for_softmax,
                attention_kwargs=options,
            )
        with contextlib.nullcontext() if setting is None else jax.default_matmul_precision(setting):
            return _common.attend(
                query,
                key,
                value,
                bias,
                mask,
                sinks=options.pop("sinks", None),
                dropout_rate=rate,
                dropout_key=dropout_key,
                implementation=options.pop("implementation", None),
                is_causal=is_causal,
                **options,
            )
