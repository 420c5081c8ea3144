"""What a fused kernel call can see of its mesh while it is traced, and an implementation run on automatic axes.

Shared by the implementations whose kernels are custom calls XLA cannot look inside (`cudnn`, `pallas_tpu`):

- `visible_mesh`, `free_axes`, `explicit_axes`: the mesh a call traced now runs over (`jax.set_mesh`'s, the one JAX
  sets under explicit axes and inside `shard_map`, or an operand's `NamedSharding` type) and which of its axes are
  not manual, and explicit.
- `with_automatic_axes`: under explicit axes (`AxisType.Explicit`, "sharding in types") an implementation's layout
  work (reshapes that flatten `*B` or split heads into GQA groups, padding, broadcast biases) would need a sharding
  typing for every op, and a custom call's results (`jax.ffi.ffi_call`, `pallas_call`) are typed replicated, so
  XLA would gather them onto every device. The implementation runs instead with the explicit axes made automatic
  (`jax.sharding.auto_axes`), as under `jax.set_mesh` of an automatic mesh, where its kernel calls partition as
  they do there (cuDNN: its `custom_partitioning` rule; Pallas TPU: a `shard_map` split as the caller's query,
  `pallas_tpu/mesh_call.py`), and its results are typed like the query (`result_spec`). JAX types the gradients
  of its inputs like the inputs.
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

from . import partition_rules as rules


def has_axes(mesh: Any) -> bool:
    """Whether `mesh` is a mesh with axes (not None, not the empty abstract mesh)."""
    return mesh is not None and not getattr(mesh, "empty", True)


def visible_mesh(operands: Any) -> Any | None:
    """The abstract mesh a call traced now runs over: `jax.set_mesh`'s (or the one JAX sets under explicit axes and
    inside `shard_map`), else the mesh of an operand's `NamedSharding` type; None when neither shows one."""
    mesh = jax.sharding.get_abstract_mesh()
    if has_axes(mesh):
        return mesh
    for x in operands:
        sharding = getattr(jax.typeof(x), "sharding", None)
        candidate = getattr(sharding, "mesh", None)
        if has_axes(candidate):
            return candidate
    return None


def free_axes(mesh: Any) -> tuple[str, ...]:
    """The axes of `mesh` not manual (not already split by an enclosing `shard_map`)."""
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)


def is_explicit(mesh: Any, axis: str) -> bool:
    return mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Explicit


def explicit_axes(mesh: Any) -> tuple[str, ...]:
    """The explicit axes of the mesh a call traced now runs over (those `jax.sharding.auto_axes` can free)."""
    return tuple(a for a in free_axes(mesh) if is_explicit(mesh, a)) if has_axes(mesh) else ()


def result_spec(q_spec: tuple[Any, ...], rank: int) -> PartitionSpec:
    """The spec of a result of rank `rank` of a call whose query (`[*B, T, N, H]`, THD `[T, N, H]`) has `q_spec`:
    the output drops the head dim's split, `lse` the head dim, `max_logit` the tokens and the head dim."""
    q_rank = len(q_spec)
    if rank == q_rank:
        return PartitionSpec(*q_spec[:-1], None)
    if rank == q_rank - 1:
        return PartitionSpec(*q_spec[:-1])
    return PartitionSpec(*q_spec[:-3], q_spec[-2])


Around = Callable[[tuple[str, ...], tuple[str, ...]], contextlib.AbstractContextManager[Any]]
"""`around(batch_axes, head_axes)`: a context the implementation runs in on automatic axes, given the mesh axes of
the caller's batch and query heads (their split is no longer in the types there)."""


def with_automatic_axes(
    run: Callable[[Any], tuple[jax.Array, ...]], inputs: Any, mesh: Any, around: Around | None = None
) -> tuple[jax.Array, ...]:
    """`run(inputs)` (an implementation's results for its `AttentionInputs`) with `mesh`'s explicit axes made
    automatic inside (`jax.sharding.auto_axes`), within `around(batch axes, head axes)` when given. The results carry
    the query's spec (the output's head dim and `lse`'s last dim unsplit; `result_spec`)."""
    q_spec = tuple(rules.mesh_axes(jax.typeof(inputs.query).sharding, inputs.query.ndim))
    batch = tuple(a for d in q_spec[:-3] for a in d)
    names = [f.name for f in dataclasses.fields(inputs)]
    leaves, tree = jax.tree.flatten(tuple(getattr(inputs, n) for n in names))

    def inner(*xs: jax.Array) -> tuple[jax.Array, ...]:
        values = jax.tree.unflatten(tree, xs)
        with around(batch, q_spec[-2]) if around is not None else contextlib.nullcontext():
            return tuple(run(dataclasses.replace(inputs, **dict(zip(names, values)))))

    axes = explicit_axes(mesh)
    shapes = jax.eval_shape(jax.sharding.auto_axes(inner, axes=axes, out_sharding=PartitionSpec()), *leaves)
    spec = tuple(d or None for d in q_spec)
    out_sharding = tuple(result_spec(spec, len(x.shape)) for x in shapes)
    return tuple(jax.sharding.auto_axes(inner, axes=axes, out_sharding=out_sharding)(*leaves))
