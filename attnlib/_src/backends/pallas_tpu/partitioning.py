"""How XLA partitions attnlib's Pallas TPU kernel calls under `jit` on sharded arrays: a Shardy rule over batch and
heads, and the per-shard call.

A Mosaic kernel is one custom call XLA cannot look inside: without a rule it gathers every operand onto every
device. Each of attnlib's splash calls (`splash._kernel_call`, `splash._out_only` and the backward kernels), its
paged decode call (`paged._kernel`, `PAGED`: the page pools have no batch axis and split over their key/value heads
only) and its ragged paged call (`ragged._kernel`, `RAGGED`: the serving step on a `"combined"` cache) is a
`custom_partitioning` whose rule (`partition_rules`) names its operands' dims:

- `b`, the batch: axis 0 of every operand and result; partitions with no communication.
- the heads (axis 1): query heads are the compound `(k g)` of key/value heads `k` (major) and the GQA group `g`
  (minor), so a split of the query heads keeps each group with its key/value head; key/value heads are `k`. When the
  mesh splits the query heads finer than the key/value heads (MQA over a model axis), the groups themselves split:
  each shard reads its whole key/value head, and the backward sums dK and dV over those axes (`psum`, the only
  collective). Heads that neither divide evenly stay whole.
- the ragged call has no batch: its queries `[T, N, D']` pack every sequence's tokens, and its combined pool
  `[P, page_size, 2K, D']` holds key head `k` at slot `2k` and its value head at `2k + 1`. That axis is the compound
  `(k pair)` (`partition_rules.KV_PAIR`, never split), so a contiguous split of it follows the key/value heads and
  keeps each key with its value: under tensor parallelism (query heads and the pool's slots over one mesh axis)
  each device runs the kernel on its own heads and its slice of the pool. Lengths, page table and `cu_q_lens` are
  replicated. A split that would leave a shard a head count the kernel cannot tile (`call`'s `kv_heads_ok`) keeps
  the heads whole.
- the padded lengths `T'`, `S'`, the packed tokens and head dims are never split: an operand split along one is
  resharded by XLA, logged once on the `attnlib` logger.

Each shard runs the same kernel call on its local batch and heads: splash's mask is shared by every head and batch
row, so the kernel object (`masks.kernel`) is the one the unsharded call uses. A `vmap` of a call folds the mapped
axis into the batch (one bigger call); a ragged call's packed tokens cannot fold, so it runs one call per example.

Interpret mode partitions too: splash's `interpret=True` and the paged kernels' `paged.interpret_mode` are Pallas's
HLO interpreter, a program without effects (TPU interpret mode's callbacks are not: XLA's partitioner cannot split
them). On TPUs the rule needs libtpu's compiler to call `custom_partitioning`'s callbacks: libtpu 0.0.42 does not
when compiling for a deviceless v5e slice here, nor, as jax-ml/jax#38196 reports, on multi-chip TPUs
(docs/sharding.md). On a TPU slice, call attnlib inside `jax.shard_map`, where every call is local and needs no rule.

Every trace of a kernel runs under `kernel_settings.as_written()`, whatever the caller's JAX settings: the call
(`call`), and what XLA's partitioner traces later (`lower`). 64-bit operands (attnlib's arrays under
`jax_enable_x64`) are narrowed to 32 bits where they enter.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning

from .. import kernel_settings, mesh_visibility, partition_rules as rules, placement
from ..partition_rules import BATCH, Dim, GROUP, KV_HEADS
from . import mesh_call, unseen_mesh


SPLITTABLE = frozenset({BATCH, KV_HEADS, GROUP})


@dataclasses.dataclass(frozen=True)
class Signature:
    """The operands and results of one kernel call, each named by its kind (`dims`); the key/value heads are axis
    `kv_heads_axis` of the second operand, `kv_slots` slots per head (2: a combined pool's key and value).
    `folds`: a `vmap` of the call folds into its batch axis (else: one call per example). `splits`: what the
    call splits, for the warning when XLA reshards an operand."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel: str = "splash"
    kv_heads_axis: int = 1
    kv_slots: int = 1
    folds: bool = True
    splits: str = "only batch and head dims, GQA groups whole"
    input_dims: tuple[tuple[Dim, ...], ...] | None = None
    """Explicit dims of every input (attnlib's flex kernel, whose operands vary per call), instead of `dims`."""
    output_dims: tuple[tuple[Dim, ...], ...] | None = None
    interpretable: bool = True
    """Whether Pallas's HLO interpreter runs the kernel (`unseen_mesh`: the call on a mesh nothing showed)."""

    def dims_of_input(self, i: int, n: int, k: int) -> tuple[Dim, ...]:
        return self.input_dims[i] if self.input_dims is not None else dims(self.inputs[i], n, k)

    def dims_of_output(self, i: int, n: int, k: int) -> tuple[Dim, ...]:
        return self.output_dims[i] if self.output_dims is not None else dims(self.outputs[i], n, k)

    def unbatched(self, i: int) -> bool:
        """Input `i` has no batch axis (shared by every batch row)."""
        if self.input_dims is not None:
            return not self.input_dims[i] or self.input_dims[i][0] != BATCH
        return self.inputs[i] in UNBATCHED


_IDS = ("q", "k", "v", "q_ids", "kv_ids", "sinks")
FORWARD = Signature("forward", _IDS, ("out", "rows"))
"""`_kernel_call`: `q [B, N, T', H']`, `k`, `v [B, K, S', H']`, ids `[B, T']`, `[B, S']`, sinks `[N]` -> `out`,
`lse [B, N, T']`."""
OUT_ONLY = Signature("forward", _IDS, ("out",))
"""`_out_only`: the forward without residuals."""
BACKWARD = Signature("backward", _IDS + ("rows", "out", "rows"), ("q", "k", "v"))
"""The backward kernels: `(q, k, v, ids, sinks, lse, d_out, di) -> (dq, dk, dv)`."""
PAGED = Signature("decode", ("decode_q", "pool", "pool", "lengths", "page_table"), ("decode_q",), "paged-attention", 0)
"""`paged._kernel`: `q [B, N, H']`, head-major pools `[K, P, page_size, H']`, lengths `[B]`, page table
`[B, pages_per_seq]` -> `out [B, N, H']`. The pools have no batch axis: every batch shard reads the whole pool."""

RAGGED = Signature(
    "forward", ("packed_q", "combined_pool", "kv_lens", "seq_table", "cu_q_lens"), ("packed_q",),
    "ragged paged-attention", kv_heads_axis=2, kv_slots=2, folds=False,
    splits="only head dims, GQA groups whole (its packed tokens mix the sequences, its pool is shared by them)",
    interpretable=False,
)  # fmt: skip
"""`ragged.ragged_kernel`: packed queries `[T, N, D']`, the combined pool `[P, page_size, 2K, D']` (slot `2k` key
head `k`, `2k + 1` its value head: the axis is `(k pair)`, so a contiguous split keeps the pairs whole), kv lengths
`[B]`, page table `[B, pages_per_seq]`, `cu_q_lens [B + 1]` -> `out [T, N, D']`. No batch axis: the tokens of every
sequence are one packed axis and the pool is shared, so the call splits its heads only; the per-sequence operands
are replicated. A `vmap` of it runs one call per example."""

UNBATCHED = frozenset({"sinks", "pool", "combined_pool"})
"""Operands without a batch axis: shared by every batch row (a `vmap` that maps them runs one call per example)."""


def dims(kind: str, n: int, k: int) -> tuple[Dim, ...]:
    """The rule's name of each dim of an operand or result of `kind` in a call with `n` query and `k` kv heads."""
    heads = rules.query_heads(n, k)
    return {
        "q": (BATCH, heads, "t", "h"),
        "k": (BATCH, KV_HEADS, "s", "h"),
        "v": (BATCH, KV_HEADS, "s", "hv"),
        "out": (BATCH, heads, "t", "hv"),
        "rows": (BATCH, heads, "t"),
        "q_ids": (BATCH, "t"),
        "kv_ids": (BATCH, "s"),
        "sinks": (heads,),
        "decode_q": (BATCH, heads, "h"),
        "pool": (KV_HEADS, "p", "page", "h"),
        "lengths": (BATCH,),
        "page_table": (BATCH, "pages"),
        "packed_q": ("t", heads, "h"),
        "combined_pool": ("p", "page", rules.combined_kv_heads(k), "h"),
        "kv_lens": ("seqs",),
        "seq_table": ("seqs", "pages"),
        "cu_q_lens": ("cu",),
    }[kind]


def _fold(x: jax.Array, batched: bool, axis_size: int, unbatched: bool) -> jax.Array:
    """`[V, B, ...]` (or `[B, ...]`, broadcast) -> `[V * B, ...]`; `unbatched` operands (unmapped) stay as they are."""
    if unbatched:
        return x
    x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
    return x.reshape(axis_size * x.shape[1], *x.shape[2:])


def call(
    fn: Callable[..., Any], signature: Signature, operands: Sequence[jax.Array | None],
    kv_heads_ok: Callable[[int], bool] | None = None,
) -> Any:
    """`fn(*operands)` (a kernel call over the batch; segment ids may be None) as a partitionable call: its results
    (one array, or a tuple as `signature.outputs` has several), traced under JAX's default settings
    (`kernel_settings.as_written`) with 64-bit operands narrowed to 32 bits. `kv_heads_ok(local)`: whether the
    kernel takes a shard of `local` key/value heads (a split it does not take keeps the heads whole)."""
    operands = [None if x is None else kernel_settings.narrowed(x) for x in operands]
    mesh = mesh_visibility.visible_mesh([x for x in operands if x is not None])
    with kernel_settings.as_written():
        if mesh_call.needs_wrapping(mesh):
            return _on_mesh(fn, signature, operands, kv_heads_ok, mesh)
        return _call(fn, signature, operands, kv_heads_ok)


def _named_dims(signature: Signature, operands: Sequence[jax.Array | None]):
    """`(indices of the operands present, (batch, query heads, key/value heads), their dims, the results' dims)`."""
    present = [i for i, x in enumerate(operands) if x is not None]
    q, kv = operands[0], operands[1]
    assert q is not None and kv is not None
    b, n, k = q.shape[0], q.shape[1], kv.shape[signature.kv_heads_axis] // signature.kv_slots
    in_dims = [signature.dims_of_input(i, n, k) for i in present]
    out_dims = [signature.dims_of_output(i, n, k) for i in range(len(signature.outputs))]
    return present, (b, n, k), in_dims, out_dims


def _refilled(count: int, present: Sequence[int], xs: Sequence[jax.Array]) -> list[jax.Array | None]:
    """The `count` operands of a call, `xs` at the indices `present`, None elsewhere."""
    full: list[jax.Array | None] = [None] * count
    for i, x in zip(present, xs):
        full[i] = x
    return full


def _on_mesh(
    fn: Callable[..., Any], signature: Signature, operands: Sequence[jax.Array | None],
    kv_heads_ok: Callable[[int], bool] | None, mesh: Any,
) -> Any:
    """The call as a `shard_map` over `mesh`'s free axes (`mesh_call`): each device's call is local there."""
    present, (b, n, k), in_dims, out_dims = _named_dims(signature, operands)
    arrays = [operands[i] for i in present]

    def local(*xs: jax.Array) -> tuple[jax.Array, ...]:
        outs = _call(fn, signature, _refilled(len(operands), present, xs), kv_heads_ok)
        return outs if isinstance(outs, tuple) else (outs,)

    description = (
        f"attnlib pallas_tpu: the {signature.kernel} {signature.name} call",
        f"{signature.kernel} call splits {signature.splits}",
    )
    outs = mesh_call.call(
        local, mesh, arrays, [signature.inputs[i] for i in present], in_dims, out_dims, signature.outputs,
        description, b, n, k, SPLITTABLE, kv_heads_ok,
    )  # fmt: skip
    return outs if len(outs) > 1 else outs[0]


def _call(
    fn: Callable[..., Any], signature: Signature, operands: Sequence[jax.Array | None],
    kv_heads_ok: Callable[[int], bool] | None,
) -> Any:
    present, (b, n, k), in_dims, out_dims = _named_dims(signature, operands)
    arrays = [operands[i] for i in present]
    assert all(x is not None for x in arrays)
    kinds = [signature.inputs[i] for i in present]

    def run(*xs: jax.Array) -> tuple[jax.Array, ...]:
        outs = fn(*_refilled(len(operands), present, xs))
        return tuple(outs) if isinstance(outs, tuple) else (outs,)

    # `custom_partitioning` takes no closed-over constants, and splash's block tables are NumPy constants of its
    # kernels: they become leading operands, replicated (each shard's call closes over its own copy again).
    closed = jax.make_jaxpr(run)(*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays))
    consts = placement.built_on_host(lambda: [jnp.asarray(c) for c in closed.consts])
    nc = len(consts)
    const_dims = [(None,) * c.ndim for c in consts]

    def hoisted(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr, list(xs[:nc])))(*xs[nc:]))

    partitioned = custom_partitioning(hoisted)

    def split_of(mesh: Any, arg_shapes: Any) -> rules.Split:
        q_axes = rules.mesh_axes(arg_shapes[nc].sharding, len(in_dims[0]))
        return rules.choose_split(mesh, in_dims[0], q_axes, b, n, k, SPLITTABLE, kv_heads_ok=kv_heads_ok)

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple[Any, ...]:
        del result_shape
        return rules.shardings(mesh, split_of(mesh, arg_shapes), out_dims)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any):
        del result_shape
        split = split_of(mesh, arg_shapes)
        arg_shardings = rules.shardings(mesh, split, const_dims + in_dims)
        incoming = [rules.mesh_axes(a.sharding, len(d)) for a, d in zip(arg_shapes[nc:], in_dims)]
        chosen = [rules.mesh_axes(s, len(d)) for s, d in zip(arg_shardings[nc:], in_dims)]
        rules.log_resharded(
            f"attnlib pallas_tpu: the {signature.kernel} {signature.name} call",
            f"a {signature.kernel} call splits {signature.splits}", kinds,
            in_dims, incoming, chosen,
        )  # fmt: skip

        def lower(*xs: jax.Array) -> tuple[jax.Array, ...]:
            with kernel_settings.as_written():  # traced by XLA's partitioner, outside `call`
                outs = run(*xs[nc:])
            if not split.group_axes:
                return outs
            # The GQA groups were split (fewer kv heads than shards): each shard's dK, dV cover its query heads.
            return tuple(
                jax.lax.psum(o.astype(jnp.float32), split.group_axes).astype(o.dtype) if kind in ("k", "v") else o
                for o, kind in zip(outs, signature.outputs)
            )

        return mesh, lower, rules.shardings(mesh, split, out_dims), arg_shardings

    text, replicated, sizes = rules.rule(const_dims + in_dims, out_dims, SPLITTABLE, n, k)
    partitioned.def_partition(
        partition, infer_sharding_from_operands=infer, sharding_rule=text, need_replication_factors=replicated,
        **sizes,
    )  # fmt: skip

    def interpreted(*xs: jax.Array) -> tuple[jax.Array, ...]:
        with unseen_mesh.hlo_interpreter(), kernel_settings.as_written():
            return run(*xs[nc:])

    @jax.custom_batching.custom_vmap
    def one_call(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return unseen_mesh.call(
            lambda *ys: tuple(partitioned(*ys)), interpreted if signature.interpretable else None,
            (signature.kernel, signature.name), *xs,
        )  # fmt: skip

    @one_call.def_vmap
    def folded(axis_size: int, in_batched: list[bool], *xs: jax.Array) -> tuple[Any, Any]:
        batched_shared = any(batched and signature.unbatched(i) for i, batched in zip(present, in_batched[nc:]))
        if not signature.folds or batched_shared:
            # Per-example sinks or pools cannot share one call's operand (nor packed tokens one call's ranges): one
            # call per example.
            def each(i: jax.Array) -> tuple[jax.Array, ...]:
                flat: list[jax.Array | None] = [None] * len(operands)
                for j, x, batched in zip(present, xs[nc:], in_batched[nc:]):
                    flat[j] = x[i] if batched else x
                outs = call(fn, signature, flat, kv_heads_ok)
                return outs if isinstance(outs, tuple) else (outs,)

            return jax.lax.map(each, jnp.arange(axis_size)), tuple(True for _ in signature.outputs)
        flat: list[jax.Array | None] = [None] * len(operands)
        for i, x, batched in zip(present, xs[nc:], in_batched[nc:]):
            flat[i] = _fold(x, batched, axis_size, signature.unbatched(i))
        outs = call(fn, signature, flat, kv_heads_ok)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), tuple(True for _ in outs)

    outs = one_call(*consts, *arrays)
    return outs if len(outs) > 1 else outs[0]
