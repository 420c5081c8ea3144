"""`MultiHeadAttention`: a drop-in for `haiku.MultiHeadAttention` computed by `attnlib.attention`."""

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from ... import dispatch, explicit_axes
from .. import _common
from ._shared import _dropout, _sinks


class MultiHeadAttention(hk.Module):
    """Multi-head attention: a drop-in for `haiku.MultiHeadAttention` computed by `attnlib.attention`.

    Same constructor arguments, parameter names and shapes (`multi_head_attention/{query,key,value,linear}` with
    `w` and `b`), parameter initialisation order and `__call__` as `haiku.MultiHeadAttention` (dm-haiku 0.0.17),
    so existing checkpoints load unchanged. Broadcasts over leading batch dims.

    Extras, all keyword-only: `num_kv_heads` (grouped-query attention: the `key` and `value` projections produce
    `num_kv_heads` heads, nothing else changes), `is_causal`, `local_window_size`, `softmax_type` (`"vanilla"`,
    `"off_by_one"`, `"learnable"` with a parameter `sinks` `[num_heads]` of this module, initialised to zeros),
    `logits_soft_cap`, `fp8`, `score_mod` / `mask_mod` (custom scores and masks; their array arguments are the call's
    `score_mod_args`), `dropout_rate` and `implementation`.

    Glossary of shapes: `T` (`T'`) key/value (query) sequence length, `D` embedding size, `H` number of heads.

    !!! faq "Differences from `haiku.MultiHeadAttention`"

        - A query row that may attend to no key (its mask row is all zero) outputs zeros before the final
          projection; Haiku averages all values uniformly.
        - `mask` may have fewer dims than the logits `[..., H, T', T]` (it broadcasts); any dtype, nonzero = may
          attend. `query`, `key` and `value` must have the same leading (batch) dims.
        - Optional dropout on the attention weights (`dropout_rate`, default 0), drawing from `hk.next_rng_key()`.
    """

    def __init__(
        self,
        num_heads: int,
        key_size: int,
        w_init_scale: float | None = None,
        *,
        w_init: hk.initializers.Initializer | None = None,
        with_bias: bool = True,
        b_init: hk.initializers.Initializer | None = None,
        value_size: int | None = None,
        model_size: int | None = None,
        name: str | None = None,
        num_kv_heads: int | None = None,
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        softmax_type: _common.SoftmaxType = "vanilla",
        logits_soft_cap: float | None = None,
        fp8: str | None = None,
        dropout_rate: float = 0.0,
        implementation: dispatch.ImplementationRequest = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
    ):
        """Initialises the module.

        Args:
            num_heads: number of independent attention heads (H).
            key_size: the size of keys and queries used for attention, per head.
            w_init_scale: DEPRECATED (as in Haiku). Please use `w_init` instead.
            w_init: initialiser for the weights of the linear maps. Required unless `w_init_scale` is given.
            with_bias: whether the linear projections add a bias. Defaults to True.
            b_init: optional initialiser for the biases. Defaults to zeros.
            value_size: size of the value projection per head. Defaults to `key_size`.
            model_size: size of the output embedding (D'). Defaults to `key_size * num_heads`.
            name: optional name for this module. Defaults to `"multi_head_attention"`.
            num_kv_heads: number of key/value heads; must divide `num_heads`. Defaults to `num_heads`.
            is_causal: causal mask (query `i` sees keys `j <= i`, top-left aligned). Defaults to False.
            local_window_size: `w` or `(left, right)`: query `i` sees keys `i - left … i + right`. Defaults to None.
            softmax_type: `"vanilla"`, `"off_by_one"` or `"learnable"`. Defaults to `"vanilla"`.
            logits_soft_cap: `c` in `s <- c * tanh(s / c)`. Defaults to None.
            fp8: None or `"current"`: attention in FP8 with per-tensor scales from the projected query, key and
                value (`attnlib.attention`'s `fp8`, docs/fp8.md). Static. Defaults to None.
            dropout_rate: dropout probability on the attention weights, in `[0, 1)`; the key comes from
                `hk.next_rng_key()`. Overridable per call. Defaults to 0.
            implementation: as `attnlib.attention`'s `implementation`. Defaults to None (automatic).
            score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> score`, written in `jax.numpy` for
                one score element, as `attnlib.attention`'s (applied after the scale, before `logits_soft_cap` and
                the masks; `*args` are one element of each of the call's `score_mod_args`). Not a parameter.
                Defaults to None.
            mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool` (True = may attend), ANDed with the
                other masks. Defaults to None.

        Raises:
            ValueError: an argument is invalid (the message names it and shows what was given), or neither or
                both of `w_init` and `w_init_scale` are given (as Haiku).
            TypeError: `score_mod` or `mask_mod` is neither None nor callable.
        """
        super().__init__(name=name)
        self.num_heads = _common.positive_int("num_heads", num_heads)
        self.key_size = _common.positive_int("key_size", key_size)
        self.value_size = _common.positive_int("value_size", value_size or key_size)
        self.model_size = _common.positive_int("model_size", model_size or key_size * num_heads)
        self.num_kv_heads = _common.num_kv_heads(num_heads if num_kv_heads is None else num_kv_heads, num_heads)
        self.is_causal = _common.flag("is_causal", is_causal)
        self.local_window_size = _common.local_window_size(local_window_size)
        self.softmax_type = _common.softmax_type(softmax_type)
        self.logits_soft_cap = _common.logits_soft_cap(logits_soft_cap)
        self.fp8 = _common.fp8(fp8)
        self.score_mod = _common.modifier("score_mod", score_mod)
        self.mask_mod = _common.modifier("mask_mod", mask_mod)
        self.dropout_rate = _common.dropout_rate("dropout_rate", dropout_rate)
        self.implementation = _common.implementation(implementation)

        # Backwards-compatibility for w_init_scale (as Haiku).
        if w_init_scale is not None:
            warnings.warn(
                "w_init_scale is deprecated; please pass an explicit weight initialiser instead.",
                DeprecationWarning,
                stacklevel=2,
            )
        if w_init and w_init_scale:
            raise ValueError("Please provide only `w_init`, not `w_init_scale`.")
        if w_init is None and w_init_scale is None:
            raise ValueError(
                "Please provide a weight initializer: `w_init`. `w_init` will become mandatory once `w_init_scale` "
                "is fully deprecated. Got w_init=None, w_init_scale=None."
            )
        if w_init is None:
            w_init = hk.initializers.VarianceScaling(w_init_scale)
        self.w_init = w_init
        self.with_bias = with_bias
        self.b_init = b_init

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        mask: jax.Array | None = None,
        *,
        dropout_rate: float | None = None,
        score_mod_args: Sequence[Any] = (),
    ) -> jax.Array:
        """Computes (optionally masked) multi-head attention with queries, keys and values.

        Broadcasts over zero or more leading batch dims `...` (the same for all three inputs).

        Args:
            query: embeddings used to compute queries; shape `[..., T', D_q]`.
            key: embeddings used to compute keys; shape `[..., T, D_k]`.
            value: embeddings used to compute values; shape `[..., T, D_v]`.
            mask: optional mask, broadcastable to `[..., H, T', T]` (Haiku: `[..., H=1, T', T]`); nonzero = may
                attend. Combined with `is_causal` / `local_window_size`.
            dropout_rate: overrides the module's `dropout_rate` for this call (e.g. 0 at evaluation). (Keyword
                only.)
            score_mod_args: arrays that `score_mod` / `mask_mod` receive one element of, each broadcastable to
                `[..., H, T', T]` (e.g. ALiBi slopes `[H, 1, 1]`); float ones differentiable. Needs `score_mod` or
                `mask_mod`. Defaults to `()`. (Keyword only.)

        Returns:
            `[..., T', D']`.
        """
        with jax.named_scope("attnlib.haiku.MultiHeadAttention"):
            *leading_dims, sequence_length, _ = query.shape
            projection = self._linear_projection

            query_heads = projection(query, self.key_size, self.num_heads, "query")  # [T', H, Q=K]
            key_heads = projection(key, self.key_size, self.num_kv_heads, "key")  # [T, H_kv, K]
            value_heads = projection(value, self.value_size, self.num_kv_heads, "value")  # [T, H_kv, V]
            _common.attention_dtype("attnlib.haiku.MultiHeadAttention", query_heads)

            rate, dropout_key = _dropout(self.dropout_rate, dropout_rate, None)
            attn = _common.attend(
                query_heads,
                key_heads,
                value_heads,
                mask=_common.bool_mask(mask),
                sinks=_sinks(self.softmax_type, self.num_heads, query_heads.dtype),
                is_causal=self.is_causal,
                local_window_size=self.local_window_size,
                logits_soft_cap=self.logits_soft_cap,
                fp8=self.fp8,
                score_mod=self.score_mod,
                mask_mod=self.mask_mod,
                score_mod_args=score_mod_args,
                dropout_rate=rate,
                dropout_key=dropout_key,
                implementation=self.implementation,
            )
            attn = jnp.reshape(attn, (*leading_dims, sequence_length, -1))  # [T', H*V]

            final_projection = hk.Linear(
                self.model_size, w_init=self.w_init, with_bias=self.with_bias, b_init=self.b_init
            )
            # Under explicit mesh axes the heads may be split over an axis that the projection sums over: XLA's
            # partitioner places that sum, and the output is typed like `query`.
            out_sharding = explicit_axes.sharding_like(query, (*leading_dims, sequence_length, self.model_size))
            if out_sharding is None:
                return final_projection(attn)  # [T', D']
            project = _reading_automatic(final_projection)
            return explicit_axes.on_automatic_axes(project, attn, out_sharding=out_sharding)

    @hk.transparent
    def _linear_projection(self, x: jax.Array, head_size: int, num_heads: int, name: str | None = None) -> jax.Array:
        y = hk.Linear(
            num_heads * head_size, w_init=self.w_init, with_bias=self.with_bias, b_init=self.b_init, name=name
        )(x)
        *leading_dims, _ = x.shape
        return y.reshape((*leading_dims, num_heads, head_size))


def _reading_automatic(fn: Callable) -> Callable:
    """`fn` with the Haiku parameters it reads typed on automatic axes (`explicit_axes.to_automatic`): inside
    `explicit_axes.on_automatic_axes` only the operands are retyped, and the parameters come from Haiku's frame."""

    def getter(next_getter, value, context):
        return next_getter(explicit_axes.to_automatic(value))

    def wrapped(*args):
        with hk.custom_getter(getter):
            return fn(*args)

    return wrapped
