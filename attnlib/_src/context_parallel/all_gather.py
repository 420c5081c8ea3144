"""Context parallelism: the all-gather strategy (keys and values gathered once; autodiff reduce-scatters dK/dV)."""


import jax
import jax.numpy as jnp

from .layout import restore
from .ring import _add_sinks, _initial_state, _Options, _step_forward, _vma


def _gather(x, axis_name):
    """`x [B, S_l, ...]` gathered along its sequence axis (1) from every device of `axis_name`: `[B, D · S_l, ...]`.

    The trailing dims travel flattened (`[B, S_l, K · H]`). Gathered as `[B, S_l, K, H]`, the contiguous layout's
    dK / dV got a TPU layout with the sequence above the heads, and libtpu (0.0.42) decomposed the backward's
    reduce-scatter (the transpose of the gather) into an all-reduce of the whole gradient and a slice: twice the
    traffic and a full-sequence buffer. Flattened, it stays one reduce-scatter (`tests/test_context_parallel_tpu.py`).
    """
    flat = jnp.reshape(x, x.shape[:2] + (-1,))
    gathered = jax.lax.all_gather(flat, axis_name, axis=1, tiled=True)
    return jnp.reshape(gathered, (x.shape[0], gathered.shape[1]) + x.shape[2:])


def _all_gather(opts: _Options, q, k, v, sinks, aux, load_balanced: bool):
    D = opts.num_shards
    gather = lambda x: _gather(x, opts.axis_name)
    k_all, v_all = gather(k), gather(v)
    kv_seg = aux.get("kv_seg")
    kv_seg_all = None if kv_seg is None else gather(kv_seg)
    if load_balanced:
        k_all, v_all = restore(k_all, D, axis=1), restore(v_all, D, axis=1)
        kv_seg_all = None if kv_seg_all is None else restore(kv_seg_all, D, axis=1)
    index = jax.lax.axis_index(opts.axis_name)
    o, lse = _initial_state(q, v, _vma(q, k_all, v_all, aux, axis_name=opts.axis_name))
    o, lse = _step_forward(
        opts, opts.plan.step_plans[0], index, q, k_all, v_all, {**aux, "kv_seg": kv_seg_all}, o, lse
    )
    if sinks is not None:
        o, lse = _add_sinks(o, lse, sinks)
    return o.astype(q.dtype), lse
