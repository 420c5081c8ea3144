"""`DotProductAttention`: the attention core without projections, as a Haiku module."""

from collections.abc import Callable, Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from ... import dispatch
from .. import _common
from ._shared import _dropout, _sinks


class DotProductAttention(hk.Module):
    """The attention core without projections: `attnlib.attention` as a Haiku module.

    Holds the static options (including `score_mod` / `mask_mod`); with `softmax_type="learnable"` it owns a
    parameter `sinks` `[N]` (zeros at init; `N` read from `query` on the first call). Every per-call argument of
    `attnlib.attention` (bias, mask, padding lengths, segment ids, `cu_seqlens`, page tables, `score_mod_args`) is
    a `__call__` argument; shapes as there
    (`[*B, T, N, H]`, unbatched, THD or paged).

    !!! Example
        ```python
        def f(q, k, v):
            return attnlib.haiku.DotProductAttention(is_causal=True, softmax_type="learnable")(q, k, v)
        params = hk.transform(f).init(rng, q, k, v)  # {"dot_product_attention": {"sinks": [N]}}
        ```
    """

    def __init__(
        self,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        softmax_type: _common.SoftmaxType = "vanilla",
        logits_soft_cap: float | None = None,
        fp8: str | None = None,
        diagonal_alignment: str = "top_left",
        dropout_rate: float = 0.0,
        implementation: dispatch.ImplementationRequest = None,
        name: str | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
    ):
        """Stores the options.

        Args:
            scale: logit scale. Defaults to `1/sqrt(H)`.
            is_causal: causal mask, aligned by `diagonal_alignment`. Defaults to False.
            local_window_size: `w` or `(left, right)`. Defaults to None (no window).
            softmax_type: `"vanilla"`, `"off_by_one"` or `"learnable"`. Defaults to `"vanilla"`.
            logits_soft_cap: `c` in `s <- c * tanh(s / c)`. Defaults to None.
            fp8: None or `"current"`: attention in FP8 with per-tensor scales from the projected query, key and
                value (`attnlib.attention`'s `fp8`, docs/fp8.md). Static. Defaults to None.
            diagonal_alignment: `"top_left"` or `"bottom_right"` (decoding, chunked prefill). Defaults to
                `"top_left"`.
            dropout_rate: dropout probability on the attention weights, in `[0, 1)`; overridable per call.
                Defaults to 0.
            implementation: as `attnlib.attention`'s. Defaults to None (automatic).
            name: module name. Defaults to `"dot_product_attention"`.
            score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> score`, as `attnlib.attention`'s.
                Defaults to None.
            mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool` (True = may attend), as
                `attnlib.attention`'s. Defaults to None.

        Raises:
            ValueError: an argument is invalid (the message names it and shows what was given).
            TypeError: `score_mod` or `mask_mod` is neither None nor callable.
        """
        super().__init__(name=name)
        self.scale = _common.scale(scale)
        self.is_causal = _common.flag("is_causal", is_causal)
        self.local_window_size = _common.local_window_size(local_window_size)
        self.softmax_type = _common.softmax_type(softmax_type)
        self.logits_soft_cap = _common.logits_soft_cap(logits_soft_cap)
        self.fp8 = _common.fp8(fp8)
        self.diagonal_alignment = _common.diagonal_alignment(diagonal_alignment)
        self.score_mod = _common.modifier("score_mod", score_mod)
        self.mask_mod = _common.modifier("mask_mod", mask_mod)
        self.dropout_rate = _common.dropout_rate("dropout_rate", dropout_rate)
        self.implementation = _common.implementation(implementation)

    def __call__(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        *,
        query_seq_lengths: jax.Array | None = None,
        key_value_seq_lengths: jax.Array | None = None,
        q_segment_ids: jax.Array | None = None,
        kv_segment_ids: jax.Array | None = None,
        max_segments_per_row: int | None = None,
        cu_seqlens_q: jax.Array | None = None,
        cu_seqlens_kv: jax.Array | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        page_table: jax.Array | None = None,
        return_residual: bool = False,
        deterministic_backward: bool = False,
        dropout_rate: float | None = None,
        dropout_key: jax.Array | None = None,
        score_mod_args: Sequence[Any] = (),
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """`attnlib.attention(query, key, value, bias, mask, ...)` with this module's options and sinks.

        Args:
            query: `[*B, T, N, H]` (`[T, N, H]` unbatched or THD).
            key: `[*B, S, K, H]`; a page pool `[P, page_size, K, H]` with `page_table`.
            value: `[*B, S, K, Hv]`; a page pool `[P, page_size, K, Hv]` with `page_table`.
            bias: broadcastable to `[*B, N, T, S]`.
            mask: bool, broadcastable to `[*B, N, T, S]`; True = may attend.
            query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids, max_segments_per_row,
                cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, page_table, return_residual,
                deterministic_backward: as `attnlib.attention`. A paged decode step passes the page pools as
                `key` / `value` with `page_table` and `key_value_seq_lengths`.
            dropout_rate: overrides the module's `dropout_rate` for this call. (Keyword only.)
            dropout_key: PRNG key for dropout. Defaults to `hk.next_rng_key()` when the rate is > 0.
            score_mod_args: arrays that the module's `score_mod` / `mask_mod` receive one element of, each
                broadcastable to `[*B, N, T, S]`. Defaults to `()`.

        Returns:
            `out` `[*B, T, N, Hv]`, or `(out, lse)` with `return_residual=True`.

        Raises:
            ValueError, TypeError, NotImplementedError: as `attnlib.attention`.
        """
        with jax.named_scope("attnlib.haiku.DotProductAttention"):
            rate, dropout_key = _dropout(self.dropout_rate, dropout_rate, dropout_key)
            num_heads = jnp.shape(query)[-2]
            return _common.attend(
                query,
                key,
                value,
                bias,
                mask,
                sinks=_sinks(self.softmax_type, num_heads, jnp.result_type(query)),
                dropout_rate=rate,
                dropout_key=dropout_key,
                implementation=self.implementation,
                scale=self.scale,
                is_causal=self.is_causal,
                local_window_size=self.local_window_size,
                logits_soft_cap=self.logits_soft_cap,
                fp8=self.fp8,
                score_mod=self.score_mod,
                mask_mod=self.mask_mod,
                score_mod_args=score_mod_args,
                diagonal_alignment=self.diagonal_alignment,
                query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths,
                q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids,
                max_segments_per_row=max_segments_per_row,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv,
                page_table=page_table,
                return_residual=return_residual,
                deterministic_backward=deterministic_backward,
            )
