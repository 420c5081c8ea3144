"""`DotProductAttention`: the attention core of `MultiheadAttention` without projections, as an Equinox layer."""

from collections.abc import Callable, Sequence
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray, Shaped

from ... import dispatch
from .. import _common
from ._shared import _default_dtype, _dropout_plan


@final
class DotProductAttention(eqx.Module):
    r"""The attention core of `MultiheadAttention` without projections: `attnlib.attention` as an Equinox layer.

    Holds the static options (including `score_mod` / `mask_mod`) and, for `softmax_type="learnable"`, the
    trainable per-head `sinks`; every per-call argument of `attnlib.attention` (bias, mask, padding lengths, segment
    ids, `cu_seqlens`, page tables, `score_mod_args`) is a `__call__` argument. Shapes are those of
    `attnlib.attention`: unbatched `[T, N, H]` (the Equinox convention, `jax.vmap` for a batch) or batched
    `[*B, T, N, H]`; THD and paged layouts as there.

    !!! Example
        ```python
        core = attnlib.equinox.DotProductAttention(num_heads=8, is_causal=True, softmax_type="learnable")
        out = core(q, k, v)  # q: [T, 8, H], k: [S, K, H], v: [S, K, Hv] -> [T, 8, Hv]
        ```
    """

    dropout: eqx.nn.Dropout
    sinks: Float[Array, " num_heads"] | None

    num_heads: int | None = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    is_causal: bool = eqx.field(static=True)
    local_window_size: int | tuple[int, int] | None = eqx.field(static=True)
    softmax_type: str = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)
    fp8: str | None = eqx.field(static=True)
    score_mod: Callable | None = eqx.field(static=True)
    mask_mod: Callable | None = eqx.field(static=True)
    diagonal_alignment: str = eqx.field(static=True)
    implementation: dispatch.ImplementationRequest = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int | None = None,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        softmax_type: _common.SoftmaxType = "vanilla",
        logits_soft_cap: float | None = None,
        fp8: str | None = None,
        diagonal_alignment: str = "top_left",
        dropout_p: float = 0.0,
        inference: bool = False,
        implementation: dispatch.ImplementationRequest = None,
        dtype: Any = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
    ):
        """Stores the options; creates `sinks` (zeros `[num_heads]`) for `softmax_type="learnable"`.

        Args:
            num_heads: number of query heads `N`; required for `softmax_type="learnable"` (the shape of `sinks`),
                otherwise optional (when given, `__call__` checks it). Defaults to None.
            scale: logit scale. Defaults to `1/sqrt(H)`.
            is_causal: causal mask, aligned by `diagonal_alignment`. Defaults to False.
            local_window_size: `w` or `(left, right)`. Defaults to None (no window).
            softmax_type: `"vanilla"`, `"off_by_one"` or `"learnable"`. Defaults to `"vanilla"`.
            logits_soft_cap: `c` in `s <- c * tanh(s / c)`. Defaults to None.
            fp8: None or `"current"`: attention in FP8 with per-tensor scales from the projected query, key and
                value (`attnlib.attention`'s `fp8`, docs/fp8.md). Static. Defaults to None.
            diagonal_alignment: `"top_left"` or `"bottom_right"` (decoding, chunked prefill). Defaults to
                `"top_left"`.
            dropout_p: dropout probability on the attention weights, in `[0, 1)`. Defaults to 0.
            inference: if True, dropout is not applied. Defaults to False.
            implementation: as `attnlib.attention`'s. Defaults to None (automatic).
            dtype: dtype of `sinks`. Defaults to float32 (float64 in JAX's x64 mode).
            score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> score`, as `attnlib.attention`'s;
                static. Defaults to None.
            mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool` (True = may attend), as
                `attnlib.attention`'s; static. Defaults to None.

        Raises:
            ValueError: an argument is invalid (the message names it and shows what was given).
            TypeError: `score_mod` or `mask_mod` is neither None nor callable.
        """
        score_mod = _common.modifier("score_mod", score_mod)
        mask_mod = _common.modifier("mask_mod", mask_mod)
        softmax_type = _common.softmax_type(softmax_type)
        if num_heads is not None:
            num_heads = _common.positive_int("num_heads", num_heads)
        elif softmax_type == "learnable":
            raise ValueError(
                "`num_heads` is required with softmax_type='learnable' (it is the shape of `sinks`). "
                "Got num_heads=None."
            )
        _common.dropout_rate("dropout_p", dropout_p)
        dtype = _default_dtype() if dtype is None else dtype
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        self.sinks = jnp.zeros((num_heads,), dtype) if softmax_type == "learnable" else None
        self.num_heads = num_heads
        self.scale = _common.scale(scale)
        self.is_causal = is_causal
        self.local_window_size = _common.local_window_size(local_window_size)
        self.softmax_type = softmax_type
        self.logits_soft_cap = _common.logits_soft_cap(logits_soft_cap)
        self.fp8 = _common.fp8(fp8)
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.diagonal_alignment = _common.diagonal_alignment(diagonal_alignment)
        self.implementation = _common.implementation(implementation)

    def __check_init__(self):
        if self.num_heads is not None:
            _common.positive_int("num_heads", self.num_heads)
        _common.flag("is_causal", self.is_causal)
        _common.scale(self.scale)
        _common.local_window_size(self.local_window_size)
        _common.softmax_type(self.softmax_type)
        _common.logits_soft_cap(self.logits_soft_cap)
        _common.fp8(self.fp8)
        _common.modifier("score_mod", self.score_mod)
        _common.modifier("mask_mod", self.mask_mod)
        _common.diagonal_alignment(self.diagonal_alignment)
        _common.implementation(self.implementation)
        _common.dropout_rate("dropout_p", self.dropout.p)

    @jax.named_scope("attnlib.equinox.DotProductAttention")
    def __call__(
        self,
        query: Float[Array, "*B T N H"],
        key_: Float[Array, "... K H"],
        value: Float[Array, "... K Hv"],
        bias: Float[ArrayLike, "*#B #N #T #S"] | None = None,
        mask: Shaped[ArrayLike, "*#B #N #T #S"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        query_seq_lengths: Int[ArrayLike, " *B"] | None = None,
        key_value_seq_lengths: Int[ArrayLike, " *B"] | None = None,
        q_segment_ids: Int[ArrayLike, "*B T"] | None = None,
        kv_segment_ids: Int[ArrayLike, "*B S"] | None = None,
        max_segments_per_row: int | None = None,
        cu_seqlens_q: Int[ArrayLike, " num_seqs_plus_1"] | None = None,
        cu_seqlens_kv: Int[ArrayLike, " num_seqs_plus_1"] | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        page_table: Int[ArrayLike, "num_seqs pages_per_seq"] | None = None,
        return_residual: bool = False,
        deterministic_backward: bool = False,
        score_mod_args: Sequence[Any] = (),
    ) -> Float[Array, "*B T N Hv"] | tuple[Float[Array, "*B T N Hv"], Float[Array, "*B T N"]]:
        """`attnlib.attention(query, key_, value, bias, mask, ...)` with this layer's options and sinks.

        Args:
            query: `[*B, T, N, H]` (`[T, N, H]` unbatched or THD).
            key_: `[*B, S, K, H]`; a page pool `[P, page_size, K, H]` with `page_table`.
            value: `[*B, S, K, Hv]`; a page pool `[P, page_size, K, Hv]` with `page_table`.
            bias: broadcastable to `[*B, N, T, S]`; added to the scaled logits.
            mask: bool, broadcastable to `[*B, N, T, S]`; True = may attend.
            key: PRNG key for dropout; unused when `dropout.p == 0` or in inference. (Keyword only.)
            inference: overrides `dropout.inference` when not None. (Keyword only.)
            query_seq_lengths, key_value_seq_lengths, q_segment_ids, kv_segment_ids, max_segments_per_row,
                cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, page_table, return_residual,
                deterministic_backward: as `attnlib.attention`. A paged decode step passes the page pools as
                `key_` / `value` with `page_table` and `key_value_seq_lengths`.
            score_mod_args: arrays that the layer's `score_mod` / `mask_mod` receive one element of, each
                broadcastable to `[*B, N, T, S]`; traced. Defaults to `()`. (Keyword only.)

        Returns:
            `out` `[*B, T, N, Hv]`, or `(out, lse)` with `return_residual=True`.

        Raises:
            ValueError, TypeError, NotImplementedError: as `attnlib.attention`; ValueError when `query` does not
                have the `num_heads` heads the layer was built with.
            RuntimeError: dropout is active but `key` is None (as `equinox.nn.Dropout`).
        """
        layer = "attnlib.equinox.DotProductAttention"
        num_heads = jnp.shape(query)[-2] if jnp.ndim(query) >= 2 else None
        if self.num_heads is not None and num_heads != self.num_heads:
            raise ValueError(
                f"`query` must have num_heads={self.num_heads} heads (axis -2 of [*B, T, N, H]), as this layer was "
                f"built with. Got query.shape={jnp.shape(query)}."
            )
        rate, dropout_key = _dropout_plan(self.dropout, key, inference, layer)
        return _common.attend(
            query,
            key_,
            value,
            bias,
            mask,
            sinks=None
            if num_heads is None
            else _common.sinks_for(self.softmax_type, self.sinks, num_heads, jnp.result_type(query)),
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
