"""The flex backward kernels: dK/dV over the query blocks of each key block, dQ (with the gradients of `bias` and
of float `score_mod_args`) over the key blocks of each query block.

Both recompute each tile's probabilities from the forward's saved log-sum-exp (`p = exp(s - lse)`, 0 on hidden
entries and on rows that see nothing) and take the row term `D = rowsum(dO · O) - dlse` (as splash's: the `lse`
cotangent enters through it), so `dS = P (dP - D)`, with dropout's kept mask applied to `dP` and to the `P` that
multiplies `dO` for dV (its `1 / (1 - rate)` once per output element: `_tile_gradient`). `dS` then goes back
through the soft cap and `score_mod` (`body.Tile.backward`).

- dK/dV: grid `(B, K, nk, width_q)`, the query blocks innermost; float32 VMEM accumulators, written once per key
  block. dK carries the logit scale.
- dQ: grid `(B, K, nq, width_k)`, the key blocks innermost; `dS·K` without the scale (the caller scales it and
  derives the gradient of a runtime scale from it). The gradients of `bias` and float `score_mod_args` are written
  per tile (`operands.gradient_shape`, zero-initialised through input/output aliasing, so skipped tiles read 0,
  unless the block map visits every tile):
  in place, in the array's dtype, for an array with no broadcast dim; otherwise into float32 per-tile partials that
  the caller sums over the broadcast dims. No block is written by two grid steps.

Every output block is written by exactly one sequence of grid steps, with no atomics: the backward is deterministic.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import body, partitioned
from .operands import gradient_dtype, gradient_shape, gradient_spec, Operands, specs
from .plan import Plan, vmem_limit


def _tile_gradient(plan: Plan, r: dict, kj, full: bool):
    """`(tile, p_kept, ds)` of one tile: probabilities from the saved `lse` (those dropout keeps, unscaled) and the
    score gradient `P (dP - D)` before the soft cap and `score_mod`, with dropout's `1 / (1 - rate)` left out
    (`dropout_scale`): `P (keep · dO·vᵀ / (1 - rate) - D) = P (keep · dO·vᵀ - (1 - rate) D) / (1 - rate)`, so the
    scale costs one multiply per row here and one per output element, not two per element of each tile."""
    t = body.tile(plan, r, full=full, backward=True)
    p = jnp.exp(body.masked(t) - body.row_shift(r["lse"][...]))
    dp = body.dot_t(r["do"][...], r["v"][...], plan.precision)
    di = r["di"][...]
    p_kept = p
    if plan.dropout_rate > 0:
        keep = body.dropout_keep(plan, r, kj)
        p_kept = jnp.where(keep, p, 0.0)
        dp = jnp.where(keep, dp, 0.0)
        di = di * (1.0 - plan.dropout_rate)
    return t, p_kept, p * (dp - di)


def dropout_scale(plan: Plan) -> float:
    """`1 / (1 - rate)`: the factor `_tile_gradient` leaves out of `p_kept` and `ds` (1 without dropout)."""
    return 1.0 / (1.0 - plan.dropout_rate)


def _dkv_kernel(plan: Plan, names: list[str], q_list, q_count, q_full, *refs):
    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    dk_ref, dv_ref, dk_scr, dv_scr = refs[n_in:]
    b, kh, kj, i = (pl.program_id(a) for a in range(4))
    row = (b if plan.map_per_batch else 0) * plan.nk + kj

    @pl.when(i == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def step(full: bool):
        t, p_kept, ds = _tile_gradient(plan, r, kj, full)
        do, q = r["do"][...], r["q"][...]
        dv_scr[...] += body.dot_tn(p_kept.astype(do.dtype), do, plan.precision)
        ds, _ = t.backward(ds)
        dk_scr[...] += body.dot_tn(ds.astype(q.dtype), q, plan.precision)

    body.each_tile_kind(plan, i < q_count[row], q_full[row * plan.width_q + i], step)

    @pl.when(i == plan.width_q - 1)
    def _finish():
        dk_ref[...] = dk_scr[...] * (r["scale"][0] * dropout_scale(plan))
        dv_ref[...] = dv_scr[...] * dropout_scale(plan) if plan.dropout_rate > 0 else dv_scr[...]


def _reduce_to(plan: Plan, x: jax.Array, spec) -> jax.Array:
    """A tile's `[rows, bk]` gradient summed over the broadcast dims of `spec`: the block of `gradient_shape`."""
    x = jnp.reshape(x, (plan.G, plan.block_q, plan.block_k))
    if spec.in_place:
        return x
    if not spec.has_heads:
        x = jnp.sum(x, axis=0, keepdims=True)
    if not spec.has_q:
        x = jnp.sum(x, axis=1, keepdims=True)
    if not spec.has_k:
        x = jnp.sum(x, axis=2, keepdims=True)
    return jnp.reshape(x, (x.shape[0] * x.shape[1], x.shape[2]))


def _gradient_specs(plan: Plan) -> list:
    """The `ArraySpec`s of the arrays whose gradient the dQ kernel writes: the bias, then the float `score_mod_args`."""
    return ([plan.bias] if plan.bias is not None else []) + [plan.args[i] for i in plan.arg_grads]


def _dq_kernel(plan: Plan, names: list[str], n_aliased: int, kv_list, kv_count, kv_full, *refs):
    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    grad_specs = _gradient_specs(plan)
    n_grads = len(grad_specs)
    outs = refs[n_in + n_aliased :]  # after the inputs and the zeros the gradients alias (not read)
    dq_ref, grad_refs, (dq_scr,) = outs[0], outs[1 : 1 + n_grads], outs[1 + n_grads :]
    b, kh, qi, j = (pl.program_id(a) for a in range(4))
    row = (b if plan.map_per_batch else 0) * plan.nq + qi

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when((j == 0) & (kv_count[row] == 0))
    def _nothing_visible():
        for ref in grad_refs:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    def step(full: bool):
        kj = kv_list[row * plan.width_k + j]
        t, _, ds = _tile_gradient(plan, r, kj, full)
        if grad_specs and plan.dropout_rate > 0:  # the written gradients need the scale per element
            ds = ds * dropout_scale(plan)
        ds, d_args = t.backward(ds)
        k = r["k"][...]
        dq_scr[...] += body.dot(ds.astype(k.dtype), k, plan.precision)
        grads = ([ds] if plan.bias is not None else []) + d_args
        for ref, g, spec in zip(grad_refs, grads, grad_specs, strict=True):
            ref[...] = _reduce_to(plan, g, spec).astype(ref.dtype)

    body.each_tile_kind(plan, j < kv_count[row], kv_full[row * plan.width_k + j], step)

    @pl.when(j == plan.width_k - 1)
    def _finish():
        if grad_specs or plan.dropout_rate == 0:
            dq_ref[...] = dq_scr[...]
        else:
            dq_ref[...] = dq_scr[...] * dropout_scale(plan)


def _settings(plan: Plan, semantics: tuple[str, ...]) -> dict:
    return dict(
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=vmem_limit(plan, backward=True)
        ),
        interpret=plan.interpret,
    )


def _named(ops: Operands, do, lse, di) -> dict:
    """The backward kernels' operands (the sinks enter through `lse`)."""
    return dict({n: x for n, x in ops._asdict().items() if n != "sinks"}, do=do, lse=lse, di=di)


def dkv(plan: Plan, ops: Operands, do, lse, di, q_list, q_count, q_full) -> tuple[jax.Array, jax.Array]:
    """`(dk [B, K, S', H'], dv [B, K, S', Hv'])` in float32."""
    named = dict(_named(ops, do, lse, di), q_list=q_list, q_count=q_count, q_full=q_full)
    dk, dv = partitioned.call(plan, "dkv", named, ("k", "v"), _dkv_call)
    return dk, dv


def _dkv_call(plan: Plan, named: dict) -> tuple[jax.Array, jax.Array]:
    lists = [named.pop(n).reshape(-1) for n in ("q_list", "q_count", "q_full")]

    def coords(b, kh, kj, i, q_list, q_count, q_full):
        row = (b if plan.map_per_batch else 0) * plan.nk + kj
        return b, kh, q_list[row * plan.width_q + i], kj

    arrays, in_specs, names = specs(plan, named, coords)
    key_spec = lambda d: pl.BlockSpec((None, None, plan.block_k, d), lambda b, kh, kj, i, *_: (b, kh, kj, 0))
    H, Hv = plan.head_dim, plan.value_head_dim
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, plan, names),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(plan.B, plan.K, plan.nk, plan.width_q),
            in_specs=in_specs,
            out_specs=[key_spec(H), key_spec(Hv)],
            scratch_shapes=[pltpu.VMEM((plan.block_k, H), jnp.float32), pltpu.VMEM((plan.block_k, Hv), jnp.float32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((plan.B, plan.K, plan.Sp, H), jnp.float32),
            jax.ShapeDtypeStruct((plan.B, plan.K, plan.Sp, Hv), jnp.float32),
        ],
        name="attnlib_flex_dkv",
        **_settings(plan, ("parallel", "parallel", "parallel", "arbitrary")),
    )(*lists, *arrays)
    return dk, dv


def dq(plan: Plan, ops: Operands, do, lse, di, kv_list, kv_count, kv_full) -> tuple[jax.Array, list[jax.Array]]:
    """`(dq [B, K, nq * rows, H'] float32 without the scale, [the gradients of bias and of each differentiated
    score_mod_arg as written, `operands.gradient_shape`])`."""
    named = dict(_named(ops, do, lse, di), kv_list=kv_list, kv_count=kv_count, kv_full=kv_full)
    kinds = tuple("in_place" if s.in_place else "partial" for s in _gradient_specs(plan))
    outs = partitioned.call(plan, "dq", named, ("dq",) + kinds, _dq_call)
    return outs[0], list(outs[1:])


def _dq_call(plan: Plan, named: dict) -> tuple[jax.Array, ...]:
    lists = [named.pop(n).reshape(-1) for n in ("kv_list", "kv_count", "kv_full")]

    def coords(b, kh, qi, j, kv_list, kv_count, kv_full):
        row = (b if plan.map_per_batch else 0) * plan.nq + qi
        return b, kh, qi, kv_list[row * plan.width_k + j]

    arrays, in_specs, names = specs(plan, named, coords)
    grad_specs = _gradient_specs(plan)
    # Skipped tiles must read 0: their blocks start as aliased zeros, unless the map visits every tile.
    zeros = [] if plan.every_tile else [jnp.zeros(gradient_shape(plan, s), gradient_dtype(s)) for s in grad_specs]
    H = plan.head_dim
    row_spec = pl.BlockSpec((None, None, plan.rows, H), lambda b, kh, qi, j, *_: (b, kh, qi, 0))
    n_before = len(lists) + len(arrays)  # the scalar-prefetch lists and the inputs come before the zeros
    outs = pl.pallas_call(
        functools.partial(_dq_kernel, plan, names, len(zeros)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(plan.B, plan.K, plan.nq, plan.width_k),
            in_specs=in_specs + [pl.BlockSpec(memory_space=pl.ANY) for _ in zeros],
            out_specs=[row_spec] + [gradient_spec(plan, s, coords) for s in grad_specs],
            scratch_shapes=[pltpu.VMEM((plan.rows, H), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((plan.B, plan.K, plan.nq * plan.rows, H), jnp.float32)]
        + [jax.ShapeDtypeStruct(gradient_shape(plan, s), gradient_dtype(s)) for s in grad_specs],
        input_output_aliases={n_before + i: 1 + i for i in range(len(zeros))},
        name="attnlib_flex_dq",
        **_settings(plan, ("parallel", "parallel", "parallel", "arbitrary")),
    )(*lists, *arrays, *zeros)
    return tuple(outs)
