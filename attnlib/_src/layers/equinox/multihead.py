"""`MultiheadAttention`: a drop-in for `equinox.nn.MultiheadAttention` computed by `attnlib.attention`."""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, final

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Shaped

from ... import dispatch, explicit_axes
from .. import _common
from ._shared import _default_dtype, _dropout_plan


_ProcessHeads = Callable[
    [
        Float[Array, "q_seq num_heads qk_size"],
        Float[Array, "kv_seq num_kv_heads qk_size"],
        Float[Array, "kv_seq num_kv_heads vo_size"],
    ],
    tuple[
        Float[Array, "q_seq num_heads qk_size"],
        Float[Array, "kv_seq num_kv_heads qk_size"],
        Float[Array, "kv_seq num_kv_heads vo_size"],
    ],
]
_Mask = Shaped[ArrayLike, "#q_seq #kv_seq"] | Shaped[ArrayLike, "#num_heads #q_seq #kv_seq"]


@final
class MultiheadAttention(eqx.Module):
    r"""Multi-head attention: a drop-in for `equinox.nn.MultiheadAttention` computed by `attnlib.attention`.

    $$\text{MultiheadAttention}(Q, K, V) = \sum_i \text{Attention}\left(QW^Q_i, KW^K_i, VW^V_i\right)W^O_i$$

    Same constructor arguments, fields, parameter initialisation and unbatched `__call__` as
    `equinox.nn.MultiheadAttention` (Equinox 0.13): weights copied from an Equinox layer (`equinox.tree_at`, or a
    checkpoint read with `equinox.tree_deserialise_leaves`) give the same output. The attention itself is one
    fused `attnlib.attention` call over all heads; under `jax.vmap` it becomes one batched call.

    Extras, all keyword-only: `num_kv_heads` (grouped-query attention), `is_causal`, `local_window_size`,
    `softmax_type` (`"vanilla"`, `"off_by_one"`, `"learnable"` with a trainable per-head `sinks` field),
    `logits_soft_cap`, `fp8`, `score_mod` / `mask_mod` (custom scores and masks, static fields; their array arguments
    are the call's `score_mod_args`) and `implementation`.

    !!! faq "Differences from `equinox.nn.MultiheadAttention`"

        - A query row that may attend to no key (its mask row is all `False`) outputs zeros before the output
          projection (so `output_proj`'s bias only); Equinox averages all values uniformly.
        - Dropout draws its mask from attnlib's own generator (one `key` for all heads), so the dropped entries
          differ from Equinox's for the same `key`; the rate, scaling and `inference` rules are the same.
          `dropout.p` must be a concrete Python float (it is static to attnlib).
        - `mask` may also have size-1 (broadcast) dimensions and any dtype (nonzero = may attend).
        - The projected heads may be float16, bfloat16, float32 or float64 (float64 on the plain-JAX
          implementations).

    !!! Example
        ```python
        mha = attnlib.equinox.MultiheadAttention(
            num_heads=8, query_size=512, num_kv_heads=2, is_causal=True, local_window_size=(256, 0),
            softmax_type="learnable", key=jax.random.key(0))
        y = jax.vmap(mha)(x, x, x)  # x: [batch, seq, 512]
        ```
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    sinks: Float[Array, " num_heads"] | None

    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    is_causal: bool = eqx.field(static=True)
    local_window_size: int | tuple[int, int] | None = eqx.field(static=True)
    softmax_type: str = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)
    fp8: str | None = eqx.field(static=True)
    score_mod: Callable | None = eqx.field(static=True)
    mask_mod: Callable | None = eqx.field(static=True)
    implementation: dispatch.ImplementationRequest = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype: Any = None,
        *,
        num_kv_heads: int | None = None,
        is_causal: bool = False,
        local_window_size: int | tuple[int, int] | None = None,
        softmax_type: _common.SoftmaxType = "vanilla",
        logits_soft_cap: float | None = None,
        fp8: str | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        implementation: dispatch.ImplementationRequest = None,
        key: PRNGKeyArray,
    ):
        r"""Builds the projections exactly as `equinox.nn.MultiheadAttention` does (same `key` → same weights).

        Args:
            num_heads: number of query heads $h$ (`N`).
            query_size: input channels of the query.
            key_size: input channels of the key. Defaults to `query_size`.
            value_size: input channels of the value. Defaults to `query_size`.
            output_size: output channels. Defaults to `query_size`.
            qk_size: channels per head over which query and key are compared (`H`). Defaults to
                `query_size // num_heads`.
            vo_size: channels per head of the projected values (`Hv`). Defaults to `query_size // num_heads`.
            use_query_bias: bias in the query projection. Defaults to False.
            use_key_bias: bias in the key projection. Defaults to False.
            use_value_bias: bias in the value projection. Defaults to False.
            use_output_bias: bias in the output projection. Defaults to False.
            dropout_p: dropout probability on the attention weights, in `[0, 1)`. Defaults to 0.
            inference: if True, dropout is not applied (toggle with `equinox.nn.inference_mode` or override in
                `__call__`). Defaults to False.
            dtype: dtype of every parameter. Defaults to float32 (float64 in JAX's x64 mode, as Equinox; attnlib
                then rejects the float64 heads at call time).
            num_kv_heads: number of key/value heads `K` (grouped-query attention: `key_proj` and `value_proj`
                produce `K` heads, and query head `n` uses key/value head `n // (N // K)`). Must divide
                `num_heads`. Defaults to `num_heads`.
            is_causal: causal mask (query `i` sees keys `j <= i`, top-left aligned). Defaults to False.
            local_window_size: `w` or `(left, right)`: query `i` sees keys `i - left … i + right`. Defaults to None
                (no window).
            softmax_type: `"vanilla"`; `"off_by_one"` (a zero logit in every softmax denominator); or
                `"learnable"` (a trainable per-head logit `sinks` `[num_heads]`, initialised to zeros). Defaults
                to `"vanilla"`.
            logits_soft_cap: `c` in `s <- c * tanh(s / c)`. Defaults to None (no cap).
            fp8: None or `"current"`: attention in FP8 with per-tensor scales from the projected query, key and
                value (`attnlib.attention`'s `fp8`, docs/fp8.md). Static. Defaults to None.
            score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> score`, written in `jax.numpy` for
                one score element, as `attnlib.attention`'s (applied after the scale, before `logits_soft_cap` and
                the masks; `*args` are one element of each of the call's `score_mod_args`). Static: part of the
                layer's structure, not a parameter. Defaults to None.
            mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool` (True = may attend), ANDed with the
                other masks; static. Defaults to None.
            implementation: as `attnlib.attention`'s `implementation`. Defaults to None (automatic).
            key: PRNG key for the parameter initialisation. (Keyword only.)

        Raises:
            ValueError: an argument is invalid (the message names it and shows what was given).
            TypeError: `score_mod` or `mask_mod` is neither None nor callable.
        """
        # Checked here, before anything is built from them; `__check_init__` re-checks every field.
        score_mod = _common.modifier("score_mod", score_mod)
        mask_mod = _common.modifier("mask_mod", mask_mod)
        num_heads = _common.positive_int("num_heads", num_heads)
        query_size = _common.positive_int("query_size", query_size)
        dtype = _default_dtype() if dtype is None else dtype
        qkey, kkey, vkey, okey = jrandom.split(key, 4)

        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        output_size = query_size if output_size is None else output_size
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, size in (("key_size", key_size), ("value_size", value_size), ("output_size", output_size)):
            _common.positive_int(name, size)
        for name, size in (("qk_size", qk_size), ("vo_size", vo_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(
                    f"`{name}` must be a positive int (it defaults to query_size // num_heads = "
                    f"{query_size} // {num_heads}). Got {name}={size!r}."
                )
        num_kv_heads = _common.num_kv_heads(num_kv_heads, num_heads)
        _common.dropout_rate("dropout_p", dropout_p)

        self.query_proj = eqx.nn.Linear(query_size, num_heads * qk_size, use_bias=use_query_bias, dtype=dtype, key=qkey)
        self.key_proj = eqx.nn.Linear(key_size, num_kv_heads * qk_size, use_bias=use_key_bias, dtype=dtype, key=kkey)
        self.value_proj = eqx.nn.Linear(
            value_size, num_kv_heads * vo_size, use_bias=use_value_bias, dtype=dtype, key=vkey
        )
        self.output_proj = eqx.nn.Linear(
            num_heads * vo_size, output_size, use_bias=use_output_bias, dtype=dtype, key=okey
        )
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        softmax_type = _common.softmax_type(softmax_type)
        self.sinks = jnp.zeros((num_heads,), dtype) if softmax_type == "learnable" else None

        self.num_heads = num_heads
        self.query_size = query_size
        self.key_size = key_size
        self.value_size = value_size
        self.output_size = output_size
        self.qk_size = qk_size
        self.vo_size = vo_size
        self.use_query_bias = use_query_bias
        self.use_key_bias = use_key_bias
        self.use_value_bias = use_value_bias
        self.use_output_bias = use_output_bias
        self.num_kv_heads = num_kv_heads
        self.is_causal = is_causal
        self.local_window_size = _common.local_window_size(local_window_size)
        self.softmax_type = softmax_type
        self.logits_soft_cap = _common.logits_soft_cap(logits_soft_cap)
        self.fp8 = _common.fp8(fp8)
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.implementation = _common.implementation(implementation)

    def __check_init__(self):
        for name in ("num_heads", "query_size", "key_size", "value_size", "output_size", "qk_size", "vo_size"):
            _common.positive_int(name, getattr(self, name))
        _common.flag("is_causal", self.is_causal)  # (Equinox's own `use_*_bias` flags stay unchecked, as there)
        _common.num_kv_heads(self.num_kv_heads, self.num_heads)
        _common.local_window_size(self.local_window_size)
        _common.softmax_type(self.softmax_type)
        _common.logits_soft_cap(self.logits_soft_cap)
        _common.fp8(self.fp8)
        _common.modifier("score_mod", self.score_mod)
        _common.modifier("mask_mod", self.mask_mod)
        _common.implementation(self.implementation)
        _common.dropout_rate("dropout_p", self.dropout.p)
        if (self.sinks is None) != (self.softmax_type != "learnable"):
            raise ValueError(
                f"`sinks` must be an array [num_heads] exactly when softmax_type='learnable'. "
                f"Got softmax_type={self.softmax_type!r}, sinks={self.sinks!r}."
            )

    @jax.named_scope("attnlib.equinox.MultiheadAttention")
    def __call__(
        self,
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"],
        value: Float[Array, "kv_seq v_size"],
        mask: None | _Mask = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: None | _ProcessHeads = None,
        score_mod_args: Sequence[Any] = (),
    ) -> Float[Array, "q_seq o_size"]:
        """Multi-head attention of one (unbatched) sequence; `jax.vmap` it over a batch.

        Args:
            query: `[q_seq, query_size]`.
            key_: `[kv_seq, key_size]`.
            value: `[kv_seq, value_size]`.
            mask: `[q_seq, kv_seq]`, or per head `[num_heads, q_seq, kv_seq]` (size-1 dimensions broadcast);
                `False` (zero) = may not attend. Combined with `is_causal` / `local_window_size`.
            key: PRNG key for dropout; unused when `dropout.p == 0` or in inference. (Keyword only.)
            inference: overrides `dropout.inference` when not None (True = no dropout). (Keyword only.)
            deterministic: deprecated alias of `inference`. (Keyword only.)
            process_heads: a function `(query_heads [q_seq, N, qk], key_heads [kv_seq, K, qk], value_heads
                [kv_seq, K, vo]) -> (same shapes)`, applied after the projections (e.g. rotary embeddings).
                (Keyword only.)
            score_mod_args: arrays that `score_mod` / `mask_mod` receive one element of, each broadcastable to
                `[num_heads, q_seq, kv_seq]` (e.g. ALiBi slopes `[num_heads, 1, 1]`); traced, float ones
                differentiable. Needs `score_mod` or `mask_mod`. Defaults to `()`. (Keyword only.)

        Returns:
            `[q_seq, output_size]`.

        Raises:
            ValueError: a shape is invalid, or `process_heads` changes the shapes of the heads.
            RuntimeError: dropout is active but `key` is None (as Equinox).
        """
        layer = "attnlib.equinox.MultiheadAttention"
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "MultiheadAttention()(deterministic=...) is deprecated in favour of "
                "MultiheadAttention()(inference=...)",
                DeprecationWarning,
                stacklevel=3,
            )
        for name, x, size, size_name in (
            ("query", query, self.query_size, "query_size"),
            ("key_", key_, self.key_size, "key_size"),
            ("value", value, self.value_size, "value_size"),
        ):
            if jnp.ndim(x) != 2 or jnp.shape(x)[1] != size:
                raise ValueError(
                    f"`{name}` must be one unbatched sequence of shape (seq, {size_name})=(seq, {size}) "
                    f"(use `jax.vmap` for a batch). Got {name}.shape={jnp.shape(x)}."
                )
        query_seq_length, kv_seq_length = query.shape[0], key_.shape[0]
        if value.shape[0] != kv_seq_length:
            raise ValueError(
                f"`key_` and `value` must have the same sequence length. Got key_.shape={key_.shape}, "
                f"value.shape={value.shape}."
            )
        mask = _common.bool_mask(mask)
        if mask is not None and not (
            mask.ndim in (2, 3)
            and all(
                d in (1, t)
                for d, t in zip(mask.shape[::-1], (kv_seq_length, query_seq_length, self.num_heads), strict=False)
            )
        ):
            raise ValueError(
                "`mask` must have shape (q_seq, kv_seq)="
                f"({query_seq_length}, {kv_seq_length}) or (num_heads, q_seq, kv_seq)=({self.num_heads}, "
                f"{query_seq_length}, {kv_seq_length}) (size-1 dimensions broadcast). Got mask.shape={mask.shape}."
            )

        query_heads = self._project(self.query_proj, query, self.num_heads)
        key_heads = self._project(self.key_proj, key_, self.num_kv_heads)
        value_heads = self._project(self.value_proj, value, self.num_kv_heads)
        if process_heads is not None:
            shapes = (query_heads.shape, key_heads.shape, value_heads.shape)
            query_heads, key_heads, value_heads = process_heads(query_heads, key_heads, value_heads)
            new_shapes = (query_heads.shape, key_heads.shape, value_heads.shape)
            if new_shapes != shapes:
                raise ValueError(
                    f"`process_heads` must not change the shapes of the heads. Got {shapes} -> {new_shapes}."
                )
        _common.attention_dtype(layer, query_heads)

        rate, dropout_key = _dropout_plan(self.dropout, key, inference, layer)
        attn = _common.attend(
            query_heads,
            key_heads,
            value_heads,
            mask=mask,
            sinks=_common.sinks_for(self.softmax_type, self.sinks, self.num_heads, query_heads.dtype),
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
        attn = attn.reshape(query_seq_length, -1)
        # Under explicit mesh axes the heads may be split over an axis that the output projection sums over: XLA's
        # partitioner places that sum, and the output is typed like `query`.
        out_sharding = explicit_axes.sharding_like(query, (query_seq_length, self.output_size))
        project = lambda proj, x: jax.vmap(proj)(x)
        return explicit_axes.on_automatic_axes(project, self.output_proj, attn, out_sharding=out_sharding)

    def _project(self, proj: eqx.nn.Linear, x: Array, num_heads: int) -> Array:
        seq_length, _ = x.shape
        projection = jax.vmap(proj)(x)
        return projection.reshape(seq_length, num_heads, -1)
