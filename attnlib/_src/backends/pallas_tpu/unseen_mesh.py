"""A kernel call on a mesh nothing showed at trace time: chosen when XLA lowers it, where the device count is known.

`mesh_call` wraps a call whose mesh is visible while it is traced. A program can place a call on several devices
without showing it then (`jax.jit(f, in_shardings=...)` on unsharded arguments, arrays made inside the program and
placed by XLA's propagation): its kernel call reaches XLA's partitioner, and on TPUs the `custom_partitioning` that
carries attnlib's rule is never called back there (jax-ml/jax#38196), nor can a Mosaic call be partitioned without
it. So each kernel call is one `kernel_or_interpreted` primitive whose lowering looks at the program it is lowered
into: on one device, inside a `shard_map` that made every axis manual, or for a backend other than TPU, it lowers
the kernel call (through `custom_partitioning`, as before); in a TPU program partitioned by XLA over several devices
it lowers the same call through Pallas's HLO interpreter instead (plain XLA operations, which XLA partitions) and
logs one warning naming the ways to the fused path: `jax.set_mesh`, explicit axes, or `jax.shard_map`.
"""

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
from jax.interpreters import mlir

from ... import logs
from . import mesh_call


PLAIN_WARNING = (
    "attnlib pallas_tpu: the {kernel} {name} call is lowered into a TPU program that XLA partitions over {devices} "
    "devices, on a mesh attnlib could not see when the call was traced; Mosaic kernels cannot be partitioned there, so "
    "it runs through Pallas's HLO interpreter (plain XLA operations: correct, much slower than the kernel). For the "
    "fused kernel on each chip's shard, show the mesh while tracing: `with jax.set_mesh(mesh):` around the call, "
    "arrays with explicit axes (`AxisType.Explicit`), committed `NamedSharding` arguments, or `jax.shard_map`."
)


def _devices_partitioned_by_xla(ctx: Any) -> int:
    """How many devices XLA partitions the program being lowered over, outside any manual axes (1: none)."""
    axis_context = ctx.module_context.axis_context
    num_devices = getattr(axis_context, "num_devices", None)  # a `jit` over a device assignment
    if num_devices is not None:
        return num_devices
    mesh, manual = getattr(axis_context, "mesh", None), getattr(axis_context, "manual_axes", None)
    if mesh is None or manual is None:  # a replica or single-device context
        return 1
    free = [a for a in mesh.axis_names if a not in manual and a not in getattr(mesh, "manual_axes", ())]
    return math.prod(mesh.shape[a] for a in free)


def hlo_interpreter():
    """A context in which every `pallas_call` traced runs through Pallas's HLO interpreter (plain XLA operations,
    whatever its own `interpret` says), the bundled kernels that take no `interpret` argument included. Not TPU
    interpret mode (an `InterpretParams`), whose ordered callbacks XLA's partitioner cannot split."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.force_tpu_interpret_mode(True)  # type: ignore[arg-type]


REACHABLE = jax.__version_info__ < (0, 12)
"""JAX 0.12 treats a primitive whose jaxpr parameter holds a `custom_partitioning` as a "high" one and asks for a rule
lowering it to plain primitives, which this one does not have yet: there a kernel call is lowered as before (a
program that shows no mesh fails to compile on a TPU slice, as it did before `unseen_mesh`)."""

kernel_or_interpreted_p = jex.Primitive("attnlib_pallas_tpu_kernel_or_interpreted")
kernel_or_interpreted_p.multiple_results = True


@kernel_or_interpreted_p.def_impl
def _eager(*xs, kernel: jex.ClosedJaxpr, interpreted: Callable[..., Any] | None, label: tuple[str, str]):
    del interpreted, label  # outside `jit` a call runs where its operands are: the kernel
    return jex.jaxpr_as_fun(kernel)(*xs)


@kernel_or_interpreted_p.def_abstract_eval
def _abstract(*avals, kernel: jex.ClosedJaxpr, interpreted: Callable[..., Any] | None, label: tuple[str, str]):
    del avals, interpreted, label
    return kernel.out_avals


def _lowering(ctx, *args, kernel: jex.ClosedJaxpr, interpreted: Callable[..., Any] | None, label: tuple[str, str]):
    devices = _devices_partitioned_by_xla(ctx)
    if devices == 1 or not set(mesh_call.PLATFORMS_WITHOUT_CALLBACKS) & set(ctx.module_context.platforms):
        return mlir.lower_fun(jex.jaxpr_as_fun(kernel), multiple_results=True)(ctx, *args)
    kernel_name, name = label
    if interpreted is None:
        raise NotImplementedError(
            f"attnlib pallas_tpu: the {kernel_name} {name} call is lowered into a TPU program that XLA partitions over "
            f"{devices} devices, on a mesh attnlib could not see when the call was traced, and this kernel cannot run "
            "through Pallas's interpreter. Show the mesh while tracing: `with jax.set_mesh(mesh):` around the call, "
            "arrays with explicit axes, committed `NamedSharding` arguments, or `jax.shard_map`."
        )
    message = PLAIN_WARNING.format(kernel=kernel_name, name=name, devices=devices)
    logs.log_once(("unseen mesh", kernel_name, name), logging.WARNING, message)
    return mlir.lower_fun(interpreted, multiple_results=True)(ctx, *args)


mlir.register_lowering(kernel_or_interpreted_p, _lowering)


def call(
    kernel: Callable[..., tuple[jax.Array, ...]], interpreted: Callable[..., tuple[jax.Array, ...]] | None,
    label: tuple[str, str], *xs: jax.Array,
) -> tuple[jax.Array, ...]:
    """`kernel(*xs)` (a tuple of arrays), lowered as the kernel wherever it can run and as `interpreted(*xs)` (the
    same call through Pallas's HLO interpreter, or None where the kernel has none) in a TPU program XLA partitions
    over several devices. `label`: the kernel's and the call's names, for the warning."""
    if not REACHABLE:
        return tuple(kernel(*xs))
    closed = jax.make_jaxpr(lambda *ys: tuple(kernel(*ys)))(*xs)
    return tuple(kernel_or_interpreted_p.bind(*xs, kernel=closed, interpreted=interpreted, label=label))
