"""attnlib's flex kernel on a canonical problem: the operands, the block map and the `custom_vjp`.

The forward and the two backward kernels (`forward.py`, `backward.py`) run under `kernel_settings.as_written()`
(the caller's x64, precision and promotion settings do not reach the kernels' tracing; the precision of their
matrix products is the plan's). Around the kernels: the row term `D = rowsum(dO·O) - dlse`, the gradients of the
sinks (`dsink[n] = -Σ p_sink D`, the sink being a logit with no value), of a runtime scale (`<dQ_unscaled, q>`),
of `bias` and float `score_mod_args` (written in place, or per-tile partials summed to their shapes).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .... import argument_checks, canonical
from ....band import Band
from ....config import AttentionConfig, AttentionInputs
from ... import kernel_settings, scores
from .. import blocks
from . import block_map, operands
from .backward import dkv, dq
from .forward import forward
from .plan import array_spec, LANES, Plan, precision_of, TILE_KEYS, TILE_ROWS


def _blocks(config: AttentionConfig, block_sizes: tuple[int, int] | None) -> tuple[int, int]:
    """`(block_q, block_k)`: the caller's, else about `TILE_ROWS` rows per tile (`G · block_q`) and `TILE_KEYS` keys,
    in multiples of 128, no larger than the padded lengths."""
    if block_sizes is not None:
        return block_sizes
    block_q = max(LANES, TILE_ROWS // config.group_size // LANES * LANES)
    lanes = lambda n: blocks.round_up(max(n, 1), LANES)
    return min(block_q, lanes(config.q_len)), min(TILE_KEYS, lanes(config.kv_len))


def runtime_structure(config: AttentionConfig) -> bool:
    """The visibility reads runtime data (lengths, segment ids, THD, a mask array): the block map is reduced on the
    device."""
    return (
        config.has_q_lengths or config.has_kv_lengths or config.has_segments or config.layout == "thd"
        or config.has_mask
    )  # fmt: skip


def plan_of(config: AttentionConfig, problem: canonical.Problem, interpret: bool, block_sizes=None) -> Plan:
    """The static plan of a canonical problem (its block map's widths are filled in by `attend`)."""
    B, T, N, H = problem.query.shape
    S = problem.key.shape[1]
    K = config.num_kv_heads
    bq, bk = _blocks(config, block_sizes)
    sizes = (B, K, N // K, blocks.round_up(max(T, 1), bq), blocks.round_up(max(S, 1), bk))
    band = Band.from_mask(is_causal=config.is_causal, window=config.window)
    mods = config.modifiers
    arg_grads = ()
    if mods is not None and mods.score_jaxpr is not None:
        arg_grads = tuple(i for i, d in enumerate(mods.arg_dtypes) if argument_checks.is_float(d))
    return Plan(
        B=B, K=K, G=N // K, T=T, S=S, block_q=bq, block_k=bk,
        head_dim=blocks.round_up(H, LANES), value_head_dim=blocks.round_up(problem.value.shape[-1], LANES),
        dtype=np.dtype(problem.query.dtype),
        band=(band.left, band.right) if band.bounded else None, soft_cap=config.logits_soft_cap,
        bias=None if problem.bias is None else array_spec(problem.bias.shape, problem.bias.dtype, sizes),
        mask=None if problem.mask is None else array_spec(problem.mask.shape, np.bool_, sizes),
        args=tuple(array_spec(a.shape, a.dtype, sizes) for a in problem.score_mod_args),
        arg_grads=arg_grads, modifiers=mods, thd=config.layout == "thd", dropout_rate=float(config.dropout_rate),
        sinks=problem.sinks is not None, precision=precision_of(config), interpret=interpret,
    )  # fmt: skip


def _block_map(config: AttentionConfig, plan: Plan, fixed, args=()) -> block_map.BlockMap:
    """The block map: on the host where visibility depends on the indices alone, else on the device (`args`: the
    grouped `score_mod_args`, which a `mask_mod` reads there)."""
    mask_mod_args = plan.mask_mod is not None and bool(plan.args)
    if runtime_structure(config) or mask_mod_args:
        tiles = block_map.runtime_tiles(plan, fixed["q_seg_t"], fixed["q_pos_t"], fixed["kv_seg_t"],
                                        fixed["kv_pos_t"], fixed["mask"])  # fmt: skip
        if plan.mask_mod is not None:
            tiles = tiles & block_map.mask_mod_tiles(plan, fixed["q_seg_t"], fixed["q_pos_t"], fixed["kv_pos_t"], args)
        return block_map.from_tiles(tiles, per_batch=True, static=False)
    offset = plan.S - plan.T if config.diagonal_alignment == "bottom_right" else 0
    mask_mod = None
    if plan.mask_mod is not None and not plan.modifiers.has_traced_consts:
        mask_mod = block_map.static_mask_mod(plan.modifiers, plan.B, plan.K * plan.G, plan.T, plan.S, offset,
                                             plan.block_q, plan.block_k)  # fmt: skip
    return block_map.from_tiles(block_map.static_tiles(plan, offset, mask_mod), per_batch=False, static=True)


def _operands(plan: Plan, scale, q, k, v, bias, sinks, args, fixed) -> operands.Operands:
    H, Hv = plan.head_dim, plan.value_head_dim
    kv = lambda x, d: blocks.heads_major(x, plan.Sp, d)
    return operands.Operands(
        scale=jnp.reshape(scale.astype(jnp.float32), (1,)),
        seeds=fixed["seeds"],
        q=operands.to_rows(plan, q, H), k=kv(k, H), v=kv(v, Hv),
        q_seg=fixed["q_seg"], q_pos=fixed["q_pos"], kv_seg=fixed["kv_seg"], kv_pos=fixed["kv_pos"],
        head=jnp.asarray(operands.head_rows(plan)), batch=jnp.asarray(operands.batch_rows(plan)),
        q_token=None if plan.dropout_rate == 0 else jnp.asarray(operands.q_token_rows(plan)),
        sinks=None if sinks is None else operands.sinks_rows(plan, sinks),
        bias=None if bias is None else operands.grouped(plan, bias, plan.bias),
        mask=fixed["mask"],
        args=tuple(operands.grouped(plan, a, s) for a, s in zip(args, plan.args, strict=True)),
    )  # fmt: skip


def _forward(plan, scale, q, k, v, bias, sinks, args, fixed, bmap):
    with kernel_settings.as_written():
        ops = _operands(plan, scale, q, k, v, bias, sinks, args, fixed)
        out, lse = forward(plan, ops, bmap["kv_list"], bmap["kv_count"], bmap["kv_full"])
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(plan, scale, q, k, v, bias, sinks, args, fixed, bmap):
    out, lse = _forward(plan, scale, q, k, v, bias, sinks, args, fixed, bmap)
    return operands.from_rows(plan, out, v.shape[-1]), operands.from_rows(plan, lse, 1)[..., 0]


def _flex_fwd(plan, scale, q, k, v, bias, sinks, args, fixed, bmap):
    out, lse = _forward(plan, scale, q, k, v, bias, sinks, args, fixed, bmap)
    results = operands.from_rows(plan, out, v.shape[-1]), operands.from_rows(plan, lse, 1)[..., 0]
    return results, (scale, q, k, v, bias, sinks, args, fixed, bmap, out, lse)


def _flex_bwd(plan, residuals, cotangents):
    scale, q, k, v, bias, sinks, args, fixed, bmap, out, lse = residuals
    d_out, d_lse = cotangents
    with kernel_settings.as_written():
        ops = _operands(plan, scale, q, k, v, bias, sinks, args, fixed)
        do = operands.to_rows(plan, d_out.astype(q.dtype), plan.value_head_dim)
        d_lse_rows = operands.to_rows(plan, d_lse.astype(jnp.float32)[..., None], 1)
        di = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True) - d_lse_rows
        dk, dv = dkv(plan, ops, do, lse, di, bmap["q_list"], bmap["q_count"], bmap["q_full"])
        dq_rows, written = dq(plan, ops, do, lse, di, bmap["kv_list"], bmap["kv_count"], bmap["kv_full"])
    dq_unscaled = operands.from_rows(plan, dq_rows, q.shape[-1])
    d_scale = jnp.sum(dq_unscaled * q.astype(jnp.float32)).astype(scale.dtype)
    d_q = (dq_unscaled * scale.astype(jnp.float32)).astype(q.dtype)
    crop = lambda x, n, d: jnp.transpose(x[:, :, :n, :d], (0, 2, 1, 3))
    d_k = crop(dk, k.shape[1], k.shape[3]).astype(k.dtype)
    d_v = crop(dv, v.shape[1], v.shape[3]).astype(v.dtype)
    d_bias = None
    if bias is not None:
        d_bias = operands.grouped_gradient(plan, written.pop(0), plan.bias, bias.shape).astype(bias.dtype)
    d_args = [None] * len(args)
    for i, grad in zip(plan.arg_grads, written, strict=True):
        d_args[i] = operands.grouped_gradient(plan, grad, plan.args[i], args[i].shape).astype(args[i].dtype)
    d_sinks = None
    if sinks is not None:
        lse_t = operands.from_rows(plan, lse, 1)[..., 0]  # [B, T, N]
        di_t = operands.from_rows(plan, di, 1)[..., 0]
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, None, :] - lse_t)
        d_sinks = jnp.sum(-p_sink * di_t, axis=(0, 1)).astype(sinks.dtype)
    zeros = jax.tree.map(lambda x: None, (fixed, bmap))
    return (d_scale, d_q, d_k, d_v, d_bias, d_sinks, tuple(d_args)) + zeros


_flex.defvjp(_flex_fwd, _flex_bwd)


def _fixed(plan: Plan, problem: canonical.Problem) -> dict:
    """The non-differentiable operands: per-token segment ids and positions (padded: id 0 past the lengths), the
    mask, the dropout seeds."""
    p = problem.positions.with_segments()
    pad = lambda x, n: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n - x.shape[1])))
    q_seg, q_pos = pad(p.q_segment, plan.Tp), pad(p.q_position, plan.Tp)
    kv_seg, kv_pos = pad(p.kv_segment, plan.Sp), pad(p.kv_position, plan.Sp)
    return dict(
        q_seg_t=q_seg, q_pos_t=q_pos, kv_seg_t=kv_seg, kv_pos_t=kv_pos,
        q_seg=operands.token_rows(plan, q_seg), kv_seg=kv_seg[:, None, :],
        q_pos=operands.token_rows(plan, q_pos) if plan.needs_positions else None,
        kv_pos=kv_pos[:, None, :] if plan.needs_positions else None,
        mask=None if problem.mask is None else operands.grouped(plan, problem.mask, plan.mask),
        seeds=problem.dropout_seeds,
    )  # fmt: skip


def attend(config: AttentionConfig, problem: canonical.Problem, plan: Plan):
    """`(out [B, T, N, Hv], lse [B, T, N])` of a canonical problem."""
    with kernel_settings.as_written():  # plain index arithmetic: the caller's promotion rules do not apply
        fixed = _fixed(plan, problem)
        args = tuple(operands.grouped(plan, kernel_settings.narrowed(a), spec)
                     for a, spec in zip(problem.score_mod_args, plan.args, strict=True))  # fmt: skip
        bm = _block_map(config, plan, fixed, args)
    plan = dataclasses.replace(
        plan, map_per_batch=bm.per_batch, width_q=bm.width_q, width_k=bm.width_k, any_full=bm.any_full,
        any_partial=bm.any_partial, every_tile=bm.every_tile,
    )  # fmt: skip
    bmap = {n: jnp.asarray(getattr(bm, n)) for n in ("kv_list", "kv_count", "kv_full", "q_list", "q_count", "q_full")}
    fixed = {n: x for n, x in fixed.items() if not n.endswith("_t")}
    scale = scores.logit_scale(config, problem.scale, jnp.float32)
    narrow = lambda x: None if x is None else kernel_settings.narrowed(x)
    return _flex(
        plan, scale, problem.query, problem.key, problem.value, narrow(problem.bias), problem.sinks,
        tuple(kernel_settings.narrowed(a) for a in problem.score_mod_args), fixed, bmap,
    )  # fmt: skip


def attention(config: AttentionConfig, inputs: AttentionInputs, *, interpret: bool, block_sizes=None):
    """`(out, lse)` in the caller's layout (`Implementation.attention`)."""
    problem = canonical.canonicalize(config, inputs)
    plan = plan_of(config, problem, interpret, block_sizes)
    out, lse = attend(config, problem, plan)
    return canonical.restore(config, out, scores.returned_lse(config, lse))
