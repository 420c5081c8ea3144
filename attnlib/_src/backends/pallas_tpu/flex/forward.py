"""The flex forward kernel: online softmax over the key blocks a query block visits.

Grid `(B, K, nq, width_k)`: batch row, key/value head, query block (each `rows = G · block_q` query rows), and the
step along the query block's list of key blocks (`block_map.py`), innermost and sequential ("arbitrary"); a step
the map flags wholly visible runs without masks (`body.each_tile_kind`). The running max, denominator and output
accumulator live in float32 VMEM scratch; the last step divides, adds the sinks (one more logit per row, in the
denominator only) and writes the output and the log-sum-exp (`hidden_score` for a row that sees nothing, whose
output is 0, as `xla_chunked`'s).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import body, partitioned
from .operands import Operands, specs
from .plan import hidden, Plan, vmem_limit


def _kernel(plan: Plan, names: list[str], kv_list, kv_count, kv_full, *refs):
    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    o_ref, lse_ref, m_scr, l_scr, acc_scr = refs[n_in:]
    b, kh, qi, j = (pl.program_id(a) for a in range(4))
    row = (b if plan.map_per_batch else 0) * plan.nq + qi

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, hidden(), jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def step(full: bool):
        kj = kv_list[row * plan.width_k + j]
        t = body.tile(plan, r, full=full)
        s = body.masked(t)
        m_prev = m_scr[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        shift = body.row_shift(m_new)
        rescale = jnp.exp(m_prev - shift)
        p = jnp.exp(s - shift)
        l_scr[...] = l_scr[...] * rescale + jnp.sum(p, axis=-1, keepdims=True)
        if plan.dropout_rate > 0:
            p = jnp.where(body.dropout_keep(plan, r, kj), p, 0.0)
        v = r["v"][...]
        acc_scr[...] = acc_scr[...] * rescale + body.dot(p.astype(v.dtype), v, plan.precision)
        m_scr[...] = m_new

    body.each_tile_kind(plan, j < kv_count[row], kv_full[row * plan.width_k + j], step)

    @pl.when(j == plan.width_k - 1)
    def _finish():
        m, l, acc = m_scr[...], l_scr[...], acc_scr[...]
        if plan.sinks:
            sink = r["sinks"][...]
            final = jnp.maximum(m, sink)
            rescale = jnp.exp(m - final)
            l = l * rescale + jnp.exp(sink - final)
            acc = acc * rescale
            m = final
        has_mass = l > 0
        safe = jnp.where(has_mass, l, 1.0)
        lse = jnp.where(has_mass, body.row_shift(m) + jnp.log(safe), hidden())
        out = acc / safe
        if plan.dropout_rate > 0:
            out = out / (1.0 - plan.dropout_rate)
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


def forward(plan: Plan, ops: Operands, kv_list, kv_count, kv_full) -> tuple[jax.Array, jax.Array]:
    """`(out [B, K, nq * rows, Hv'], lse [B, K, nq * rows, 1] float32)`; lists `[Bm, ...]` (`block_map.BlockMap`)."""
    named = dict(ops._asdict(), kv_list=kv_list, kv_count=kv_count, kv_full=kv_full)
    return partitioned.call(plan, "forward", named, ("out", "lse"), _forward_call)


def _forward_call(plan: Plan, named: dict) -> tuple[jax.Array, jax.Array]:
    """The forward `pallas_call` on one shard."""
    lists = [named.pop(n).reshape(-1) for n in ("kv_list", "kv_count", "kv_full")]

    def coords(b, kh, qi, j, kv_list, kv_count, kv_full):
        row = (b if plan.map_per_batch else 0) * plan.nq + qi
        return b, kh, qi, kv_list[row * plan.width_k + j]

    arrays, in_specs, names = specs(plan, named, coords)
    B, K, R = plan.B, plan.K, plan.nq * plan.rows
    row_spec = lambda d: pl.BlockSpec((None, None, plan.rows, d), lambda b, kh, qi, j, *_: (b, kh, qi, 0))
    out, lse = pl.pallas_call(
        functools.partial(_kernel, plan, names),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, K, plan.nq, plan.width_k),
            in_specs=in_specs,
            out_specs=[row_spec(plan.value_head_dim), row_spec(1)],
            scratch_shapes=[
                pltpu.VMEM((plan.rows, 1), jnp.float32),
                pltpu.VMEM((plan.rows, 1), jnp.float32),
                pltpu.VMEM((plan.rows, plan.value_head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, K, R, plan.value_head_dim), plan.dtype),
            jax.ShapeDtypeStruct((B, K, R, 1), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(plan, backward=False)),
        interpret=plan.interpret,
        name="attnlib_flex_forward",
    )(*lists, *arrays)
    return out, lse
