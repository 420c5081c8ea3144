"""Flax's `module` argument: the attention weights sown into the module that asked for them (`sow_weights=True`).

A fused kernel never materialises the weights, so they are computed apart, by Flax's own
`dot_product_attention_weights` (linen's for a `flax.linen.Module`, nnx's for a `flax.nnx.Module`), which sows them
as Flax's `dot_product_attention` would: before dropout, under `attention_weights`, in the collection of the module's
API (`"intermediates"` / `nnx.Intermediate`).
"""

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx.nn import attention as nnx_attention


# attnlib.attention keywords that leave the weights as Flax computes them.
_WEIGHTS_UNCHANGED = frozenset({"implementation", "deterministic_backward"})


def _causal(mask: jax.Array | None, t: int, s: int) -> jax.Array:
    """`mask` AND the top-left causal mask `[T, S]` (attnlib's `is_causal` with its default alignment)."""
    causal = jnp.tril(jnp.ones((t, s), jnp.bool_))
    if mask is None:
        return causal
    shape = jnp.broadcast_shapes(mask.shape, causal.shape)
    return jnp.logical_and(jnp.broadcast_to(mask, shape), jnp.broadcast_to(causal, shape))


def sow_attention_weights(
    module: Any,
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    *,
    is_causal: bool,
    precision: Any,
    force_fp32_for_softmax: bool,
    attention_kwargs: dict[str, Any],
) -> None:
    """Sows Flax's attention weights `[*B, N, T, S]` of `query` `[*B, T, N, H]` and `key` `[*B, S, K, H]` into
    `module` (a `flax.linen.Module` or `flax.nnx.Module`).

    Raises:
        TypeError: `module` is neither a linen nor an nnx module.
        NotImplementedError: `attention_kwargs` hold an option that changes the weights (Flax's formula knows only
            `bias`, `mask` and `is_causal`).
    """
    if not isinstance(module, (linen.Module, nnx.Module)):
        raise TypeError(
            "`module` must be None, a flax.linen.Module or a flax.nnx.Module (the module that sows the attention "
            f"weights). Got module of type {type(module).__name__}."
        )
    changing = sorted(set(attention_kwargs) - _WEIGHTS_UNCHANGED)
    if changing:
        raise NotImplementedError(
            "Sowing attention weights (`module` given, i.e. sow_weights=True) is not supported together with "
            f"{', '.join(f'`{name}`' for name in changing)}: the sown weights are Flax's own "
            "dot_product_attention_weights, which know only `bias`, `mask` and `is_causal`. Drop sow_weights, or "
            f"those options. Got module={type(module).__name__}, {', '.join(changing)}."
        )
    # Causal masking and grouped-query heads are folded in here (as nnx's own function does them since Flax 0.12),
    # so both APIs' weight functions see plain multi-head attention, in every Flax version the extra allows.
    if is_causal:
        mask = _causal(mask, query.shape[-3], key.shape[-3])
    num_heads, num_kv_heads = query.shape[-2], key.shape[-2]
    if num_heads != num_kv_heads and num_kv_heads > 0 and num_heads % num_kv_heads == 0:
        key = jnp.repeat(key, num_heads // num_kv_heads, axis=-2)  # query head n uses key head n // (N // K)
    if isinstance(module, linen.Module):
        linen.dot_product_attention_weights(
            query,
            key,
            bias,
            mask,
            deterministic=True,
            precision=precision,
            module=module,
            force_fp32_for_softmax=force_fp32_for_softmax,
        )
    else:
        nnx_attention.dot_product_attention_weights(
            query, key, bias, mask, deterministic=True, precision=precision, module=module
        )
