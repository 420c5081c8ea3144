"""Running built cuDNN graphs from JAX: the graph cache, one FFI call per graph, and batching under `vmap`.

- `GraphExecutor`: what the cuDNN implementation builds and runs graphs with (`attnlib.Cudnn(executor=...)`):
  `FfiExecutor`, the real one, by default; tests hand in an emulation.
- `get_entry(spec)`: the built graph of a `GraphSpec` (memory / disk cache, else built and autotuned now).
- `run(spec, values, executor)`: fetch (or build) and run a graph on tensors by UID.
- `ffi_graph_call`: one `jax.ffi.ffi_call` of the target `attnlib_cudnn_graph` for a built graph, marked for the
  native executor's CUDA-graph replay when its work is short (`replays`), partitioned over batch and heads when
  XLA partitions the program (`partitioning.py`).
- `graph_call(spec, executor)`: an executor's call under `jax.custom_batching.custom_vmap`, whose rule folds a
  vmapped axis into the graph's batch dim and runs one bigger graph (a fused call, not a loop).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ... import varying
from . import ffi, graphs, partitioning, support
from .cache import GraphCache, GraphEntry
from .graphs import GraphSpec, Uid


CACHE = GraphCache()
"""The process's graph cache (memory, plus disk under `ATTNLIB_CACHE_DIR`)."""

REPLAY_BELOW_US = 30.0
"""Calls whose work `expected_device_us` puts below this many microseconds are marked for replay (docs/performance.md,
"Replaying short graph calls")."""

_FLOPS_PER_US = 500e6  # bf16 attention on an H200, large shapes (docs/performance.md, "NVIDIA H200, cuDNN path")
_BYTES_PER_US = 4e6  # H200 HBM3e


def expected_device_us(spec: GraphSpec) -> float:
    """A rough H200 time of one run of `spec`'s graph: its matmul work or its Q, K, V, O traffic, whichever is more
    (a backward as 2.5 forwards; a causal band as half the scores)."""
    rows, keys = spec.b * spec.t, spec.b * spec.s
    flops = 2.0 * rows * spec.s * spec.n * (spec.h + spec.hv)
    if spec.right_bound == 0:
        flops /= 2
    elt = 1 if spec.fp8 else 2
    traffic = elt * (rows * spec.n + keys * spec.k) * (spec.h + spec.hv)
    us = max(flops / _FLOPS_PER_US, traffic / _BYTES_PER_US)
    return 2.5 * us if spec.direction == "bwd" else us


def replays(spec: GraphSpec) -> bool:
    """Whether the native executor may replay `spec`'s calls from a captured CUDA graph: a replayed call costs the host
    one graph launch instead of cuDNN's 15-30 us of host work, and the device about 2 us more, so it pays only for
    short graphs, where the host rather than the device sets the pace."""
    return expected_device_us(spec) < REPLAY_BELOW_US


def get_entry(spec: GraphSpec) -> GraphEntry:
    """The built graph of `spec`: cached in memory / on disk, else built now (about a second)."""
    return FfiExecutor().get_entry(spec)


class GraphExecutor(Protocol):
    """Builds and runs cuDNN graphs for the cuDNN implementation. Implementations are hashable (frozen dataclasses):
    they ride in the static plans of a call."""

    def get_entry(self, spec: GraphSpec) -> GraphEntry:
        """The built graph of `spec`.

        Raises:
            graphs.GraphRejected: cuDNN refused to build it.
        """
        ...

    def call(
        self, spec: GraphSpec, entry: GraphEntry, *operands: jax.Array, tokens: tuple[int, int] | None = None
    ) -> tuple[jax.Array, ...]:
        """Run the built graph `entry` of `spec` on `operands` (in `spec.in_uids()` order); the outputs in
        `spec.out_uids()` order. `tokens` is the packed `(Tq, Tkv)` of a ragged graph's call."""
        ...


@dataclasses.dataclass(frozen=True)
class FfiExecutor:
    """The real executor: graphs built by the cuDNN frontend on this process's GPU, cached in `CACHE`, run by
    attnlib's native extension through one `jax.ffi.ffi_call` each (`ffi_graph_call`).

    Attributes:
        autotune: how a graph's plan is chosen (`autotune.py`): `"autotuned"`, `"heuristics"` or `"all"`; None
            reads `ATTNLIB_CUDNN_AUTOTUNE` when a graph is looked up.
        cache_dir: where built graphs persist (None: memory only); `...` reads `ATTNLIB_CACHE_DIR` at each lookup.
    """

    autotune: str | None = None
    cache_dir: Any = ...

    def get_entry(self, spec: GraphSpec) -> GraphEntry:
        key = graphs.cache_key(spec, support.device(), self.autotune)
        return CACHE.get(key, lambda: graphs.build(spec, self.autotune), self.cache_dir)

    def call(
        self, spec: GraphSpec, entry: GraphEntry, *operands: jax.Array, tokens: tuple[int, int] | None = None
    ) -> tuple[jax.Array, ...]:
        return ffi_graph_call(spec, entry, *operands, tokens=tokens, entry_of=self.get_entry)


def run(
    spec: GraphSpec,
    values: dict[Uid, Any],
    tokens: tuple[int, int] | None = None,
    executor: GraphExecutor = FfiExecutor(),
) -> tuple[jax.Array, ...]:
    """Run the graph of `spec` (built, or fetched from the cache) with `executor` on `values` by tensor UID;
    `tokens` as `ffi_graph_call`'s."""
    return executor.call(spec, executor.get_entry(spec), *[values[uid] for uid in spec.in_uids()], tokens=tokens)


def primal_values(tree):
    """`tree` with the `CustomVJPPrimal` wrappers of a `custom_vjp` forward rule (`symbolic_zeros=True`) removed."""
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)  # noqa: E731
    return jax.tree.map(lambda x: x.value if is_primal(x) else x, tree, is_leaf=is_primal)


def ffi_graph_call(
    spec: GraphSpec,
    entry: GraphEntry,
    *operands: jax.Array,
    tokens: tuple[int, int] | None = None,
    entry_of: Callable[[GraphSpec], GraphEntry] = get_entry,
) -> tuple[jax.Array, ...]:
    """Run a built graph on `operands` (in `spec.in_uids()` order); returns the outputs in `spec.out_uids()` order.

    Under `jit` on sharded arrays XLA partitions the call over batch and heads (`partitioning.py`); each shard runs
    its own graph, built by `entry_of` (the executor's, so its autotuning and cache directory apply). `tokens` is the
    packed `(Tq, Tkv)` of a ragged graph's call (its results' leading dims).
    """

    @jax.custom_batching.custom_vmap
    def one_call(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return partitioning.call(spec, entry, xs, tokens, _ffi_call, entry_of)

    @one_call.def_vmap
    def sequential(axis_size: int, in_batched: list[bool], *xs: jax.Array) -> tuple[Any, Any]:
        del axis_size
        mapped = tuple(x for x, b in zip(xs, in_batched) if b)

        def step(ys: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            it = iter(ys)
            return one_call(*(next(it) if b else x for x, b in zip(xs, in_batched)))

        return jax.lax.map(step, mapped), tuple(True for _ in spec.out_uids())

    # Inside shard_map the results vary like the operands (ffi_call types them from `results`, which says nothing).
    axes = varying.union_axes(operands)
    return tuple(varying.vary_over(x, axes) for x in one_call(*operands))


def _ffi_call(
    spec: GraphSpec, entry: GraphEntry, *operands: jax.Array, tokens: tuple[int, int] | None = None
) -> tuple[jax.Array, ...]:
    """One `jax.ffi.ffi_call` of the target `attnlib_cudnn_graph` for a built graph, unpartitioned."""
    results = [jax.ShapeDtypeStruct(*spec.shape(uid, tokens)) for uid in spec.out_uids()]
    if entry.workspace_bytes > 0:  # a temporary buffer XLA allocates for each execution
        results.append(jax.ShapeDtypeStruct((entry.workspace_bytes,), jnp.uint8))
    call = jax.ffi.ffi_call(ffi.TARGET, results, vmap_method="sequential")
    outs = call(
        *operands,
        graph=np.frombuffer(entry.blob, np.uint8),
        label=entry.label,
        in_uids=np.asarray(entry.in_uids, np.int64),
        out_uids=np.asarray(entry.out_uids, np.int64),
        ws_bytes=np.int64(entry.workspace_bytes),
        zero_fill=np.asarray(entry.zero_fill, np.int64),
        replay=replays(spec),
    )
    return tuple(outs[: len(spec.out_uids())])


_BATCH_MAJOR = {Uid.Q, Uid.K, Uid.V, Uid.O, Uid.DO, Uid.STATS, Uid.DQ, Uid.DK, Uid.DV, Uid.SEQ_Q, Uid.SEQ_KV}
_BIAS = {Uid.BIAS, Uid.DBIAS}


@functools.cache
def graph_call(spec: GraphSpec, executor: GraphExecutor = FfiExecutor()) -> Any:
    """`fn(*operands) -> outputs` running the graph of `spec` with `executor`; `vmap` folds the mapped axis into the
    batch."""

    @jax.custom_batching.custom_vmap
    def call(*operands: jax.Array) -> tuple[jax.Array, ...]:
        return executor.call(spec, executor.get_entry(spec), *operands)

    @call.def_vmap
    def fold(axis_size: int, in_batched: list[bool], *operands: jax.Array) -> tuple[Any, Any]:
        uids = spec.in_uids()
        out_uids = spec.out_uids()
        shared_batched = any(b for u, b in zip(uids, in_batched) if u not in _BATCH_MAJOR and u not in _BIAS)
        if shared_batched or (spec.modifier is not None and spec.modifier.reads_batch):
            # Per-example sinks, dropout seeds or modifier arguments cannot share one graph call, nor can a modifier
            # that reads the batch index (it would see the folded batch): loop over the mapped axis.
            batched_ops = tuple(x for x, b in zip(operands, in_batched) if b)

            def one(xs: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
                it = iter(xs)
                return call(*(next(it) if b else x for x, b in zip(operands, in_batched)))

            outs = jax.lax.map(one, batched_ops)
            return outs, tuple(True for _ in out_uids)

        V, B = axis_size, spec.b
        folded = []
        for uid, x, batched in zip(uids, operands, in_batched):
            if uid in _BATCH_MAJOR:
                x = x if batched else jnp.broadcast_to(x, (V,) + x.shape)
                folded.append(jnp.reshape(x, (V * B,) + x.shape[2:]))
            elif uid in _BIAS:
                x = x if batched else jnp.broadcast_to(x, (V,) + x.shape)
                x = jnp.broadcast_to(x, (V, B) + x.shape[2:])
                folded.append(jnp.reshape(x, (V * B,) + x.shape[2:]))
            else:
                folded.append(x)
        big = dataclasses.replace(spec, b=V * B, bias_b=V * B if spec.bias_b else 0)
        outs = graph_call(big, executor)(*folded)
        unfolded = []
        for uid, y in zip(out_uids, outs):
            if uid in graphs.FP8_AMAXES:  # one amax of the whole folded call
                unfolded.append(jnp.broadcast_to(y, (V,) + y.shape))
                continue
            y = jnp.reshape(y, (V, B) + y.shape[1:])
            if uid in _BIAS and spec.bias_b == 1:
                y = jnp.sum(y.astype(jnp.float32), axis=1, keepdims=True).astype(y.dtype)
            unfolded.append(y)
        return tuple(unfolded), tuple(True for _ in out_uids)

    return call
