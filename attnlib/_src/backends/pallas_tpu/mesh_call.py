"""Kernel calls on a mesh JAX shows at trace time: each one a `jax.shard_map` over the mesh's free axes.

A Mosaic kernel is one custom call XLA cannot partition. `custom_partitioning` would carry attnlib's rule to XLA's
partitioner, but libtpu never calls its callbacks (jax-ml/jax#38196: "Custom emitter for CustomSPMDPartitioning not
found" on every multi-chip TPU program). Where the program's mesh is visible while the call is traced, attnlib needs
no callback: it wraps the call in `jax.shard_map` over the axes not already manual, with the split its rule chooses
(`partition_rules.choose_split`: batch and heads, GQA groups whole), so each chip runs the kernel on its shard and
XLA moves nothing the rule keeps in place. The mesh is visible

- through the operands' types under explicit axes (`AxisType.Explicit`): their specs are the caller's layout, and the
  rule follows it (what it cannot split, XLA reshards, logged once);
- through `jax.set_mesh` with automatic axes, or an operand's sharding (a committed `NamedSharding` argument of a
  `jit`, or an abstract one of an ahead-of-time trace): the mesh is known, the layout is not. The call then splits
  its batch over the axes not named like a tensor-parallel axis (`HEAD_AXIS_NAMES`) that divide it, and its heads
  over the rest (`automatic_layout`), logged once at INFO; XLA reshards operands laid out otherwise.

Inside `jax.shard_map` the manual axes are the caller's: only the remaining ones (if any) are wrapped. A mesh of one
device, or none at all, leaves the call to `partitioning` unchanged. What is not TPU-specific (the visible mesh, its
explicit axes, an implementation run on automatic axes with results typed like the query) is `mesh_visibility.py`'s,
shared with the cuDNN implementation.
"""

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ... import logs
from .. import mesh_visibility, partition_rules as rules
from ..mesh_visibility import explicit_axes, free_axes, is_explicit as _explicit
from ..partition_rules import BATCH, Dim


PLATFORMS_WITHOUT_CALLBACKS = ("tpu",)
"""Platforms whose compiler never calls `custom_partitioning`'s callbacks (libtpu: jax-ml/jax#38196)."""

HEAD_AXIS_NAMES = frozenset({"model", "tensor", "tp", "mp", "heads", "head"})
"""Mesh axis names that, with automatic axes, split the heads (tensor parallelism) rather than the batch."""


def needs_wrapping(mesh: Any | None) -> bool:
    """Whether a kernel call over `mesh` is wrapped: its free axes span more than one device, and some are explicit
    (the layout is in the types) or its devices are TPUs (where `custom_partitioning` is not reached). Automatic axes
    elsewhere (interpret mode on CPU devices) keep the `custom_partitioning` rule, which sees the operands' layout
    when XLA partitions."""
    if mesh is None or math.prod(mesh.shape[a] for a in free_axes(mesh)) == 1:
        return False
    platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    return any(_explicit(mesh, a) for a in free_axes(mesh)) or platform in PLATFORMS_WITHOUT_CALLBACKS


def explain(mesh: Any) -> str | None:
    """What a call traced now does on `mesh` (`jax.set_mesh`'s), for `attnlib.explain`: None where it runs as on one
    device (no mesh shown, or one XLA partitions through the rule's callbacks)."""
    if not mesh_visibility.has_axes(mesh) or not needs_wrapping(mesh):
        return None
    axes = {a: mesh.shape[a] for a in free_axes(mesh)}
    if explicit_axes(mesh):
        layout = "split as its operands' types say"
    else:
        layout = f"the batch split first, the heads over axes named {sorted(HEAD_AXIS_NAMES)}"
    return f"runs each kernel call on every device's shard of the mesh {axes} (a `jax.shard_map`: {layout})"


_CALLER_LAYOUT: contextvars.ContextVar[tuple[tuple[str, ...], tuple[str, ...]] | None] = contextvars.ContextVar(
    "attnlib_pallas_tpu_caller_layout", default=None
)
"""The mesh axes of the caller's batch and query heads, while a call with explicit axes runs under automatic ones."""


@contextlib.contextmanager
def _caller_layout(batch: tuple[str, ...], heads: tuple[str, ...]) -> Iterator[None]:
    token = _CALLER_LAYOUT.set((batch, heads))
    try:
        yield
    finally:
        _CALLER_LAYOUT.reset(token)


def with_automatic_axes(run: Callable[[Any], tuple[jax.Array, ...]], inputs: Any, mesh: Any) -> tuple[jax.Array, ...]:
    """`run(inputs)` with `mesh`'s explicit axes made automatic inside (`mesh_visibility.with_automatic_axes`): the
    kernels' layout work (reshapes that split the heads into GQA groups, padding) then needs no sharding of its own,
    and each kernel call splits as the caller's query does (its batch and heads axes, `_CALLER_LAYOUT`). The results
    carry the query's spec (the output's head dim and `lse`'s last dim unsplit)."""
    return mesh_visibility.with_automatic_axes(run, inputs, mesh, around=_caller_layout)


def automatic_layout(
    mesh: Any, q_dims: tuple[Dim, ...], axes: Sequence[str], b: int, n: int, k: int
) -> tuple[tuple[str, ...], ...]:
    """Per-dim mesh axes attnlib gives a query (dims `q_dims`) whose layout it cannot see: the batch takes the axes
    `axes` not named in `HEAD_AXIS_NAMES` while their product divides it, the heads the rest."""
    heads_dim = rules.query_heads(n, k)
    batch: list[str] = []
    heads: list[str] = []
    for a in axes:
        if mesh.shape[a] == 1:
            continue
        if a not in HEAD_AXIS_NAMES and b % (rules.size(mesh, tuple(batch)) * mesh.shape[a]) == 0:
            batch.append(a)
        else:
            heads.append(a)
    return tuple(tuple(batch) if d == BATCH else tuple(heads) if d == heads_dim else () for d in q_dims)


def _spec(split: rules.Split, dims: tuple[Dim, ...]) -> PartitionSpec:
    return PartitionSpec(*(split.axes(d) or None for d in dims))


def call(
    local: Callable[..., tuple[jax.Array, ...]], mesh: Any, arrays: Sequence[jax.Array], kinds: Sequence[str],
    in_dims: Sequence[tuple[Dim, ...]], out_dims: Sequence[tuple[Dim, ...]], out_kinds: Sequence[str],
    description: tuple[str, str], b: int, n: int, k: int, allowed: frozenset[str],
    kv_heads_ok: Callable[[int], bool] | None,
) -> tuple[jax.Array, ...]:
    """`local(*shards)` (the kernel call on one device's operands) as a `shard_map` over `mesh`'s free axes, split
    as attnlib's rule chooses for the query's visible layout (or `automatic_layout`). `description`: the call's name
    and what it splits, for the log. Key/value gradients (`out_kinds` "k", "v") of a split that divides the GQA
    groups are summed over those axes, as the rule's own partition does."""
    axes = free_axes(mesh)
    q_type = rules.mesh_axes(getattr(jax.typeof(arrays[0]), "sharding", None), len(in_dims[0]))
    seen = tuple(tuple(a for a in d if a in axes and _explicit(mesh, a)) for d in q_type)
    automatic = [a for a in axes if not _explicit(mesh, a)]
    typed = not automatic  # every free axis explicit: the operands' types must name the specs the `shard_map` takes
    caller = _CALLER_LAYOUT.get()
    if automatic and caller is not None:  # explicit axes made automatic around the call: the caller's layout
        heads_dim = rules.query_heads(n, k)
        named = {BATCH: caller[0], heads_dim: caller[1]}
        seen = tuple(s + tuple(a for a in named.get(d, ()) if a in automatic) for s, d in zip(seen, in_dims[0]))
        automatic = []
    elif automatic:
        guessed = automatic_layout(mesh, in_dims[0], automatic, b, n, k)
        seen = tuple(s + g for s, g in zip(seen, guessed))
    split = rules.choose_split(mesh, in_dims[0], seen, b, n, k, allowed, kv_heads_ok=kv_heads_ok)
    name, splits = description
    if automatic:
        idle = [a for a in axes if mesh.shape[a] > 1 and a not in split.batch + split.heads]
        message = (
            f"{name} runs under a mesh whose automatic axes {automatic} hide how its operands are laid out: it splits "
            f"the batch over {list(split.batch)} and the heads over {list(split.heads)}"
            + (f" (every device along {idle} computes the same shard)" if idle else "")
            + "; XLA reshards operands laid out otherwise (with explicit axes, `AxisType.Explicit`, the call follows "
            "the operands' layout)"
        )
        logs.log_once(("automatic layout", message), logging.WARNING if idle else logging.INFO, message)
    incoming = [rules.mesh_axes(getattr(jax.typeof(x), "sharding", None), len(d)) for x, d in zip(arrays, in_dims)]
    chosen = [tuple(split.axes(dim) for dim in d) for d in in_dims]
    rules.log_resharded(name, f"a {splits}", kinds, in_dims, incoming, chosen)

    def body(*xs: jax.Array) -> tuple[jax.Array, ...]:
        outs = local(*xs)
        if not split.group_axes:
            return outs
        import jax.numpy as jnp

        return tuple(
            jax.lax.psum(o.astype(jnp.float32), split.group_axes).astype(o.dtype) if kind in ("k", "v") else o
            for o, kind in zip(outs, out_kinds)
        )

    in_specs = tuple(_spec(split, d) for d in in_dims)
    out_specs = tuple(_spec(split, d) for d in out_dims)
    if typed:
        arrays = [jax.sharding.reshard(x, spec) for x, spec in zip(arrays, in_specs)]
    wrapped = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(axes), check_vma=False
    )
    return tuple(wrapped(*arrays))
