"""Scores, visibility, modifiers and dropout for a block of keys: the pieces both plain-JAX implementations share.

Scores are laid out `[B, K, G, T, s]` (query head `n = k * G + g`, `G = N // K`) so grouped-query attention never
repeats key/value heads; `s` is the whole key length (`xla`) or one key block (`xla_chunked`).

`score_mod` / `mask_mod` (written for one score element) are evaluated with `jnp.vectorize` on rank-5 index arrays
that broadcast against the scores (`batch [B, 1, 1, 1|T, 1]`, `head [1, K, G, 1, 1]`, `q_idx [B, 1, 1, T, 1]`,
`kv_idx [B, 1, 1, 1, s]`) and the grouped `score_mod_args`: the result is the scalar function applied element by
element.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from .. import dropout as dropout_lib, explicit_axes, masks, modifiers as modifiers_lib, positions as positions_lib
from ..canonical import Problem
from ..config import AttentionConfig
from ..modifiers import Modifiers


def precision(dtype) -> jax.lax.Precision:
    """Full-precision matmuls for float32 / float64 inputs (no TF32 on GPUs); the default for 16-bit inputs."""
    return jax.lax.Precision.HIGHEST if dtype in (jnp.float32, jnp.float64) else jax.lax.Precision.DEFAULT


def accumulator(dtype) -> type:
    """The dtype of scores, softmax statistics and accumulators: float64 for float64 inputs, else float32."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def grouped_query(config: AttentionConfig, query: jax.Array) -> jax.Array:
    """`[B, T, N, H]` -> `[B, K, G, T, H]`: the score matmul then writes `[B, K, G, T, s]` without a transpose."""
    B, T, N, H = query.shape
    return jnp.transpose(jnp.reshape(query, (B, T, config.num_kv_heads, config.group_size, H)), (0, 2, 3, 1, 4))


def grouped_heads(config: AttentionConfig, x: jax.Array) -> jax.Array:
    """Rank-4 `[B|1, N|1, T|1, s|1]` -> `[B|1, K|1, G|1, T|1, s|1]`."""
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return jnp.reshape(x, (b, config.num_kv_heads, config.group_size, t, s))


def grouped_sinks(config: AttentionConfig, sinks: jax.Array) -> jax.Array:
    """`[N]` -> `[1, K, G, 1]` in the accumulator dtype (float32; float64 for float64 inputs)."""
    return jnp.reshape(sinks.astype(accumulator(config.dtype)), (1, config.num_kv_heads, config.group_size, 1))


def rows(x: jax.Array) -> jax.Array:
    """`[B, K, G, T, X]` -> `[B, K, G·T, X]`: each key head's query rows in one axis, so the grouped matmuls run as
    plain batched matmuls over `(B, K)` (on the CPU, a batch axis of size `G = 1` cost score-sized layout copies:
    docs/performance.md)."""
    B, K, G, T, X = x.shape
    return jnp.reshape(x, (B, K, G * T, X))


def score_dot(query_rows: jax.Array, key: jax.Array, **kwargs) -> jax.Array:
    """`[B, K, G, T, H] x [B, s, K, H] -> [B, K, G, T, s]` (`q.k`, or `dO.v` for the backward)."""
    out = jnp.einsum("bkrh,bskh->bkrs", rows(query_rows), key, **kwargs)
    return jnp.reshape(out, query_rows.shape[:4] + (key.shape[1],))


def rows_dot(p: jax.Array, x: jax.Array, **kwargs) -> jax.Array:
    """`[B, K, G, T, s] x [B, s, K, X] -> [B, K, G, T, X]` (`P.v`, or `dS.k`)."""
    out = jnp.einsum("bkrs,bskx->bkrx", rows(p), x, **kwargs)
    return jnp.reshape(out, p.shape[:4] + (x.shape[-1],))


def keys_dot(p: jax.Array, query_rows: jax.Array, **kwargs) -> jax.Array:
    """`[B, K, G, T, s] x [B, K, G, T, X] -> [B, s, K, X]` (`Pᵀ.dO`, or `dSᵀ.q`), summed over the group (split over a
    mesh axis when the query heads are and the key/value heads are not, MQA: then summed across the shards)."""
    out_sharding = explicit_axes.sharding_from((p, 0), (p, 4), (p, 1), (query_rows, 4))
    return jnp.einsum("bkrs,bkrx->bskx", rows(p), rows(query_rows), out_sharding=out_sharding, **kwargs)


def hidden_score(dtype) -> float:
    """The score of a hidden entry, `-0.7 * finfo(dtype).max` as jax.nn's: finite, so that no intermediate of a call
    whose rows all see a key is inf or NaN (`jax_debug_infs`, `jax_debug_nans`), and far enough from the largest
    negative float that a row max can be subtracted from it. It is also the internal `lse` of a row with nothing
    visible (`returned_lse` makes that -inf). A visible score at or below it counts as hidden."""
    return -0.7 * float(jnp.finfo(dtype).max)


def row_shift(row_max: jax.Array) -> jax.Array:
    """The shift of a row's exponentials: its max (or `lse`), or 0 where nothing is visible (`hidden_score`), so that
    the hidden entries' `exp(hidden_score - shift)` is 0."""
    return jnp.where(row_max > hidden_score(row_max.dtype), row_max, 0.0)


def neg_inf_where_empty(lse: jax.Array) -> jax.Array:
    """`lse` with `-inf` in the rows that see nothing (internally at `hidden_score`), as the public contract has it.

    The -inf is `log(0)` of those rows alone: an inf constant would trip `jax_debug_infs` under `jax.disable_jit`,
    where constants are checked too.
    """
    seen = lse > hidden_score(lse.dtype)
    return jnp.where(seen, lse, jnp.log(seen.astype(lse.dtype)))


def is_neg_inf(s: jax.Array) -> jax.Array:
    """`s == -inf`, without an inf constant (see `neg_inf_where_empty`)."""
    return s < jnp.finfo(s.dtype).min


def returned_lse(config: AttentionConfig, lse: jax.Array) -> jax.Array:
    """The `lse` an implementation returns: `neg_inf_where_empty` when the caller asked for it (`return_residual`);
    otherwise it is discarded, and its empty rows keep the finite `hidden_score`, so that a call with padded query
    rows materialises no inf."""
    return neg_inf_where_empty(lse) if config.return_residual else lse


def statistics(s: jax.Array, allowed: jax.Array, sinks: jax.Array | None, *, every_key_visible: bool = False):
    """`(exp(s - shift) on allowed entries (0 elsewhere), the row sums (sink included; 1 where nothing is
    visible), lse)` of scores `[..., S]`. The shift is the row max (and sink), 0 for a row with nothing visible;
    such a row's `lse` is `hidden_score` (`neg_inf_where_empty` makes it -inf).

    `every_key_visible` (static: all of `allowed` is true, no sinks, every score finite) drops the guards for rows
    that see nothing; XLA's CPU backend then fuses the max, exp and sum into the matmul (docs/performance.md).
    """
    if every_key_visible:
        row_max = jnp.max(s, axis=-1)
        unnormalised = jnp.exp(s - jax.lax.stop_gradient(row_max)[..., None])
        denominator = jnp.sum(unnormalised, axis=-1)
        return unnormalised, denominator, row_max + jnp.log(denominator)
    hidden = hidden_score(s.dtype)
    masked = jnp.where(allowed, s, hidden)
    row_max = jnp.max(masked, axis=-1, initial=hidden)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks)
    # The softmax is invariant to the shift, so it carries no gradient.
    shift = jax.lax.stop_gradient(row_shift(row_max))
    unnormalised = jnp.exp(masked - shift[..., None])
    denominator = jnp.sum(unnormalised, axis=-1)
    if sinks is not None:
        denominator = denominator + jnp.exp(sinks - shift)
    has_mass = denominator > 0
    safe_denominator = jnp.where(has_mass, denominator, 1.0)
    lse = jnp.where(has_mass, shift + jnp.log(safe_denominator), hidden)
    return unnormalised, safe_denominator, lse


def sinks_gradient(config: AttentionConfig, sinks: jax.Array, lse: jax.Array, correction: jax.Array) -> jax.Array:
    """`[N]` gradient of the sink logits from `lse` and the correction `D - d_lse`, both `[B, K, G, T]`:
    d lse / d sink = p_sink, and the output depends on the sink only through the normaliser."""
    p_sink = jnp.exp(grouped_sinks(config, sinks) - lse)
    return jnp.reshape(jnp.sum(-p_sink * correction, axis=(0, 3)), (config.num_q_heads,)).astype(sinks.dtype)


def logit_scale(config: AttentionConfig, scale: jax.Array | None, dtype) -> jax.Array:
    """The logit scale in `dtype`: the runtime 0-d array `scale` (`Problem.scale`) when `config.scale` is None."""
    if config.scale is None:
        return scale.astype(dtype)
    return jnp.asarray(config.scale, dtype)


def raw_scores(
    config: AttentionConfig,
    q5: jax.Array,
    key: jax.Array,
    bias: jax.Array | None,
    *,
    scale_query: bool = False,
    scale: jax.Array | None = None,
) -> jax.Array:
    """`[B, K, G, T, s]` scores `scale * q.k (+ bias)` in the accumulator dtype, before soft-capping.

    Args:
        q5: `[B, K, G, T, H]`.
        key: `[B, s, K, H]`.
        bias: rank-4 bias block or None.
        scale_query: multiply the `[T, H]`-sized query by the scale instead of the scores (one pass over the scores
            fewer on the CPU); only for float32 / float64 queries, as rounding `q * scale` to 16 bits would perturb
            the scores.
        scale: the runtime scale (`Problem.scale`) when `config.scale` is None.
    """
    acc = accumulator(q5.dtype)
    if scale_query:
        if acc != q5.dtype:
            raise ValueError(f"scale_query needs a float32 or float64 query, got {q5.dtype}")
        q5 = q5 * logit_scale(config, scale, q5.dtype)
    s = score_dot(q5, key, preferred_element_type=acc, precision=precision(q5.dtype))
    if not scale_query:
        s = s * logit_scale(config, scale, s.dtype)
    if bias is not None:
        s = s + grouped_heads(config, bias).astype(s.dtype)
    return s


def soft_cap(config: AttentionConfig, s: jax.Array) -> jax.Array:
    """`c * tanh(s / c)` when `logits_soft_cap` is set."""
    if config.logits_soft_cap is None:
        return s
    c = jnp.asarray(config.logits_soft_cap, s.dtype)
    return c * jnp.tanh(s / c)


def visible(
    config: AttentionConfig, problem: Problem, k_start: jax.Array | int, k_size: int, mask: jax.Array | None
) -> jax.Array:
    """Bool `[B, 1|K, 1|G, T, s]` for keys `k_start : k_start + k_size` (`mask` already sliced to them)."""
    p = problem.positions
    kv_segment = None if p.kv_segment is None else jax.lax.dynamic_slice_in_dim(p.kv_segment, k_start, k_size, axis=1)
    kv_position = jax.lax.dynamic_slice_in_dim(p.kv_position, k_start, k_size, axis=1)
    allowed = masks.visible(
        p.q_segment, p.q_position, kv_segment, kv_position, is_causal=config.is_causal, window=config.window
    )[:, None, None]
    if mask is not None:
        allowed = allowed & grouped_heads(config, mask)
    return allowed


def dropout_keep(
    config: AttentionConfig,
    seeds: jax.Array,
    batch: int,
    q_len: int,
    k_start: jax.Array | int,
    k_size: int,
    *,
    q_start: jax.Array | int = 0,
) -> jax.Array:
    """Bool `[B, K, G, t, s]` keep mask for query rows `q_start : q_start + q_len` and keys
    `k_start : k_start + k_size`."""
    K, G = config.num_kv_heads, config.group_size
    index = lambda start, size: jnp.asarray(start, jnp.int32) + jnp.arange(size, dtype=jnp.int32)
    b = index(0, batch)[:, None, None, None, None]
    n = (index(0, K)[:, None] * G + index(0, G)[None, :])[None, :, :, None, None]
    i = index(q_start, q_len)[None, None, None, :, None]
    j = index(k_start, k_size)[None, None, None, None, :]
    return dropout_lib.keep_mask_from_seeds(seeds, config.dropout_rate, b, n, i, j)


# ------------------------------------------------------------------------------------------------------------------
# score_mod / mask_mod


class ModifierFns(NamedTuple):
    """The element-wise functions of a call's modifiers (None where absent)."""

    score: Callable | None
    mask: Callable | None


class JaxprFn(NamedTuple):
    """A modifier's traced jaxpr evaluated with `consts` in place of the arrays it closed over; called as the
    function."""

    jaxpr: jex.ClosedJaxpr
    consts: tuple

    def __call__(self, *args):
        return jex.jaxpr_as_fun(jex.ClosedJaxpr(self.jaxpr.jaxpr, list(self.consts)))(*args)[0]


def modifier_fns(modifiers: Modifiers, score_consts=None, mask_consts=None) -> ModifierFns:
    """The functions to evaluate.

    Without constants: the caller's functions as written (`xla`, where JAX autodiff differentiates them, closures
    included). With `score_consts` / `mask_consts`: the traced jaxprs evaluated with these arrays in place of the
    closed-over ones (the same computation; `xla_chunked` passes the constants through its `custom_vjp` explicitly,
    which may not close over traced values).
    """
    score, mask = modifiers.score_mod, modifiers.mask_mod
    if score is not None and score_consts is not None:
        score = JaxprFn(modifiers.score_jaxpr, tuple(score_consts))
    if mask is not None and mask_consts is not None:
        mask = JaxprFn(modifiers.mask_jaxpr, tuple(mask_consts))
    return ModifierFns(score, mask)


def traced_fns(modifiers: Modifiers, score_dtype) -> ModifierFns:
    """The caller's functions traced on scalars of the call's dtypes (the score in `score_dtype`), the arrays they
    close over (traced ones included) as the jaxprs' constants: the same computation as `modifier_fns(modifiers)`,
    whose closures `elementwise` can pass on as operands (`xla` under explicit mesh axes)."""
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = tuple(jax.ShapeDtypeStruct((), d) for d in modifiers.arg_dtypes)
    trace = lambda fn, *avals: None if fn is None else modifiers_lib.trace_without_mesh(fn, *avals)
    score = trace(modifiers.score_mod, jax.ShapeDtypeStruct((), score_dtype), *(index,) * 4, *args)
    mask = trace(modifiers.mask_mod, *(index,) * 4, *args)
    as_fn = lambda closed: None if closed is None else JaxprFn(closed, tuple(closed.consts))
    return ModifierFns(as_fn(score), as_fn(mask))


def elementwise(fn: Callable, *operands, out_sharding) -> jax.Array:
    """`jnp.vectorize(fn)(*operands)`. Under explicit mesh axes (`out_sharding` given) it runs on automatic ones
    (`explicit_axes.on_automatic_axes`), a `JaxprFn`'s constants entering as operands (arrays closed over there would
    stay typed on the explicit axes)."""
    consts = fn.consts if isinstance(fn, JaxprFn) else ()

    def run(consts, *operands):
        return jnp.vectorize(fn._replace(consts=tuple(consts)) if isinstance(fn, JaxprFn) else fn)(*operands)

    return explicit_axes.on_automatic_axes(run, consts, *operands, out_sharding=out_sharding)


def modifier_indices(
    config: AttentionConfig, problem: Problem, k_start: jax.Array | int, k_size: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """int32 `(batch, head, q_idx, kv_idx)` for keys `k_start : k_start + k_size`, rank 5 against `[B, K, G, T, s]`.

    `batch` is the canonical row (THD: the query's 0-based sequence), `head` the query head `n = k * G + g`,
    `q_idx` / `kv_idx` the aligned positions within the sequence (`TokenPositions`).
    """
    p = problem.positions
    B = p.q_position.shape[0]
    batch = positions_lib.batch_index(p, B, thd=config.layout == "thd")[:, None, None, :, None]
    head = jnp.arange(config.num_q_heads, dtype=jnp.int32)
    head = jnp.reshape(head, (1, config.num_kv_heads, config.group_size, 1, 1))
    q_idx = p.q_position.astype(jnp.int32)[:, None, None, :, None]
    kv_idx = jax.lax.dynamic_slice_in_dim(p.kv_position, k_start, k_size, axis=1).astype(jnp.int32)
    return batch, head, q_idx, kv_idx[:, None, None, None, :]


def grouped_args(config: AttentionConfig, args) -> tuple[jax.Array, ...]:
    """Rank-4 `score_mod_args` (already sliced to the key block) -> rank 5 `[B|1, K|1, G|1, T|1, s|1]`."""
    return tuple(grouped_heads(config, a) for a in args)


def apply_score_mod(fn: Callable, s: jax.Array, indices, args) -> jax.Array:
    """`score_mod` of every score of `s [B, K, G, T, s]`, element by element, in `s`'s dtype."""
    return elementwise(fn, s, *indices, *args, out_sharding=explicit_axes.sharding_like(s, s.shape)).astype(s.dtype)


def apply_mask_mod(fn: Callable, indices, args, like: jax.Array) -> jax.Array:
    """Bool `mask_mod` of every (row, head, query, key) of the block, broadcastable to `[B, K, G, T, s]`; `like`
    is the block's scores, whose sharding the result takes under explicit axes."""
    out_sharding = explicit_axes.sharding_like(like, jnp.broadcast_shapes(*(jnp.shape(x) for x in (*indices, *args))))
    return elementwise(fn, *indices, *args, out_sharding=out_sharding).astype(bool)


def modify(fns: ModifierFns, s: jax.Array, allowed: jax.Array, indices, args) -> tuple[jax.Array, jax.Array]:
    """Raw scores and visibility -> `score_mod`-ified scores and visibility AND `mask_mod` AND (modified != -inf)."""
    if fns.mask is not None:
        allowed = allowed & apply_mask_mod(fns.mask, indices, args, like=s)
    if fns.score is not None:
        s = apply_score_mod(fns.score, s, indices, args)
        allowed = allowed & ~is_neg_inf(s)
    return s, allowed
