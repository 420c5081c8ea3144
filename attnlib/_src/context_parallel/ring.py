"""Context parallelism: running a plan — the per-task attention calls, merging partial results through `lse`, and
the ring strategy (`ppermute` steps, with a `custom_vjp` backward that rings again)."""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import attention as _attention
from ..varying import match, vary_over, varying_axes
from .planner import _Plan, _Rule, _StepPlan, _Task


# ----------------------------------------------------------------------------------------------------------------
# Runtime


@dataclasses.dataclass(frozen=True)
class _Options:
    """Static options of one call (hashable: a `custom_vjp` non-differentiable argument)."""

    axis_name: Any
    num_shards: int
    rule: _Rule
    forwarded: tuple[tuple[str, Any], ...]
    plan: _Plan


def _merge(o, lse, o_i, lse_i):
    """Exact merge of two partial softmax results; rows empty in both stay `(0, -inf)`; NaN-free gradients."""
    m = jnp.maximum(lse, lse_i)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a = jnp.exp(lse - m_safe)
    b = jnp.exp(lse_i - m_safe)
    total = a + b
    has = total > 0
    total_safe = jnp.where(has, total, 1.0)
    o_new = (a[..., None] * o + b[..., None] * o_i) / total_safe[..., None]
    lse_new = jnp.where(has, m_safe + jnp.log(total_safe), -jnp.inf)
    return o_new, lse_new


def _add_sinks(o, lse, sinks):
    """The final merge with the sink logit (one extra denominator term with no value)."""
    s = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :], lse.shape)
    return _merge(o, lse, jnp.zeros_like(o), s)


def _take(table, index):
    return jnp.asarray(np.asarray(table, np.int32))[index]


def _task_call(opts: _Options, task: _Task, qt, kt, vt, aux, q_pos, k_pos):
    """Run one task: `(out [B, n, N, Hv], lse [B, n, N])` of `attnlib.attention` on the sub-block."""
    kwargs = dict(opts.forwarded)
    rule = opts.rule
    q_len, kv_len = aux.get("q_len"), aux.get("kv_len")
    if task.kind == "mask":
        offset = k_pos[None, :] - rule.band.diagonal(q_pos[:, None], rule.q_len, rule.kv_len)
        allowed = (jnp.ones(offset.shape, bool) & rule.band.allows(offset))[None]  # [1, n, m]
        if q_len is not None:
            allowed = allowed & (q_pos[None, :] < q_len[:, None])[:, :, None]
        if kv_len is not None:
            allowed = allowed & (k_pos[None, :] < kv_len[:, None])[:, None, :]
        q_seg = aux.get("q_seg")
        if q_seg is not None:
            qs = jax.lax.dynamic_slice_in_dim(q_seg, task.q_start, task.q_size, axis=1)
            ks = jax.lax.dynamic_slice_in_dim(aux["kv_seg"], task.k_start, task.k_size, axis=1)
            allowed = allowed & ((qs[:, :, None] != 0) & (qs[:, :, None] == ks[:, None, :]))
        return _attention(qt, kt, vt, mask=allowed[:, None], return_residual=True, **kwargs)
    if q_len is not None:
        kwargs["query_seq_lengths"] = jnp.sum(
            (q_pos[None, :] < q_len[:, None]).astype(jnp.int32), axis=1
        )
    if kv_len is not None:
        kwargs["key_value_seq_lengths"] = jnp.sum(
            (k_pos[None, :] < kv_len[:, None]).astype(jnp.int32), axis=1
        )
    if task.kind == "native":
        kwargs.update(
            is_causal=task.is_causal, local_window_size=task.window, diagonal_alignment=task.alignment
        )
    return _attention(qt, kt, vt, return_residual=True, **kwargs)


def _set_rows(x, start: int, update):
    """`x` with `update` written at `start` along axis 1: `x.at[:, start : start + n].set(update)`.

    A concatenation of `x`'s other rows and `update`, neither a scatter nor a `dynamic_update_slice`:
    - a scatter over a static slice carries an empty int32 indices constant, which `shard_map` hoists into an operand
      of `sdy.manual_computation`; Shardy's canonicalizer (ManualComputationUnusedInputsPattern) segfaults on such
      zero-size operands (jaxlib 0.11.2, XLA:CPU);
    - a `dynamic_update_slice` (an in-place fusion) inside a `lax.switch` branch whose float32 result is converted to
      bfloat16 after the switch (the last step's output, dQ) does not compile for a TPU (libtpu 0.0.42): the
      bfloat16 folding narrows the conditional's result but not the in-place fusion at the branch's root, and copy
      insertion fails with "Can't deep copy instruction ...: given shape tree of indices to copy has incompatible
      shapes: f32[...] vs. bf16[...]" (`tests/test_context_parallel_tpu.py`).
    The copy of the other rows is elementwise work of the size of `x`, small next to the step's attention.
    """
    n, length = update.shape[1], x.shape[1]
    parts = [x[:, :start]] if start else []
    parts.append(update.astype(x.dtype))
    if start + n < length:
        parts.append(x[:, start + n :])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _add_rows(x, start: int, update):
    """`x.at[:, start : start + n].add(update)` without a scatter (see `_set_rows`)."""
    n = update.shape[1]
    return _set_rows(x, start, x[:, start : start + n] + update.astype(x.dtype))


def _slices(task, q, k, v):
    qt = q[:, task.q_start : task.q_start + task.q_size]
    kt = k[:, task.k_start : task.k_start + task.k_size]
    vt = v[:, task.k_start : task.k_start + task.k_size]
    return qt, kt, vt


def _run_positions(tables, index):
    """int32 global positions of concatenated runs; `tables[r]` = the runs `((start, size), ...)` of device r."""
    sizes = [n for _, n in next(t for t in tables if t is not None)]
    parts = []
    for j, n in enumerate(sizes):
        start = _take([0 if t is None else t[j][0] for t in tables], index)
        parts.append(start + jnp.arange(n, dtype=jnp.int32))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _task_positions(sp: _StepPlan, b: int, i: int, index):
    """Global positions of the rows and columns of task `i` of branch `b` on the running device.

    The starts come from per-device tables indexed by `index` (devices on other branches hold unused zeros).
    """
    on_b = [sp.branch_of[r] == b for r in range(len(sp.branch_of))]
    q_pos = _run_positions([sp.q_globals[r][i] if on_b[r] else None for r in range(len(on_b))], index)
    k_pos = _run_positions([sp.k_globals[r][i] if on_b[r] else None for r in range(len(on_b))], index)
    return q_pos, k_pos


def _step_forward(opts: _Options, sp: _StepPlan, index, q, k, v, aux, o, lse):
    """Merge this step's partial results into the running `(o, lse)` (float32, local query rows)."""

    def branch(b, q, k, v, aux, o, lse):
        for i, task in enumerate(sp.branches[b]):
            q_pos, k_pos = _task_positions(sp, b, i, index)
            o_i, lse_i = _task_call(opts, task, *_slices(task, q, k, v), aux, q_pos, k_pos)
            rows = slice(task.q_start, task.q_start + task.q_size)
            o_r, lse_r = _merge(o[:, rows], lse[:, rows], o_i.astype(jnp.float32), lse_i)
            o = _set_rows(o, task.q_start, o_r)
            lse = _set_rows(lse, task.q_start, lse_r)
        return o, lse

    if len(sp.branches) == 1:
        return branch(0, q, k, v, aux, o, lse)
    fns = [functools.partial(branch, b) for b in range(len(sp.branches))]
    return jax.lax.switch(_take(sp.branch_of, index), fns, q, k, v, aux, o, lse)


def _step_backward(opts: _Options, sp: _StepPlan, index, q, k, v, aux, O, L, dO, dL, dq, dk, dv):
    """Add this step's gradient contributions, recomputing each task's `(out_i, lse_i)`.

    With the global `O`, `L` (sinks included), the step's cotangents are `d out_i = w_i dO` and
    `d lse_i = w_i (dO . (out_i - O) + dL)` with `w_i = exp(lse_i - L)` (0 where `L = -inf`).
    """

    def branch(b, q, k, v, aux, O, L, dO, dL, dq, dk, dv):
        for i, task in enumerate(sp.branches[b]):
            q_pos, k_pos = _task_positions(sp, b, i, index)
            rows = slice(task.q_start, task.q_start + task.q_size)
            fn = lambda qt, kt, vt: _task_call(opts, task, qt, kt, vt, aux, q_pos, k_pos)  # noqa: B023
            (o_i, lse_i), vjp = jax.vjp(fn, *_slices(task, q, k, v))
            L_r = L[:, rows]
            w = jnp.exp(lse_i - jnp.where(jnp.isfinite(L_r), L_r, 0.0))
            dO_r = dO[:, rows]
            d_o = (w[..., None] * dO_r).astype(o_i.dtype)
            d_lse = w * (jnp.sum(dO_r * (o_i.astype(jnp.float32) - O[:, rows]), axis=-1) + dL[:, rows])
            dqt, dkt, dvt = vjp(match((d_o, d_lse), (o_i, lse_i)))
            dq = _add_rows(dq, task.q_start, dqt)
            dk = _add_rows(dk, task.k_start, dkt)
            dv = _add_rows(dv, task.k_start, dvt)
        return dq, dk, dv

    operands = (q, k, v, aux, O, L, dO, dL, dq, dk, dv)
    if len(sp.branches) == 1:
        return branch(0, *operands)
    fns = [functools.partial(branch, b) for b in range(len(sp.branches))]
    return jax.lax.switch(_take(sp.branch_of, index), fns, *operands)


def _shift(x, delta: int, opts: _Options):
    """Send every device's `x` to device `index + delta` (mod D)."""
    D = opts.num_shards
    perm = [(i, (i + delta) % D) for i in range(D)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, opts.axis_name, perm), x)


def _vma(*trees, axis_name) -> tuple:
    """The mesh axes the arrays of `trees` vary over, plus `axis_name`."""
    names = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
    for leaf in jax.tree.leaves(trees):
        names |= varying_axes(leaf) or set()
    return tuple(sorted(names, key=str))


def _varying(x, names: tuple):
    """`x` typed as varying over `names`, so states of steps and switch branches that skip all work keep one type."""
    return vary_over(x, names)


def _initial_state(q, v, names):
    B, T, N, _ = q.shape
    o = jnp.zeros((B, T, N, v.shape[-1]), jnp.float32)
    lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
    return _varying(o, names), _varying(lse, names)


def _ring_forward(opts: _Options, q, k, v, sinks, aux):
    index = jax.lax.axis_index(opts.axis_name)
    o, lse = _initial_state(q, v, _vma(q, k, v, aux, axis_name=opts.axis_name))
    steps = opts.plan.steps
    block = (k, v, aux.get("kv_seg"))
    for s, idx in enumerate(steps):
        nxt = _shift(block, steps[s + 1] - idx, opts) if s + 1 < len(steps) else None  # issued before compute
        step_aux = {**aux, "kv_seg": block[2]}
        o, lse = _step_forward(opts, opts.plan.step_plans[s], index, q, block[0], block[1], step_aux, o, lse)
        block = nxt
    if sinks is not None:
        o, lse = _add_sinks(o, lse, sinks)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(opts: _Options, q, k, v, sinks, aux):
    o, lse = _ring_forward(opts, q, k, v, sinks, aux)
    return o.astype(q.dtype), lse


def _ring_fwd(opts, q, k, v, sinks, aux):
    o, lse = _ring_forward(opts, q, k, v, sinks, aux)
    # Residuals are local: this device's queries, key/value block, output and lse (O(S / D) memory).
    return (o.astype(q.dtype), lse), (q, k, v, sinks, aux, o, lse)


def _ring_bwd(opts, residuals, cotangents):
    q, k, v, sinks, aux, O, L = residuals
    dO, dL = cotangents
    dO = dO.astype(jnp.float32)
    dL = dL.astype(jnp.float32)
    index = jax.lax.axis_index(opts.axis_name)
    names = _vma(q, k, v, aux, O, L, dO, dL, axis_name=opts.axis_name)
    dq = _varying(jnp.zeros(q.shape, jnp.float32), names)
    steps = opts.plan.steps
    block = (k, v, aux.get("kv_seg"))
    grads = (_varying(jnp.zeros(k.shape, jnp.float32), names), _varying(jnp.zeros(v.shape, jnp.float32), names))
    for s, idx in enumerate(steps):
        last = s + 1 == len(steps)
        nxt = None if last else _shift(block, steps[s + 1] - idx, opts)  # issued before compute
        step_aux = {**aux, "kv_seg": block[2]}
        dq, dk, dv = _step_backward(
            opts, opts.plan.step_plans[s], index, q, block[0], block[1], step_aux, O, L, dO, dL, dq, *grads
        )
        # dK/dV accumulators travel with their block ...
        grads = (dk, dv) if last else _shift((dk, dv), steps[s + 1] - idx, opts)
        block = nxt
    # ... and go home after the last step (the block held at offset `idx` belongs to device index - idx).
    if steps and steps[-1] % opts.num_shards:
        grads = _shift(grads, (opts.num_shards - steps[-1]) % opts.num_shards, opts)
    d_sinks = None
    if sinks is not None:
        s_f = sinks.astype(jnp.float32)[None, None, :]
        p_sink = jnp.exp(s_f - jnp.where(jnp.isfinite(L), L, jnp.inf))
        local = jnp.sum(p_sink * (dL - jnp.sum(dO * O, axis=-1)), axis=(0, 1))
        # the replicated sinks get the sum over every mesh axis their cotangent varies over (sequence, batch, ...)
        have, want = varying_axes(local), varying_axes(sinks)
        axes = (opts.axis_name,) if have is None or want is None else tuple(sorted(have - want, key=str))
        d_sinks = (jax.lax.psum(local, axes) if axes else local).astype(sinks.dtype)
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype), d_sinks, None


_ring.defvjp(_ring_fwd, _ring_bwd)
