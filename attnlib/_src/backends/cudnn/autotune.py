"""Plan autotuning: how many of cuDNN's backend plans a graph's build times, on which scratch tensors, and the choice.

Plan autotuning (on unless `ATTNLIB_CUDNN_AUTOTUNE=0`; `=all` times every plan): when cuDNN's heuristics offer more
than one backend plan, the first `MAX_AUTOTUNE_CANDIDATES` are built, each is timed once by the native extension on
scratch buffers of the graph's shapes (zeros, full lengths), and the fastest is kept. The choice and the timings
travel with the graph in the cache (`GraphEntry.plan`), so a configuration is timed once per machine, not once per
process. A timing that fails (for example out of memory next to JAX's preallocated pool) keeps the heuristic's first
plan and logs why.
"""

import dataclasses
import logging
import os

import numpy as np

from . import ffi
from .graph_spec import GraphSpec, Uid


logger = logging.getLogger("attnlib")

MAX_AUTOTUNE_CANDIDATES = 4
"""How many of the heuristics' backend plans autotuning builds and times."""

MAX_AUTOTUNE_CANDIDATES_MODIFIER = 1
"""The same for graphs with a score modifier, whose plans are compiled at build time (about 0.5 s each): the
heuristics' first plan was the fastest or within 2 % of it for the modifier forms timed on the H200
(docs/performance.md, "How attnlib's choices were measured"), so they are not autotuned. The exception, an `or`
of two masks that cannot merge into one compare (second plan 11 % faster), is 4.5x slower either way."""


def autotune_mode() -> str:
    """`ATTNLIB_CUDNN_AUTOTUNE`: `"heuristics"` (`0`, `false`, `off`, `no`: the heuristics' first plan, untimed),
    `"all"` (`all`: every backend plan the heuristics list is built and timed) or `"autotuned"` (anything else, the
    default: the first `MAX_AUTOTUNE_CANDIDATES`)."""
    value = os.environ.get("ATTNLIB_CUDNN_AUTOTUNE", "1").strip().lower()
    if value in ("0", "false", "off", "no"):
        return "heuristics"
    return "all" if value == "all" else "autotuned"


def autotune_enabled() -> bool:
    """Plan autotuning is on unless `ATTNLIB_CUDNN_AUTOTUNE` is `0`, `false`, `off` or `no`."""
    return autotune_mode() != "heuristics"


def _candidates_wanted(spec: "GraphSpec", mode: str | None = None) -> int:
    """How many backend plans the build of `spec` times, by `mode` (default `autotune_mode()`)."""
    mode = autotune_mode() if mode is None else mode
    if mode == "heuristics":
        return 1
    if mode == "all":
        return 1 << 30
    return MAX_AUTOTUNE_CANDIDATES if spec.modifier is None else MAX_AUTOTUNE_CANDIDATES_MODIFIER


@dataclasses.dataclass(frozen=True)
class _BuiltPlan:
    index: int
    name: str
    blob: bytes
    workspace: int


_ITEM_BYTES = {"float8_e4m3fn": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}


RAGGED_TIMING_TOKENS = 65536
"""Packed tokens per side a ragged graph is timed on (its own token capacity when smaller)."""


def timing_tensors(spec: GraphSpec) -> list[tuple[int, int, bytes]]:
    """(uid, bytes, contents) of every tensor of `spec` for timing its plans: zeros, except full sequence lengths,
    ragged offsets of `b` equal sequences (as long as the graph's bounds and the token budget allow) and a page table
    that cycles through the pool."""
    b, t, s = spec.b, spec.t, spec.s
    tokens = None
    if spec.ragged:
        t = max(1, min(t, (spec.t_total or RAGGED_TIMING_TOKENS) // b))
        s = max(1, min(s, (spec.s_total or RAGGED_TIMING_TOKENS) // b))
        tokens = (b * t, b * s)
    contents: dict[Uid, np.ndarray] = {
        Uid.SEQ_Q: np.full((b,), t, np.int32),
        Uid.SEQ_KV: np.full((b,), s, np.int32),
    }
    if spec.ragged:
        sequence = np.arange(b + 1, dtype=np.int64)
        contents.update({
            Uid.OFF_Q: sequence * t * spec.n * spec.h, Uid.OFF_K: sequence * s * spec.k * spec.h,
            Uid.OFF_V: sequence * s * spec.k * spec.hv, Uid.OFF_O: sequence * t * spec.n * spec.hv,
            Uid.OFF_STATS: sequence * t * spec.n,
        })  # fmt: skip
    if spec.pages:
        num_pages, _, pages_per_seq = spec.pages
        table = (np.arange(b * pages_per_seq, dtype=np.int32) % num_pages).reshape(b, pages_per_seq)
        contents.update({Uid.PT_K: table, Uid.PT_V: table})
    described = []
    for uid in spec.in_uids() + spec.out_uids():
        shape, dtype = spec.shape(uid, tokens)
        size = int(np.prod(shape, dtype=np.int64)) * _ITEM_BYTES[dtype]
        data = contents.get(uid)
        described.append((int(uid), size, b"" if data is None else data.tobytes()))
    return described


def _choose(spec: GraphSpec, built: list[_BuiltPlan]) -> tuple[_BuiltPlan, str]:
    """The fastest of the built plans (timed by the native extension), and a record of the timings."""
    first = built[0]
    tensors = timing_tensors(spec)
    times = []
    for plan in built:
        try:
            times.append(ffi.extension().time_graph(plan.blob, tensors, plan.workspace))
        except (RuntimeError, ValueError) as e:
            logger.info("attnlib: cannot time cuDNN plans of %s (%s); keeping the heuristics' first plan.",
                        spec.label, e)
            return first, f"{first.name} (heuristics' first; timing failed: {e})"
    best = min(range(len(built)), key=lambda i: times[i])
    timings = ", ".join(f"{p.name} {ms:.4f} ms" for p, ms in zip(built, times))
    logger.info("attnlib: autotuned %s: %s -> %s", spec.label, timings, built[best].name)
    return built[best], f"{built[best].name} (autotuned: {timings})"
