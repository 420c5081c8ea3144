"""How XLA partitions a cuDNN graph call under `jit` on sharded arrays: a Shardy rule and a per-shard graph.

Every cuDNN graph call (`executor.ffi_graph_call`) is a `custom_partitioning` whose rule names each operand's dims
by the graph's axes (`_dims`):

- `b`, the batch: partitions with no communication (dense and paged graphs; a ragged (THD) graph's sequences share
  packed token arrays, so its batch is not an axis that can be split).
- the heads: query heads are the compound `(k g)` of key/value heads `k` (major) and the GQA group `g` (minor), so a
  split of the query heads keeps each group with its key/value head; key/value heads are `k`. Both partition with no
  communication. Bias, lengths, page tables, sinks and `score_mod_args` follow with the dims they have.
- everything else (query and key lengths, head dims, packed tokens, page pools, ragged offsets) is never split: an
  operand that arrives sharded along one of those is resharded by XLA (logged once, pointing to
  `attnlib.context_parallel` for sequence sharding).

Each shard runs the graph of its local `GraphSpec` (`local_spec`: the local batch and heads), built at compile time.
A result that sums over the batch or the heads inside the graph (dBias of a bias without a batch or head dim; dK
and dV when the GQA group itself is split, e.g. MQA over a model axis) is summed over the mesh axes that split them
(`psum`, as `jax.nn`'s cuDNN attention does for dBias); the FP8 amaxes take the maximum. These reductions are the
only collectives; none gathers an operand. A modifier that reads the batch or head index keeps that axis whole (a
shard would see local indices).

Dropout: a cuDNN graph with dropout is never split. cuDNN draws an element's keep bit from its index within the
call, so a shard holding batch elements (or heads) from the second onward draws another slice of the mask than the
unsharded call does, whatever Philox offset it gets (`tests/gpu_sharding_check.py --only dropout`, measured on an
H200 with cuDNN 9.27: a batch split with the same or a shifted offset and a head split with a shifted offset all drew
masks different from the unsharded call's). XLA gathers the operands and each device runs the whole call (the
unsharded call's mask), logged once (`_log_resharded`); the plain-JAX implementations split dropout exactly.

Explicit axes (`AxisType.Explicit`, "sharding in types"): the rule is the same. `Cudnn` runs the whole
implementation with the explicit axes made automatic (`mesh_visibility.with_automatic_axes`, a
`jax.sharding.auto_axes` typed like the query), so every call here is traced on automatic axes and XLA partitions it
as above. On the explicit axes themselves the calls still partitioned, but their results were typed replicated (a
`custom_partitioning` call is typed as the function it wraps, here `jax.ffi.ffi_call`s whose results carry no
sharding; jax-ml/jax#34811 reports more trouble with `custom_partitioning` on explicit axes): XLA gathered out and
lse onto every device, and the custom VJP's cotangents did not match the operands' types.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from .. import partition_rules as rules
from ..partition_rules import BATCH, Dim, GROUP, KV_HEADS, Split
from . import modifier as modifier_lib
from .graph_spec import FP8_AMAXES, FP8_SCALES, GraphSpec, MODIFIER_ARG_UID, Uid


_RAGGED_OFFSETS = (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS)

RawCall = Callable[..., tuple[jax.Array, ...]]
"""`raw(spec, entry, *operands, tokens=...)`: one FFI call of a built graph, its outputs in `spec.out_uids()` order."""


def splittable(spec: GraphSpec) -> frozenset[str]:
    """The factors of `spec`'s rule that may be split over mesh axes."""
    if spec.dropout > 0:
        return frozenset()
    factors = {BATCH, KV_HEADS, GROUP}
    if spec.ragged:
        factors.discard(BATCH)
    if spec.modifier is not None:
        if spec.modifier.reads_batch:
            factors.discard(BATCH)
        if modifier_lib.reads_input(spec.modifier.jaxpr, 2):  # the head index
            factors -= {KV_HEADS, GROUP}
    return frozenset(factors)


def _query_heads(spec: GraphSpec) -> Dim:
    return rules.query_heads(spec.n, spec.k)


def _dims(spec: GraphSpec, uid: int, shape: tuple[int, ...]) -> tuple[Dim, ...]:
    """The rule's name of each dim of the array `shape` bound to `uid`."""
    batch = "rb" if spec.ragged else BATCH  # a ragged graph's sequence count is not a splittable batch
    query_heads = _query_heads(spec)
    heads = lambda size: query_heads if size == spec.n else None  # noqa: E731
    if spec.modifier is not None and uid >= MODIFIER_ARG_UID:
        _, n, t, s = shape
        return None, heads(n), "t" if t == spec.t else None, "s" if s == spec.s else None
    if uid in FP8_SCALES or uid in FP8_AMAXES or uid in (Uid.SEED, Uid.OFFSET, Uid.ATTN_SCALE):
        return (None,) * len(shape)
    if uid in _RAGGED_OFFSETS:
        return None, None
    q_like = uid in (Uid.Q, Uid.DQ, Uid.O, Uid.DO)
    kv_like = uid in (Uid.K, Uid.DK, Uid.V, Uid.DV)
    dim = "h" if uid in (Uid.Q, Uid.DQ, Uid.K, Uid.DK) else "hv"
    if spec.ragged and q_like:
        return "tq", query_heads, dim
    if spec.ragged and kv_like:
        return "tkv", KV_HEADS, dim
    if spec.pages and uid in (Uid.K, Uid.V):
        return "p", "ps", KV_HEADS, dim
    if q_like:
        return batch, "t", query_heads, dim
    if kv_like:
        return batch, "s", KV_HEADS, dim
    if uid == Uid.STATS and spec.ragged_stats:
        return "tq", query_heads
    if uid in (Uid.STATS, Uid.SCORE_MAX, Uid.SUM_EXP):
        return batch, query_heads, "t"
    if uid in (Uid.BIAS, Uid.DBIAS):
        return batch if shape[0] == spec.b else None, heads(shape[1]), "t", "s"
    if uid in (Uid.SEQ_Q, Uid.SEQ_KV):
        return (batch,)
    if uid in (Uid.PT_K, Uid.PT_V):
        return batch, "pp"
    if uid == Uid.SINK:
        return (query_heads,)
    raise ValueError(f"no partitioning dims for uid {uid!r}")


def _rule(spec: GraphSpec, in_dims: Sequence[tuple[Dim, ...]], out_dims: Sequence[tuple[Dim, ...]]) -> tuple:
    """`(rule string, need_replication factors, factor sizes)` for `custom_partitioning.def_partition`."""
    return rules.rule(in_dims, out_dims, splittable(spec), spec.n, spec.k)


def choose_split(spec: GraphSpec, mesh: Any, q_axes: tuple[tuple[str, ...], ...]) -> Split:
    """The split of a call whose query arrives with per-dim mesh axes `q_axes` (`partition_rules.choose_split`)."""
    q_dims = _dims(spec, Uid.Q, (0,) * len(q_axes))
    return rules.choose_split(mesh, q_dims, q_axes, spec.b, spec.n, spec.k, splittable(spec))


def local_spec(spec: GraphSpec, mesh: Any, split: Split) -> GraphSpec:
    """The graph one shard runs: `spec` with its batch and heads divided by the mesh axes of `split`."""
    nb, nh, nk = (rules.size(mesh, a) for a in (split.batch, split.heads, split.kv_heads))
    b, n, k = spec.b // nb, spec.n // nh, spec.k // nk
    changes: dict[str, Any] = dict(b=b, n=n, k=k)
    if spec.bias_b:
        changes["bias_b"] = b if spec.bias_b == spec.b else spec.bias_b
        changes["bias_n"] = n if spec.bias_n == spec.n else spec.bias_n
    if spec.modifier is not None and nh > 1:
        dims = tuple((d0, n if dn == spec.n else dn, dt, ds) for d0, dn, dt, ds in spec.modifier.arg_dims)
        changes["modifier"] = dataclasses.replace(spec.modifier, arg_dims=dims)
    return dataclasses.replace(spec, **changes)


def _log_resharded(spec: GraphSpec, uids: Sequence[int], dims: Sequence[tuple[Dim, ...]], incoming, chosen) -> None:
    names = [Uid(u).name if u < MODIFIER_ARG_UID else f"score_mod_args[{u - MODIFIER_ARG_UID}]" for u in uids]
    why = (
        "a cuDNN call with dropout splits nothing: a shard would draw another slice of the mask than the unsharded "
        "call (docs/sharding.md); implementation='xla_chunked' splits dropout"
        if spec.dropout > 0
        else "a cuDNN call splits only batch and head dims, GQA groups whole"
    )
    rules.log_resharded(f"attnlib cudnn: the graph call {spec.label}", why, names, dims, incoming, chosen)


def _local_offsets(offsets: jax.Array, parts: int) -> jax.Array:
    """A ragged graph's element offsets (int32 `[b + 1, 2]` (low, high) pairs, `token * heads * dim`) for a shard
    holding `1 / parts` of the heads (`ragged.element_offsets`: the high word is 0)."""
    if parts == 1:
        return offsets
    return offsets.at[:, 0].set(offsets[:, 0] // parts)


def call(
    spec: GraphSpec, entry: Any, operands: Sequence[jax.Array], tokens: tuple[int, int] | None, raw: RawCall,
    entry_of: Callable[[GraphSpec], Any],
) -> tuple[jax.Array, ...]:
    """Run the graph of `spec` on `operands` (in `spec.in_uids()` order) as a partitionable call.

    Args:
        spec: the (global) graph.
        entry: its built graph, run when XLA does not partition the call (one device, or inside `shard_map`).
        operands: the graph's inputs.
        tokens: ragged graphs: the packed `(Tq, Tkv)` token counts.
        raw: the unpartitioned FFI call.
        entry_of: the built graph of a shard's local spec (built when XLA partitions, at compile time).

    Returns:
        The outputs in `spec.out_uids()` order.
    """
    in_uids, out_uids = spec.in_uids(), spec.out_uids()
    in_shapes = [tuple(x.shape) for x in operands]
    in_dims = [_dims(spec, u, s) for u, s in zip(in_uids, in_shapes)]
    out_dims = [_dims(spec, u, spec.shape(u, tokens)[0]) for u in out_uids]

    def run(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(raw(spec, entry, *xs, tokens=tokens))

    partitioned = custom_partitioning(run)

    def split_of(mesh: Any, arg_shapes: Any) -> Split:
        return choose_split(spec, mesh, rules.mesh_axes(arg_shapes[0].sharding, len(in_shapes[0])))

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple[Any, ...]:
        del result_shape
        return rules.shardings(mesh, split_of(mesh, arg_shapes), out_dims)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any):
        del result_shape
        split = split_of(mesh, arg_shapes)
        arg_shardings = rules.shardings(mesh, split, in_dims)
        incoming = [rules.mesh_axes(a.sharding, len(s)) for a, s in zip(arg_shapes, in_shapes)]
        chosen = [rules.mesh_axes(s, len(d)) for s, d in zip(arg_shardings, in_dims)]
        _log_resharded(spec, in_uids, in_dims, incoming, chosen)
        local = local_spec(spec, mesh, split)

        def lower(*xs: jax.Array) -> tuple[jax.Array, ...]:
            xs = list(xs)
            for at, uid in enumerate(in_uids):
                if uid in _RAGGED_OFFSETS:
                    per = spec.k // local.k if uid in (Uid.OFF_K, Uid.OFF_V) else spec.n // local.n
                    xs[at] = _local_offsets(xs[at], per)
            outs = list(raw(local, entry_of(local), *xs, tokens=tokens))
            for i, (uid, dims) in enumerate(zip(out_uids, out_dims)):
                if uid == Uid.DBIAS:
                    summed = (split.batch if BATCH not in dims else ()) + (
                        split.heads if _query_heads(spec) not in dims else ()
                    )
                    if summed:
                        outs[i] = jax.lax.psum(outs[i].astype(jnp.float32), summed).astype(outs[i].dtype)
                elif uid in (Uid.DK, Uid.DV) and split.group_axes:
                    outs[i] = jax.lax.psum(outs[i].astype(jnp.float32), split.group_axes).astype(outs[i].dtype)
                elif uid in FP8_AMAXES and (split.batch or split.heads):
                    outs[i] = jax.lax.pmax(outs[i], split.batch + split.heads)
            return tuple(outs)

        return mesh, lower, rules.shardings(mesh, split, out_dims), arg_shardings

    rule, replicated, sizes = _rule(spec, in_dims, out_dims)
    partitioned.def_partition(
        partition, infer_sharding_from_operands=infer, sharding_rule=rule, need_replication_factors=replicated,
        **sizes,
    )
    return tuple(partitioned(*operands))
