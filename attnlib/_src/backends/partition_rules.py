"""The parts of attnlib's Shardy rules that every fused kernel call shares: factor names, the rule string, the split
of batch and heads over mesh axes, and the warning when XLA reshards an operand.

A kernel call (a cuDNN graph, a splash call) names each operand dim by a factor: `b` the batch, query heads the
compound `(k g)` of key/value heads `k` (major) and the GQA group `g` (minor), key/value heads `k` (a combined
key/value pool's head axis: the compound `(k pair)`, `KV_PAIR`); every other dim is never split
(`need_replication_factors`), so an operand that arrives split along it is gathered by XLA.
"""

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from .. import logs


BATCH = "b"
KV_HEADS = "k"
GROUP = "g"
HEADS = (KV_HEADS, GROUP)
"""Query heads: key/value head major, GQA group minor."""
KV_PAIR = "pair"
"""The key or value slot of a combined pool's head axis `2K` (slot `2k` key head `k`, `2k + 1` its value head): the
axis is `(k pair)`, so a split of it into contiguous shards keeps each key/value pair whole; never split itself."""

SEQUENCE = frozenset({"t", "s", "tq", "tkv"})
"""The names kernel calls give their query and key token dims (never split: `attnlib.context_parallel` splits them)."""

Dim = str | tuple[str, str] | None
"""One operand dim in a rule: a factor name, the compound query heads `HEADS`, or None (a dim of its own, size 1 or
never split)."""


def query_heads(n: int, k: int) -> Dim:
    """The query heads' name in a rule with `n` query and `k` key/value heads: `(k g)`, or one factor where the other
    has size 1 (Shardy rejects a compound with a factor of size 1)."""
    if n == k:
        return KV_HEADS
    return GROUP if k == 1 else HEADS


def combined_kv_heads(k: int) -> Dim:
    """The head axis `2K` of a pool holding `k` key/value heads as interleaved pairs: `(k pair)`, or the pair alone
    for one head (Shardy rejects a compound with a factor of size 1)."""
    return (KV_HEADS, KV_PAIR) if k > 1 else KV_PAIR


def rule(
    in_dims: Sequence[tuple[Dim, ...]], out_dims: Sequence[tuple[Dim, ...]], splittable: Collection[str], n: int, k: int
) -> tuple[str, tuple[str, ...], dict[str, int]]:
    """`(rule string, need_replication factors, factor sizes)` for `custom_partitioning.def_partition`: the named
    factors outside `splittable` are replicated; a factor that only appears inside compounds is given its size
    (`g` is `n // k`, `k` is `k`, `pair` is 2), as Shardy asks."""
    unique = iter(range(1 << 20))
    named: list[str] = []  # in order of first appearance: Shardy wants special factors sorted by their index
    whole: set[str] = set()

    def array(dims: tuple[Dim, ...]) -> str:
        words = []
        for d in dims:
            if d is None:
                words.append(f"u{next(unique)}")
            elif isinstance(d, tuple):
                words.append(f"({' '.join(d)})")
                named.extend(f for f in d if f not in named)
            else:
                words.append(d)
                named.extend([d] if d not in named else [])
                whole.add(d)
        return " ".join(words)

    text = ", ".join(map(array, in_dims)) + " -> " + ", ".join(map(array, out_dims))
    replicated = tuple(f for f in named if f not in splittable)
    known = {GROUP: n // k, KV_HEADS: k, KV_PAIR: 2}
    return text, replicated, {f: known[f] for f in named if f not in whole}


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes that split one call's batch, query heads and key/value heads (empty: not split)."""

    batch: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    kv_heads: tuple[str, ...] = ()

    def axes(self, dim: Dim) -> tuple[str, ...]:
        if dim == BATCH:
            return self.batch
        if dim in (HEADS, GROUP):  # a lone group factor is the query heads of a call with one kv head
            return self.heads
        if dim in (KV_HEADS, (KV_HEADS, KV_PAIR)):  # a combined pool's pairs follow their key/value head
            return self.kv_heads
        return ()

    @property
    def group_axes(self) -> tuple[str, ...]:
        """The axes that split the GQA groups themselves (fewer kv heads than shards): each shard's dK and dV hold
        the gradient of its query heads only, summed over these axes."""
        return self.heads[len(self.kv_heads) :]


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def mesh_axes(sharding: Any, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per-dim mesh axes of an operand's sharding (None or not a `NamedSharding`: unsplit)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return ((),) * ndim
    padded = tuple(spec) + (None,) * (ndim - len(spec))
    return tuple(_axes(e) for e in padded)


def size(mesh: Any, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def choose_split(
    mesh: Any, q_dims: tuple[Dim, ...], q_axes: tuple[tuple[str, ...], ...], b: int, n: int, k: int,
    allowed: Collection[str], split_groups: bool = True, kv_heads_ok: Callable[[int], bool] | None = None,
) -> Split:
    """The split of a call whose query (dims `q_dims`) arrives with per-dim mesh axes `q_axes`: its batch and head
    axes where they divide the batch and keep GQA groups whole (the key/value heads take the major axes, the group
    the rest, unless `split_groups` is False: then the heads split only as far as the key/value heads do).
    `kv_heads_ok(local)`: whether the kernel takes a shard of `local` key/value heads (default: any)."""
    batch: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    for d, axes in zip(q_dims, q_axes):
        if d == BATCH and BATCH in allowed:
            batch = axes
        elif d == query_heads(n, k) and {KV_HEADS, GROUP} <= set(allowed):
            heads = axes
    if batch and b % size(mesh, batch):
        batch = ()
    kv: tuple[str, ...] = ()
    for i in range(len(heads) + 1):
        shards = size(mesh, heads[:i])
        if k % shards == 0 and (kv_heads_ok is None or kv_heads_ok(k // shards)):
            kv = heads[:i]
    group = heads[len(kv) :]
    group_ok = not group or (split_groups and size(mesh, kv) == k and (n // k) % size(mesh, group) == 0)
    if not group_ok:
        heads, kv = (), ()
    return Split(batch, heads, kv)


def shardings(mesh: Any, split: Split, dims: Sequence[tuple[Dim, ...]]) -> tuple[NamedSharding, ...]:
    """The `NamedSharding` of each array (dims `dims`) under `split`."""
    return tuple(NamedSharding(mesh, PartitionSpec(*(split.axes(d) or None for d in ds))) for ds in dims)


def log_resharded(
    call: str, why: str, names: Sequence[str], dims: Sequence[tuple[Dim, ...]], incoming: Sequence[Any],
    chosen: Sequence[Any],
) -> None:
    """One warning (once per set of resharded dims and axes) naming what XLA gathers to run `call` by its rule, and
    `why` the rule keeps those dims whole (pointing to `attnlib.context_parallel` where a sequence dim is gathered):
    `incoming` and `chosen` are the operands' per-dim mesh axes."""
    found = []
    for name, operand_dims, have, want in zip(names, dims, incoming, chosen):
        for position, (d, h, w) in enumerate(zip(operand_dims, have, want)):
            if h and h != w:
                named = " ".join(d) if isinstance(d, tuple) else d
                found.append((name, position, named or "unsplittable", h))
    if not found:
        return
    key = ("resharded", why, tuple(sorted({(d, h) for _, _, d, h in found})))
    described = ", ".join(f"{name} dim {position} ({d}) over {list(h)}" for name, position, d, h in found)
    sequence = any(d in SEQUENCE for _, _, d, _ in found)
    logs.log_once(
        key, logging.WARNING,
        "%s gets operands split along dims it cannot split (%s); XLA gathers them (%s).%s", call, described, why,
        " To split the sequence, use attnlib.context_parallel." if sequence else "",
    )  # fmt: skip
