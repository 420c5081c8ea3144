"""`implementation="xla_chunked"`: online softmax over key blocks (the flash-attention algorithm in plain JAX).

The forward keeps a running maximum, denominator and output per query and visits the keys one block at a time, so
memory is linear in the key length. Under a band that holds on the token indices whatever the runtime lengths are
(`Band.on_indices`: causal or window bounds) the queries are cut into blocks too, and one loop of static trip count
visits only the (query block, key block) tiles the band touches (`Tiles`): a fully-masked tile costs nothing, on
every backend (no per-block `lax.cond`, which a TPU or a `vmap` may turn into computing both branches).

The backward (`custom_vjp`) recomputes each block's probabilities from the saved `lse` instead of storing them —
except when the keys fit in one block: then the forward's probabilities (at most `AUTO_MIN_SCORE_BYTES`) are kept for
the backward, which on a CPU made small problems faster than jax.nn's (docs/performance.md).

`score_mod` / `mask_mod` run on each key block as the jaxprs traced by `modifiers.describe`, with the arrays they
close over passed through the `custom_vjp` as explicit inputs (a `custom_vjp` may not close over traced values).
The backward differentiates `score_mod` per block with `jax.vjp`: the raw-score gradient feeds `query`, `key` and
`bias`; the gradients of float `score_mod_args` (sliced per key block like `bias`) and of float closed-over arrays
are accumulated exactly.
"""

import copy
import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp

from .. import canonical, explicit_axes, fp8 as fp8_lib, varying
from ..band import Band
from ..config import AttentionConfig, AttentionInputs
from . import one_block, placement, scores
from .base import Context, Implementation
from .tiles import add_at, pad_keys, pad_queries, plan_tiles, query_rows, rows_of, set_rows, slice_keys, Tiles


BLOCK_K = 512
"""Keys per block unless configured (`XlaChunked(block_k=...)`)."""

AUTO_MIN_SCORE_BYTES = 256 * 2**20
"""On a GPU where cuDNN declined, automatic dispatch leaves materialised float32 scores below this size to `"xla"`.
On a CPU and a TPU `xla_chunked` is chosen at every size: 1.1–2.0x faster than `xla` forward + backward on a CPU
(docs/performance.md); 0.15 / 0.77 ms against `xla`'s 0.63 / 1.24 at b8 T=S=512 N16 H64 on a TPU v5e."""


def auto_min_score_bytes() -> int:
    """The score size from which automatic dispatch picks `xla_chunked` over `xla` on this process's backend."""
    return 0 if placement.placement_platform() in ("cpu", "tpu") else AUTO_MIN_SCORE_BYTES


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _accumulator_dtype(dtype):
    """Gradients of modifier inputs are summed in at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


class _Modifiers:
    """A call's modifiers for one key block at a time, with explicit closed-over constants.

    `args` are the rank-4 (padded) `score_mod_args`; `score_consts` / `mask_consts` the arrays the functions close
    over, in the order of their jaxprs' constants.
    """

    def __init__(self, config: AttentionConfig, problem: canonical.Problem, score_consts, mask_consts):
        self.config, self.problem = config, problem
        self.description = config.modifiers
        self.score_consts, self.mask_consts = tuple(score_consts), tuple(mask_consts)
        self.fns = scores.modifier_fns(self.description, self.score_consts, self.mask_consts)
        # float arguments and constants get gradients; the rest are closed over as they are
        self.float_args = tuple(i for i, a in enumerate(problem.score_mod_args) if _is_float(a))
        self.float_consts = tuple(i for i, c in enumerate(self.score_consts) if _is_float(c))
        # inside shard_map the jaxprs were traced on scalars varying over these axes (see `_for_varying_inputs`)
        self.axes = varying.union_axes(problem)

    def vary(self, x):
        return varying.vary_over(x, self.axes)

    def on_rows(self, problem: canonical.Problem) -> "_Modifiers":
        """The same modifiers on `problem` restricted to some query rows (`query_rows`)."""
        if problem is self.problem:
            return self
        rows = copy.copy(self)
        rows.problem = problem
        return rows

    def block_inputs(self, k_start, block):
        """Index arrays and grouped `score_mod_args` of keys `k_start : k_start + block`."""
        indices = scores.modifier_indices(self.config, self.problem, k_start, block)
        args = tuple(slice_keys(a, k_start, block) for a in self.problem.score_mod_args)
        return tuple(map(self.vary, indices)), scores.grouped_args(self.config, args)

    def apply(self, s, allowed, k_start, block):
        """Forward: `score_mod`-ified scores and visibility of one block."""
        indices, args = self.block_inputs(k_start, block)
        args = tuple(map(self.vary, args))
        return scores.modify(self.fns, self.vary(s), allowed, indices, args)

    def apply_with_vjp(self, s, allowed, k_start, block):
        """Backward: as `apply`, plus `vjp(ds_mod) -> (ds_raw, d_float_args (grouped blocks), d_float_consts)`."""
        indices, args = self.block_inputs(k_start, block)
        if self.fns.mask is not None:
            allowed = allowed & scores.apply_mask_mod(self.fns.mask, indices, tuple(map(self.vary, args)), like=s)
        if self.fns.score is None:
            return s, allowed, None

        def modified(s, float_args, float_consts):
            all_args = tuple(map(self.vary, _replace_at(args, self.float_args, float_args)))
            consts = _replace_at(self.score_consts, self.float_consts, float_consts)
            fn = scores.modifier_fns(self.description, consts, self.mask_consts).score
            return scores.apply_score_mod(fn, self.vary(s), indices, all_args)

        s, vjp = jax.vjp(
            modified,
            s,
            tuple(args[i] for i in self.float_args),
            tuple(self.score_consts[i] for i in self.float_consts),
        )
        return s, allowed & ~scores.is_neg_inf(s), vjp


def _replace_at(values: tuple, where: tuple[int, ...], new: tuple) -> tuple:
    out = list(values)
    for i, x in zip(where, new, strict=True):
        out[i] = x
    return tuple(out)


def _tile(tiles: Tiles, problem: canonical.Problem, mods: "_Modifiers | None", step):
    """`(q_start, k_start, the problem on the tile's query rows, its modifiers)` of tile `step`."""
    q_start, k_start = tiles.starts(step)
    rows = query_rows(problem, q_start, tiles.block_q)
    return q_start, k_start, rows, None if mods is None else mods.on_rows(rows)


def _block_scores(config: AttentionConfig, problem: canonical.Problem, q5, mods: _Modifiers | None, k_start, block):
    """Scores (after bias, the modifiers and the soft cap) and visibility of keys `k_start : k_start + block`."""
    k_blk = jax.lax.dynamic_slice_in_dim(problem.key, k_start, block, axis=1)
    s = scores.raw_scores(config, q5, k_blk, slice_keys(problem.bias, k_start, block), scale=problem.scale)
    allowed = scores.visible(config, problem, k_start, block, slice_keys(problem.mask, k_start, block))
    if mods is not None:
        s, allowed = mods.apply(s, allowed, k_start, block)
    return scores.soft_cap(config, s), allowed


def _max_visible(config: AttentionConfig, tiles: Tiles, problem: canonical.Problem, q5, mods: _Modifiers | None):
    """`[B, K, G, T]`: each query row's largest visible score over the tiles (`scores.hidden_score` where none is
    visible)."""
    B, K, G, T, _ = q5.shape
    acc_dtype = scores.accumulator(q5.dtype)
    hidden = scores.hidden_score(acc_dtype)
    bq = tiles.block_q

    def body(step, best):
        q_start, k_start, rows, rows_mods = _tile(tiles, problem, mods, step)
        s, allowed = _block_scores(config, rows, rows_of(q5, q_start, bq), rows_mods, k_start, tiles.block_k)
        row_best = jnp.maximum(rows_of(best, q_start, bq), jnp.max(jnp.where(allowed, s, hidden), axis=-1))
        return set_rows(best, row_best, q_start)

    empty = jnp.full((B, K, G, T), hidden, acc_dtype)
    return explicit_axes.fori_loop(tiles.num_steps, body, varying.like_inputs(empty, problem), problem)


def _forward(config: AttentionConfig, tiles: Tiles, problem: canonical.Problem, mods: _Modifiers | None):
    """Returns `out [B, T, N, Hv]` (query dtype) and `lse [B, K, G, T]` in the accumulator dtype (`hidden_score`
    where nothing is visible, as `scores.statistics`)."""
    B, T, N, _ = problem.query.shape
    acc_dtype = scores.accumulator(problem.query.dtype)
    hidden = scores.hidden_score(acc_dtype)
    K, G, Hv = config.num_kv_heads, config.group_size, problem.value.shape[-1]
    q5 = scores.grouped_query(config, problem.query)
    bq, block = tiles.block_q, tiles.block_k

    def body(step, carry):
        q_start, k_start, rows, rows_mods = _tile(tiles, problem, mods, step)
        row_max, denominator, acc = (rows_of(x, q_start, bq) for x in carry)
        v_blk = jax.lax.dynamic_slice_in_dim(problem.value, k_start, block, axis=1)
        s, allowed = _block_scores(config, rows, rows_of(q5, q_start, bq), rows_mods, k_start, block)
        masked = jnp.where(allowed, s, hidden)
        new_max = jnp.maximum(row_max, jnp.max(masked, axis=-1))
        shift = scores.row_shift(new_max)
        rescale = jnp.exp(row_max - shift)  # 0 while nothing was visible (row_max = hidden)
        p = jnp.exp(masked - shift[..., None])
        denominator = denominator * rescale + jnp.sum(p, axis=-1)
        if problem.dropout_seeds is not None:
            keep = scores.dropout_keep(config, problem.dropout_seeds, B, bq, k_start, block, q_start=q_start)
            p = jnp.where(keep, p, 0.0)
        pv = scores.rows_dot(
            p.astype(problem.value.dtype), v_blk, preferred_element_type=acc_dtype,
            precision=scores.precision(problem.value.dtype),
        )  # fmt: skip
        acc = acc * rescale[..., None] + pv
        return tuple(set_rows(x, new, q_start) for x, new in zip(carry, (new_max, denominator, acc), strict=True))

    init = (
        jnp.full((B, K, G, T), hidden, acc_dtype),
        jnp.zeros((B, K, G, T), acc_dtype),
        jnp.zeros((B, K, G, T, Hv), acc_dtype),
    )
    init = varying.like_inputs(init, problem)
    row_max, denominator, acc = explicit_axes.fori_loop(tiles.num_steps, body, init, problem)

    if problem.sinks is not None:
        sinks = scores.grouped_sinks(config, problem.sinks)
        final_max = jnp.maximum(row_max, sinks)
        rescale = jnp.exp(row_max - final_max)
        denominator = denominator * rescale + jnp.exp(sinks - final_max)
        acc = acc * rescale[..., None]
        row_max = final_max
    has_mass = denominator > 0
    safe_denominator = jnp.where(has_mass, denominator, 1.0)
    lse = jnp.where(has_mass, scores.row_shift(row_max) + jnp.log(safe_denominator), hidden)
    out = acc / safe_denominator[..., None]
    if problem.dropout_seeds is not None:
        out = out / (1.0 - config.dropout_rate)
    out = jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (B, T, N, Hv)).astype(problem.query.dtype)
    return out, lse


def _stores_probabilities(config: AttentionConfig, tiles: Tiles, problem: canonical.Problem) -> bool:
    """Whether the backward reuses the forward's probabilities instead of recomputing them: with one key block whose
    float32 probabilities stay under `AUTO_MIN_SCORE_BYTES` (the size `xla` may materialise), and none of the
    features whose backward needs the scores themselves (modifiers, soft cap, dropout, FP8)."""
    B, T, N, _ = problem.query.shape
    return (
        tiles.pairs is None
        and problem.key.shape[1] == tiles.block_k
        and 4 * B * N * T * tiles.block_k <= AUTO_MIN_SCORE_BYTES
        and config.modifiers is None
        and config.logits_soft_cap is None
        and problem.dropout_seeds is None
        and config.fp8 is None
    )


def _forward_fp8(config: AttentionConfig, tiles: Tiles, problem: canonical.Problem, mods: _Modifiers | None):
    """FP8 emulation (`fp8.py`): each probability is rounded against its row's final max, so a first pass over the
    tiles finds that max and a second accumulates. Returns `o [B, T, N, Hv]` float32 (the output before its
    rounding), `lse` and that max (the probabilities' shift), both `[B, K, G, T]` float32. No dropout."""
    B, T, N, _ = problem.query.shape
    K, G, Hv = config.num_kv_heads, config.group_size, problem.value.shape[-1]
    q5 = scores.grouped_query(config, problem.query)
    hidden = scores.hidden_score(jnp.float32)
    bq, block = tiles.block_q, tiles.block_k
    row_max = _max_visible(config, tiles, problem, q5, mods)
    if problem.sinks is not None:
        sinks = scores.grouped_sinks(config, problem.sinks)
        row_max = jnp.maximum(row_max, sinks)
    shift = scores.row_shift(row_max)

    def body(step, carry):
        q_start, k_start, rows, rows_mods = _tile(tiles, problem, mods, step)
        denominator, acc = (rows_of(x, q_start, bq) for x in carry)
        s, allowed = _block_scores(config, rows, rows_of(q5, q_start, bq), rows_mods, k_start, block)
        p = jnp.exp(jnp.where(allowed, s, hidden) - rows_of(shift, q_start, bq)[..., None])
        v_blk = jax.lax.dynamic_slice_in_dim(problem.value, k_start, block, axis=1)
        pv = scores.rows_dot(
            fp8_lib.Rounding.probabilities(p), v_blk, preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST,
        )  # fmt: skip
        new = (denominator + jnp.sum(p, axis=-1), acc + pv)
        return tuple(set_rows(x, y, q_start) for x, y in zip(carry, new, strict=True))

    init = (jnp.zeros((B, K, G, T), jnp.float32), jnp.zeros((B, K, G, T, Hv), jnp.float32))
    init = varying.like_inputs(init, problem)
    denominator, acc = explicit_axes.fori_loop(tiles.num_steps, body, init, problem)
    if problem.sinks is not None:
        denominator = denominator + jnp.exp(sinks - shift)
    has_mass = denominator > 0
    safe_denominator = jnp.where(has_mass, denominator, 1.0)
    lse = jnp.where(has_mass, shift + jnp.log(safe_denominator), hidden)
    out = acc / safe_denominator[..., None]
    return jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (B, T, N, Hv)), lse, shift


def _backward(
    config: AttentionConfig,
    tiles: Tiles,
    problem: canonical.Problem,
    mods: _Modifiers | None,
    out,
    lse,
    d_out,
    d_lse,
    fp8_shift=None,
):
    """Gradients `(dq, dk, dv, dbias, dsinks, d_args, d_score_consts, d_scale)` from the saved `lse [B, K, G, T]`,
    recomputing each tile (`d_scale`: of a runtime scale, else None).

    `d_lse` is the cotangent of `lse`, also `[B, K, G, T]`. `d_args` / `d_score_consts` hold the gradients of the
    float `score_mod_args` / closed-over arrays of `score_mod` (None for the others and without `score_mod`).
    `fp8_shift` (FP8 emulation): the forward's row max; `dV` then takes the rounded probabilities (straight-through
    rounding, as autodiff of `xla`'s emulation gives), and `out` is the output before its rounding.
    """
    B, T, N, H = problem.query.shape
    K, G = config.num_kv_heads, config.group_size
    q5 = scores.grouped_query(config, problem.query)
    to_kgt = lambda x: jnp.transpose(jnp.reshape(x, (B, T, K, G)), (0, 2, 3, 1))
    do5 = jnp.transpose(jnp.reshape(d_out, (B, T, K, G, config.value_head_dim)), (0, 2, 3, 1, 4))  # [B, K, G, T, Hv]
    # D = rowsum(dO * O): the softmax Jacobian's diagonal correction; d_lse enters every score with weight p.
    acc_dtype = scores.accumulator(problem.query.dtype)
    correction = to_kgt(jnp.sum(d_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1))
    correction = correction - d_lse.astype(acc_dtype)
    hidden = scores.hidden_score(acc_dtype)
    shift = scores.row_shift(lse)
    if fp8_shift is not None:
        # the row sum l of the forward's exp(s - max): P8 / l is what multiplied V
        row_sum = jnp.where(lse > hidden, jnp.exp(lse - fp8_shift), 1.0)
    keep_scale = 1.0 / (1.0 - config.dropout_rate)
    bias = problem.bias
    f32 = lambda x: x.astype(acc_dtype)  # float32, or float64 for float64 inputs
    bq, block = tiles.block_q, tiles.block_k
    # Without `pairs` each key block is one step, so its key-axis gradients are written; tiles add up.
    once = tiles.pairs is None

    args = problem.score_mod_args
    score_vjp = mods is not None and mods.fns.score is not None
    float_args = mods.float_args if score_vjp else ()
    float_consts = mods.float_consts if score_vjp else ()

    def rank4_starts(x, q_start, k_start):
        """Where a tile's part of a rank-4 `[B|1, N|1, T|1, S|1]` array starts."""
        return (0, 0, q_start if x.shape[2] != 1 else 0, k_start if x.shape[3] != 1 else 0)

    def body(step, carry):
        dq, dk, dv, dbias, d_args, d_consts = carry
        q_start, k_start, rows, rows_mods = _tile(tiles, problem, mods, step)
        q5_rows, do5_rows = rows_of(q5, q_start, bq), rows_of(do5, q_start, bq)
        k_blk = jax.lax.dynamic_slice_in_dim(problem.key, k_start, block, axis=1)
        v_blk = jax.lax.dynamic_slice_in_dim(problem.value, k_start, block, axis=1)
        s = scores.raw_scores(config, q5_rows, k_blk, slice_keys(rows.bias, k_start, block), scale=problem.scale)
        allowed = scores.visible(config, rows, k_start, block, slice_keys(rows.mask, k_start, block))
        mod_vjp = None
        if rows_mods is not None:
            s, allowed, mod_vjp = rows_mods.apply_with_vjp(s, allowed, k_start, block)
        s = scores.soft_cap(config, s)
        masked = jnp.where(allowed, s, hidden)
        p = jnp.exp(masked - rows_of(shift, q_start, bq)[..., None])
        dp = scores.score_dot(
            do5_rows, v_blk, preferred_element_type=acc_dtype, precision=scores.precision(v_blk.dtype)
        )
        p_kept = p
        if fp8_shift is not None:
            p_tilde = jnp.exp(masked - rows_of(fp8_shift, q_start, bq)[..., None])
            p_kept = fp8_lib.Rounding.probabilities(p_tilde) / rows_of(row_sum, q_start, bq)[..., None]
        if problem.dropout_seeds is not None:
            keep = scores.dropout_keep(config, problem.dropout_seeds, B, bq, k_start, block, q_start=q_start)
            p_kept = jnp.where(keep, p * keep_scale, 0.0)
            dp = jnp.where(keep, dp * keep_scale, 0.0)
        dv_blk = scores.keys_dot(p_kept, f32(do5_rows), precision=jax.lax.Precision.HIGHEST)
        ds = p * (dp - rows_of(correction, q_start, bq)[..., None])
        if config.logits_soft_cap is not None:
            ds = ds * (1.0 - jnp.square(s / jnp.asarray(config.logits_soft_cap, s.dtype)))
        if mod_vjp is not None:
            # through score_mod: the gradient of the raw score, and of its float arguments and constants
            ds, d_args_blk, d_consts_blk = mod_vjp(ds)
            new_args = []
            for acc, i, d in zip(d_args, float_args, d_args_blk, strict=True):
                b, n, t, s_arg = rows.score_mod_args[i].shape
                d = jnp.reshape(d, (b, n, t, min(s_arg, block))).astype(acc.dtype)
                starts = rank4_starts(acc, q_start, k_start)
                new_args.append(add_at(acc, d, starts, overwrite=once and s_arg != 1))
            d_args = tuple(new_args)
            d_consts = tuple(acc + d.astype(acc.dtype) for acc, d in zip(d_consts, d_consts_blk, strict=True))
        if bias is not None:
            ds_n = jnp.reshape(ds, (B, N, ds.shape[3], block))
            reduce_axes = tuple(a for a in range(3) if bias.shape[a] == 1)
            ds_n = jnp.sum(ds_n, axis=reduce_axes, keepdims=True)
            if bias.shape[3] == 1:
                ds_n = jnp.sum(ds_n, axis=3, keepdims=True)
            starts = rank4_starts(bias, q_start, k_start)
            dbias = add_at(dbias, ds_n, starts, overwrite=once and bias.shape[3] != 1)
        if config.scale is None:
            # a runtime scale: dq stays unscaled (d scale = <dq, q> below), scaled once after the loop
            dq_rows = scores.rows_dot(ds, f32(k_blk), precision=jax.lax.Precision.HIGHEST)
            ds = ds * scores.logit_scale(config, problem.scale, ds.dtype)
        else:
            ds = ds * jnp.asarray(config.scale, ds.dtype)
            dq_rows = scores.rows_dot(ds, f32(k_blk), precision=jax.lax.Precision.HIGHEST)
        dq = add_at(dq, dq_rows, (0, 0, 0, q_start, 0))
        dk_blk = scores.keys_dot(ds, f32(q5_rows), precision=jax.lax.Precision.HIGHEST)
        dk = add_at(dk, dk_blk, (0, k_start, 0, 0), overwrite=once)
        dv = add_at(dv, dv_blk, (0, k_start, 0, 0), overwrite=once)
        return dq, dk, dv, dbias, d_args, d_consts

    init = (  # dq, dk, dv, dbias, d_args (+ d_consts below)
        jnp.zeros(q5.shape, acc_dtype),
        jnp.zeros(problem.key.shape, acc_dtype),
        jnp.zeros(problem.value.shape, acc_dtype),
        None if bias is None else jnp.zeros(bias.shape, acc_dtype),
        tuple(jnp.zeros(args[i].shape, _accumulator_dtype(args[i].dtype)) for i in float_args),
    )
    init = varying.like_inputs(init, problem, out, lse, d_out, d_lse)
    # a closed-over array's gradient varies like the array (replicated ones are summed over the mesh by the vjp)
    init = init + (
        tuple(
            varying.like_inputs(jnp.zeros(jnp.shape(c), _accumulator_dtype(c.dtype)), c)
            for c in (mods.score_consts[i] for i in float_consts)
        ),
    )
    loop_inputs = (problem, out, lse, d_out, d_lse)
    dq, dk, dv, dbias, d_args, d_consts = explicit_axes.fori_loop(tiles.num_steps, body, init, loop_inputs)
    d_scale = None
    if config.scale is None:
        d_scale, dq = scale_gradient(config, problem.scale, dq, q5)

    d_sinks = None if problem.sinks is None else scores.sinks_gradient(config, problem.sinks, lse, correction)
    d_args_all = [None] * len(args)
    for i, d in zip(float_args, d_args, strict=True):
        d_args_all[i] = d.astype(args[i].dtype)
    d_consts_all = [None] * (0 if mods is None else len(mods.score_consts))
    for i, d in zip(float_consts, d_consts, strict=True):
        d_consts_all[i] = d.astype(mods.score_consts[i].dtype)
    return (
        jnp.reshape(jnp.transpose(dq, (0, 3, 1, 2, 4)), (B, T, N, H)).astype(problem.query.dtype),
        dk.astype(problem.key.dtype),
        dv.astype(problem.value.dtype),
        None if bias is None else dbias.astype(bias.dtype),
        d_sinks,
        tuple(d_args_all),
        tuple(d_consts_all),
        d_scale,
    )


def scale_gradient(config: AttentionConfig, scale: jax.Array, dq_unscaled: jax.Array, query: jax.Array):
    """`(d scale, dq)` of a runtime scale from `dq_unscaled = dS k` (the query gradient before the scale) and the query
    in the same layout: `s = scale * q k^T` gives `d scale = sum dS * (q k^T) = <dS k, q>` and `dq = scale * dS k`."""
    d_scale = jnp.sum(dq_unscaled * query.astype(dq_unscaled.dtype))
    dq = dq_unscaled * scores.logit_scale(config, scale, dq_unscaled.dtype)
    return d_scale.astype(scale.dtype), dq


def _problem_and_modifiers(config, scale, query, key, value, bias, sinks, mask, seeds, positions, args, score_consts,
                           mask_consts):  # fmt: skip
    problem = canonical.Problem(query, key, value, bias, mask, sinks, seeds, positions, args, scale)
    mods = None if config.modifiers is None else _Modifiers(config, problem, score_consts, mask_consts)
    return problem, mods


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(config, tiles, scale, query, key, value, bias, sinks, mask, seeds, positions, args, score_consts,
             mask_consts):  # fmt: skip
    (out, lse), _ = _chunked_fwd(
        config, tiles, scale, query, key, value, bias, sinks, mask, seeds, positions, args, score_consts, mask_consts
    )
    return out, lse


def _chunked_fwd(config, tiles, scale, query, key, value, bias, sinks, mask, seeds, positions, args, score_consts,
                 mask_consts):  # fmt: skip
    problem, mods = _problem_and_modifiers(
        config, scale, query, key, value, bias, sinks, mask, seeds, positions, args, score_consts, mask_consts
    )
    saved = None  # the probabilities and their row sums, where the backward reuses them
    fp8_shift = None
    if _stores_probabilities(config, tiles, problem):
        out, lse, *saved = one_block.forward(config, problem)
    elif config.fp8 is not None:
        out, lse, fp8_shift = _forward_fp8(config, tiles, problem, mods)
    else:
        out, lse = _forward(config, tiles, problem, mods)
    return (out, lse), (problem, score_consts, mask_consts, out, lse, fp8_shift, saved)


def _chunked_bwd(config, tiles, residuals, cotangents):
    problem, score_consts, mask_consts, out, lse, fp8_shift, saved = residuals
    d_out, d_lse = cotangents
    if saved is not None:
        dq, dk, dv, dbias, d_sinks, d_scale = one_block.backward(config, problem, out, lse, *saved, d_out, d_lse)
        no_args = (None,) * len(problem.score_mod_args)
        return d_scale, dq, dk, dv, dbias, d_sinks, None, None, None, no_args, (), ()
    mods = None if config.modifiers is None else _Modifiers(config, problem, score_consts, mask_consts)
    dq, dk, dv, dbias, d_sinks, d_args, d_score_consts, d_scale = _backward(
        config, tiles, problem, mods, out, lse, d_out, d_lse, fp8_shift
    )
    d_mask_consts = (None,) * len(mask_consts)
    return d_scale, dq, dk, dv, dbias, d_sinks, None, None, None, d_args, d_score_consts, d_mask_consts


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _for_varying_inputs(config: AttentionConfig, problem: canonical.Problem) -> AttentionConfig:
    """Inside `shard_map`: `config` with the modifiers' jaxprs traced again on scalars that vary over the problem's
    mesh axes, as the values they are evaluated on will (then the jaxprs carry the `pvary`s JAX inserts for
    replicated constants and literals). Outside `shard_map` (nothing varies) `config` is returned as it is.
    """
    axes = varying.union_axes(problem)
    if not axes:
        return config
    description = config.modifiers
    scalar = lambda dtype: varying.vary_over(jnp.zeros((), dtype), axes)
    indices = tuple(scalar(jnp.int32) for _ in range(4))
    args = tuple(scalar(d) for d in description.arg_dtypes)
    retraced = {}
    if description.score_mod is not None:
        retraced["score_jaxpr"] = jax.make_jaxpr(description.score_mod)(scalar(jnp.float32), *indices, *args)
    if description.mask_mod is not None:
        retraced["mask_jaxpr"] = jax.make_jaxpr(description.mask_mod)(*indices, *args)
    return dataclasses.replace(config, modifiers=dataclasses.replace(description, **retraced))


def _padded(problem: canonical.Problem, block_k: int, band: Band | None) -> tuple[canonical.Problem, Tiles]:
    """The problem with its keys (and, with tiles of query rows, its queries) padded to whole blocks, and the tiles."""
    T, S = problem.query.shape[1], problem.key.shape[1]
    block = max(1, min(block_k, S))
    tiles = plan_tiles(band, T, S, block)
    # At least one block: with S = 0 a single invisible padding key gives every row out 0 and nothing visible.
    padded = pad_keys(problem, tiles.num_k_blocks * block)
    return pad_queries(padded, tiles.num_q_blocks * tiles.block_q), tiles


def attend(config: AttentionConfig, problem: canonical.Problem, block_k: int = BLOCK_K, band: Band | None = None):
    """Canonical attention: `out [B, T, N, Hv]` in the query dtype and float32 `lse [B, T, N]` (its rows with
    nothing visible as `scores.returned_lse` says). `band`: no query sees a key outside it (`Band.on_indices`);
    the loops then skip the tiles it hides."""
    B, T, N, _ = problem.query.shape
    padded, tiles = _padded(problem, block_k, band)
    # Inside shard_map, differentiable inputs must vary like the rest so their cotangents (reduced by JAX where an
    # input was replicated) match the custom_vjp's types.
    query, key, value, bias, sinks = varying.like_inputs(
        (padded.query, padded.key, padded.value, padded.bias, padded.sinks), padded
    )
    args = tuple(varying.like_inputs(a, padded) if _is_float(a) else a for a in padded.score_mod_args)
    # The arrays score_mod / mask_mod close over enter the custom_vjp explicitly (it may not close over tracers).
    if config.modifiers is not None:
        config = _for_varying_inputs(config, padded)
    score_consts = () if config.modifiers is None else config.modifiers.score_consts
    mask_consts = () if config.modifiers is None else config.modifiers.mask_consts
    scale = None if padded.scale is None else varying.like_inputs(padded.scale, padded)
    out, lse = _chunked(
        config, tiles, scale, query, key, value, bias, sinks, padded.mask, padded.dropout_seeds, padded.positions, args,
        score_consts, mask_consts,
    )  # fmt: skip
    # [B, K, G, T] -> [B, T, N] (padded query rows dropped)
    lse = jnp.reshape(jnp.transpose(lse[..., :T], (0, 3, 1, 2)), (B, T, N))
    return out[:, :T], scores.returned_lse(config, lse)


def row_max(
    config: AttentionConfig, problem: canonical.Problem, block_k: int = BLOCK_K, band: Band | None = None
) -> jax.Array:
    """`[B, K, G, T]`: each query row's largest visible logit (after bias, `score_mod` and soft cap;
    `scores.hidden_score` where nothing is visible), one tile at a time (skipping those outside `band`, as
    `attend`). Not differentiable (a statistic)."""
    problem = jax.lax.stop_gradient(problem)
    T = problem.query.shape[1]
    padded, tiles = _padded(problem, block_k, band)
    description = config.modifiers
    mods = None
    if description is not None:
        mods = _Modifiers(config, padded, description.score_consts, description.mask_consts)
    return _max_visible(config, tiles, padded, scores.grouped_query(config, padded.query), mods)[..., :T]


@dataclasses.dataclass(frozen=True)
class XlaChunked(Implementation):
    """`implementation="xla_chunked"` with its options. Pass an instance wherever `implementation` takes a name
    (alone or in a sequence); the name stands for `XlaChunked()`.

    Attributes:
        block_k: keys per block of the online softmax. Each block materialises `[B, N, T, block_k]` float32 scores
            (under a causal or window bound, tiles of about `block_k` query rows: `[B, N, ~block_k, block_k]`);
            smaller blocks take less memory and more loop steps. Keys that fit in one block run the one-block path
            (probabilities kept for the backward).
    """

    block_k: int = BLOCK_K
    name: ClassVar[str] = "xla_chunked"

    def __post_init__(self):
        if isinstance(self.block_k, bool) or not isinstance(self.block_k, int) or self.block_k < 1:
            raise ValueError(f"`block_k` must be a positive int. Got block_k={self.block_k!r}.")

    def decline_reason(self, config: AttentionConfig, context: Context) -> str | None:
        if config.modifiers is not None and config.modifiers.score_mod is not None and config.dtype == jnp.float64:
            return (
                "a `score_mod` with float64 inputs is not supported (it runs traced at float32); `xla` "
                "serves it"
            )
        if not context.automatic:
            return None
        score_bytes = 4 * config.batch_size * config.num_q_heads * config.q_len * config.kv_len
        threshold = auto_min_score_bytes()
        if score_bytes < threshold:
            return (
                f"the materialised scores take only {score_bytes / 2**20:.1f} MiB "
                f"(< {threshold // 2**20} MiB), below which automatic dispatch uses `xla` on this "
                f"{placement.placement_platform().upper()}; name it to force it"
            )
        return None

    def attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        # Serves every call it accepts by itself: nothing in `context` changes how.
        band = Band.on_indices(config, inputs)
        if config.fp8 is not None:
            return fp8_lib.emulate(config, inputs, lambda problem: attend(config, problem, self.block_k, band))
        problem = canonical.canonicalize(config, inputs)
        return canonical.restore(config, *attend(config, problem, self.block_k, band), problem)

