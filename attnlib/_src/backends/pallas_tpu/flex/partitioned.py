"""The flex kernels' calls as partitionable calls: XLA splits them over batch and key/value heads under `jit`.

Each kernel call (forward, dK/dV, dQ) goes through `partitioning.call` (the rule splash's calls use) with the dims of
its operands named here (`dims_of`): the batch (`b`) leads every per-row operand, the key/value heads (`k`) are axis 1
of the query rows, keys, values, statistics and per-tile gradients (a GQA group stays inside its key/value head's
rows, so it is never split), and arrays broadcast over batch or heads (a `bias [1, ...]`, the host-built block lists,
the logit scale) are replicated. Each shard runs the same kernels on its local batch rows and heads: the plan is
re-derived from the local shapes (`localize`). Token and head-dim axes are never split (an operand split along one is
gathered by XLA, logged once).
"""

import dataclasses
from collections.abc import Callable

import jax

from ...partition_rules import BATCH, Dim, KV_HEADS
from .. import partitioning
from .plan import ArraySpec, Plan


_DIMS: dict[str, tuple[Dim, ...]] = {
    "q": (BATCH, KV_HEADS, "r", "h"),
    "do": (BATCH, KV_HEADS, "r", "hv"),
    "k": (BATCH, KV_HEADS, "s", "h"),
    "v": (BATCH, KV_HEADS, "s", "hv"),
    "out": (BATCH, KV_HEADS, "r", "hv"),
    "dq": (BATCH, KV_HEADS, "r", "h"),
    "lse": (BATCH, KV_HEADS, "r", None),
    "di": (BATCH, KV_HEADS, "r", None),
    "q_seg": (BATCH, "r", None),
    "q_pos": (BATCH, "r", None),
    "kv_seg": (BATCH, None, "s"),
    "kv_pos": (BATCH, None, "s"),
    "sinks": (KV_HEADS, None, None),
    "head": (KV_HEADS, None, None),
    "batch": (BATCH, None, None),
    "partial": (BATCH, KV_HEADS, None, None, None, None),
    "in_place": (BATCH, KV_HEADS, None, None, None),
}


def dims_of(plan: Plan, name: str, x: jax.Array) -> tuple[Dim, ...]:
    """The rule's name of each dim of operand `name`."""
    if name in _DIMS:
        return _DIMS[name]
    if name in ("bias", "mask") or name.startswith("arg"):  # grouped [B|1, K|1, G|1, T|1, S|1]
        batch = BATCH if x.shape[0] == plan.B else None
        heads = KV_HEADS if x.shape[1] == plan.K else None
        return (batch, heads, None, None, None)
    if name.endswith(("_list", "_count", "_full")):
        return (BATCH if plan.map_per_batch else None, None)
    return (None,) * x.ndim  # the scale, dropout seeds, per-row constants: replicated


def localize(plan: Plan, local: dict) -> Plan:
    """The plan of one shard: batch rows and key/value heads from the local query rows; the broadcastable arrays'
    specs from their local shapes (how their gradient is written stays the whole problem's)."""
    B, K = local["q"].shape[:2]
    spec = lambda x, old: None if x is None else ArraySpec(tuple(x.shape), old.dtype, old.in_place)
    args = tuple(spec(local[f"arg{i}"], s) for i, s in enumerate(plan.args))
    return dataclasses.replace(
        plan, B=B, K=K, bias=spec(local.get("bias"), plan.bias), mask=spec(local.get("mask"), plan.mask), args=args
    )


def call(plan: Plan, name: str, named: dict, outputs: tuple[str, ...], body: Callable[[Plan, dict], tuple]):
    """`body(local plan, local operands)` (operands by name, `args` a tuple) as one partitionable call; `named` must
    start with `q` and `k`. `outputs` name the results' kinds (`_DIMS`)."""
    keys, arrays = [], []
    for key, x in named.items():
        if key == "args":
            keys += [f"arg{i}" for i in range(len(x))]
            arrays += list(x)
        elif x is not None:
            keys.append(key)
            arrays.append(x)
    assert keys[:2] == ["q", "k"], keys
    signature = partitioning.Signature(
        name, tuple(keys), outputs, kernel="attnlib flex",
        input_dims=tuple(dims_of(plan, k, x) for k, x in zip(keys, arrays, strict=True)),
        output_dims=tuple(_DIMS[o] for o in outputs),
    )  # fmt: skip

    def run(*xs):
        local = dict(zip(keys, xs, strict=True))
        args = tuple(local.pop(f"arg{i}") for i in range(len(plan.args)))
        return tuple(body(localize(plan, {**local, **{f"arg{i}": a for i, a in enumerate(args)}}),
                          {**local, "args": args}))  # fmt: skip

    outs = partitioning.call(run, signature, arrays)
    return outs if isinstance(outs, tuple) else (outs,)
