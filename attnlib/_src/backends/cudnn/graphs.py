"""Forward and backward SDPA graphs built with the cuDNN frontend's Python API, serialized for the FFI executor.

A graph is fully described by a `GraphSpec`. Tensors follow the fixed UID table `Uid`, shared with the C++ executor
through the `in_uids`/`out_uids` attributes. Memory layouts are JAX's row-major arrays:

| tensor | JAX array | cuDNN dims (logical BHSD) |
|---|---|---|
| Q, dQ | `[B, T, N, H]` | `[B, N, T, H]` |
| K, dK | `[B, S, K, H]` | `[B, K, S, H]` |
| V, dV | `[B, S, K, Hv]` | `[B, K, S, Hv]` |
| O, dO | `[B, T, N, Hv]` | `[B, N, T, Hv]` |
| Stats | float32 `[B, N, T]` | `[B, N, T, 1]` |
| Bias, dBias | `[B|1, N|1, T, S]` | same |
| seq lengths | int32 `[B]` | `[B, 1, 1, 1]` |
| dropout seed, offset | int32 `[1]` | `[1, 1, 1, 1]` |
| sinks | float32 `[N]` | `[1, N, 1, 1]` |

Ragged (THD) graphs (`GraphSpec.ragged`) bind packed token arrays instead: Q/dQ `[Tq, N, H]`, K/dK `[Tkv, K, H]`,
V/dV `[Tkv, K, Hv]`, O/dO `[Tq, N, Hv]`, described to cuDNN as `[b, heads, t|s, dim]` (b = the bucketed sequence
count, t/s = the bucketed per-sequence bound) with a ragged offset tensor each (INT64 `[b + 1]`, counted in elements,
bound to int32 `[b + 1, 2]` little-endian (low, high) pairs because JAX runs without 64-bit integers). Stats stay
padded `[b, N, t]` (the layout cuDNN 9.19's backward reads). Paged graphs (`GraphSpec.pages`) bind the key/value pools
`[P, page_size, K, H|Hv]` as cuDNN containers `[P, K, page_size, H|Hv]` and the page table int32 `[b, pages_per_seq]`
as `[b, 1, pages_per_seq, 1]` for keys and values.

The plan is always a cuDNN *backend* plan (a Python-engine plan serializes to a blob C++ cannot read), and the blob
is canonicalized (its process-global graph id zeroed) so equal specs give equal bytes in every process.

Plan autotuning (on unless `ATTNLIB_CUDNN_AUTOTUNE=0`; `=all` times every plan): when cuDNN's heuristics offer more
than one backend plan, the first `MAX_AUTOTUNE_CANDIDATES` are built, each is timed once by the native extension on
scratch buffers of the graph's shapes (zeros, full lengths), and the fastest is kept. The choice and the timings
travel with the graph in the cache (`GraphEntry.plan`), so a configuration is timed once per machine, not once per
process. A timing that fails (for example out of memory next to JAX's preallocated pool) keeps the heuristic's first
plan and logs why.
"""

import dataclasses
import enum
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from ... import ffi
from . import support
from .cache import GraphEntry
from .modifier import ScoreModifier


logger = logging.getLogger("attnlib")

PYPLAN_MAGIC = b"CUDNN_FE_PYPLAN"

MAX_AUTOTUNE_CANDIDATES = 4
"""How many of the heuristics' backend plans autotuning builds and times."""

MAX_AUTOTUNE_CANDIDATES_MODIFIER = 1
"""The same for graphs with a score modifier, whose plans are compiled at build time (about 0.5 s each): the
heuristics' first plan was the fastest or within 2 % of it for the modifier forms timed on the H200
(`benchmarks/results/probe_score_mod_forms_h200_round{3,4}.log`), so they are not autotuned. The exception, an `or`
of two masks that cannot merge into one compare (second plan 11 % faster), is 4.5x slower either way."""


class GraphRejected(NotImplementedError):
    """cuDNN refused to build a graph that attnlib's policy expected it to accept (its message says why)."""


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


def _candidates_wanted(spec: "GraphSpec") -> int:
    mode = autotune_mode()
    if mode == "heuristics":
        return 1
    if mode == "all":
        return 1 << 30
    return MAX_AUTOTUNE_CANDIDATES if spec.modifier is None else MAX_AUTOTUNE_CANDIDATES_MODIFIER


class Uid(enum.IntEnum):
    """Tensor UIDs shared by the graph builder and the executor."""

    Q = 1
    K = 2
    V = 3
    O = 4
    STATS = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    BIAS = 10
    DBIAS = 11
    SEQ_Q = 12
    SEQ_KV = 13
    OFF_Q = 14
    OFF_K = 15
    OFF_V = 16
    OFF_O = 17
    OFF_STATS = 18
    PT_K = 19
    PT_V = 20
    SEED = 21
    OFFSET = 22
    SINK = 23
    DESCALE_Q = 24
    DESCALE_K = 25
    DESCALE_V = 26
    DESCALE_S = 27
    SCALE_S = 28
    SCALE_O = 29
    AMAX_S = 30
    AMAX_O = 31
    SCORE_MAX = 32
    SUM_EXP = 33


FP8_SCALES = (Uid.DESCALE_Q, Uid.DESCALE_K, Uid.DESCALE_V, Uid.DESCALE_S, Uid.SCALE_S, Uid.SCALE_O)
"""The per-tensor float32 scale inputs of an FP8 forward graph (`GraphSpec.fp8`), in `sdpa_fp8`'s order."""

FP8_AMAXES = (Uid.AMAX_S, Uid.AMAX_O)
"""The amax outputs `sdpa_fp8` always produces (attnlib chooses its output scale without them)."""


MODIFIER_ARG_UID = 100
"""`score_mod_args` tensor `i` of a graph with a score modifier has uid `MODIFIER_ARG_UID + i`."""


RAGGED_OFFSETS = {Uid.Q: Uid.OFF_Q, Uid.DQ: Uid.OFF_Q, Uid.K: Uid.OFF_K, Uid.DK: Uid.OFF_K, Uid.V: Uid.OFF_V,
                  Uid.DV: Uid.OFF_V, Uid.O: Uid.OFF_O, Uid.DO: Uid.OFF_O, Uid.STATS: Uid.OFF_STATS}
"""The ragged offset tensor of each packed tensor (gradients share their primal's offsets; Stats only with
`GraphSpec.ragged_stats`)."""


def _ragged_offset(uid: Uid, spec: "GraphSpec") -> Uid | None:
    """The ragged offset tensor `uid` is bound through in `spec`'s graph, if any."""
    if not spec.ragged or (uid == Uid.STATS and not spec.ragged_stats):
        return None
    return RAGGED_OFFSETS.get(uid)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """Everything that determines one cuDNN SDPA graph.

    Attributes:
        direction: `"fwd"` (outputs O and Stats) or `"bwd"` (outputs dQ, dK, dV and dBias when `bias_b`).
        dtype: `"float16"` or `"bfloat16"`.
        b, t, s, n, k, h, hv: batch, query length, key length, query heads, key/value heads, head dims.
        scale: the logit scale (baked into the graph).
        alignment: `"top_left"` or `"bottom_right"` diagonal.
        left_bound: cuDNN's `diagonal_band_left_bound` (keys `j > i - left_bound` are kept) or None.
        right_bound: cuDNN's `diagonal_band_right_bound` (keys `j <= i + right_bound`) or None.
        padding: per-sequence lengths are inputs.
        bias_b, bias_n: bias dims `[bias_b, bias_n, t, s]`; `bias_b = 0` means no bias.
        dropout: dropout probability (0 = off).
        sinks: per-head sink logits are an input.
        deterministic: deterministic backward algorithm.
        ragged: THD layout: Q, K, V, O (and dO, dQ, dK, dV) are packed tokens with ragged element offsets; `b` is
            the (bucketed) sequence count and `t`/`s` the (bucketed) bound of one sequence's length. Needs
            `padding`.
        t_total, s_total: ragged backward: token capacities given to cuDNN as `max_total_seq_len_q/kv` (0 = unset).
        pages: paged KV: `(num_pages, page_size, pages_per_seq)` of the pools and page table (forward only;
            `s = pages_per_seq * page_size`); empty = not paged.
        stats: the forward writes Stats (lse); False only for paged inference without `return_residual`.
        ragged_stats: ragged graphs: Stats are packed per query token, float32 `[Tq, N]` with their own ragged
            offsets (`Uid.OFF_STATS`, counted in elements: token * N), instead of padded `[b, N, t]`.
        modifier: the score modifier (`modifier.py`): `score_mod`, soft cap and masks lowered into cuDNN's
            `score_mod` / `score_mod_bprop` callbacks; its `score_mod_args` are float32 inputs
            `MODIFIER_ARG_UID + i`. None = no modifier.
        bias_grad: the backward writes dBias (False when the bias only carries masks: a boolean `mask` array or
            key padding of a modifier graph).
        fp8: forward only: an `sdpa_fp8` graph. Q, K, V and O are float8_e4m3fn (Hopper writes O in FP8), the
            per-tensor scales of `FP8_SCALES` are inputs, `FP8_AMAXES` extra outputs; `dtype` is then the 16-bit
            type of the rest of the call (its backward graph).
        row_max: dense forward only: the graph writes cuDNN's `score_max` and `score_sum_exp` (float32 `[b, n, t]`
            each) instead of Stats (cuDNN 9.19 takes one or the other): `lse = max + log(sum_exp)`, and the row max
            is `return_max_logit`'s statistic.
        memset_rows: a dense padded top-left graph (`rows_by_length`) zeroes O, dQ, dK and dV with a memset before
            it runs (`zero_fill`; `support.writes_padding_zeros`: on a cuDNN not known to write zeros past the
            lengths). Not part of the cuDNN graph itself. Ragged graphs never memset: `row_fill.set_rows` sets the
            rows outside their sequences after the graph.
    """

    direction: Literal["fwd", "bwd"]
    dtype: str
    b: int
    t: int
    s: int
    n: int
    k: int
    h: int
    hv: int
    scale: float
    alignment: Literal["top_left", "bottom_right"] = "top_left"
    left_bound: int | None = None
    right_bound: int | None = None
    padding: bool = False
    bias_b: int = 0
    bias_n: int = 0
    dropout: float = 0.0
    sinks: bool = False
    deterministic: bool = False
    ragged: bool = False
    t_total: int = 0
    s_total: int = 0
    pages: tuple[int, ...] = ()
    stats: bool = True
    ragged_stats: bool = False
    memset_rows: bool = False
    modifier: ScoreModifier | None = None
    bias_grad: bool = True
    fp8: bool = False
    row_max: bool = False

    @property
    def label(self) -> str:
        kind = "thd_" if self.ragged else "paged_" if self.pages else ""
        direction = self.direction if self.stats else "fwd_nostats"
        if self.modifier is not None:
            kind += "mod_"
        if self.fp8:
            kind += "fp8_"
        if self.row_max:
            kind += "max_"
        return f"sdpa_{kind}{direction}_b{self.b}_t{self.t}_s{self.s}_n{self.n}_k{self.k}_h{self.h}_hv{self.hv}"

    def in_uids(self) -> tuple[Uid, ...]:
        uids = [Uid.Q, Uid.K, Uid.V]
        if self.direction == "bwd":
            uids += [Uid.O, Uid.DO, Uid.STATS]
        if self.ragged:
            uids += [Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O]
            if self.ragged_stats and (self.stats or self.direction == "bwd"):
                uids.append(Uid.OFF_STATS)
        if self.pages:
            uids += [Uid.PT_K, Uid.PT_V]
        if self.bias_b:
            uids.append(Uid.BIAS)
        if self.padding:
            uids += [Uid.SEQ_Q, Uid.SEQ_KV]
        if self.dropout > 0:
            uids += [Uid.SEED, Uid.OFFSET]
        if self.sinks:
            uids.append(Uid.SINK)
        if self.modifier is not None:
            uids += [MODIFIER_ARG_UID + i for i in range(len(self.modifier.arg_dims))]
        if self.fp8:
            uids += FP8_SCALES
        return tuple(uids)

    def out_uids(self) -> tuple[Uid, ...]:
        if self.direction == "fwd":
            outs = (Uid.O, Uid.SCORE_MAX, Uid.SUM_EXP) if self.row_max else (Uid.O, Uid.STATS) if self.stats else (
                Uid.O,)
            return outs + FP8_AMAXES if self.fp8 else outs
        return (Uid.DQ, Uid.DK, Uid.DV) + ((Uid.DBIAS,) if self.bias_b and self.bias_grad else ())

    @property
    def rows_by_length(self) -> bool:
        """Dense padded graph with a top-left diagonal: the rows that exist and see a key are exactly the rows below
        the (trimmed) query lengths, so zero-filled results need no masking pass (`attention.Plan`)."""
        return self.padding and not self.ragged and not self.pages and self.alignment == "top_left"

    def zero_fill(self) -> tuple[int, ...]:
        """Results cuDNN may leave partly unwritten, zeroed before it runs: dBias with padding (entries past the
        lengths), and with `memset_rows` O, dQ, dK, dV of a dense padded top-left graph."""
        outs = self.out_uids()
        by_rows = self.memset_rows and self.rows_by_length
        rows = {Uid.O, Uid.DQ, Uid.DK, Uid.DV} if by_rows else set()
        return tuple(i for i, u in enumerate(outs) if (u == Uid.DBIAS and self.padding) or u in rows)

    def shape(self, uid: Uid, tokens: tuple[int, int] | None = None) -> tuple[tuple[int, ...], str]:
        """JAX shape and dtype of the array bound to `uid`.

        Args:
            uid: the tensor.
            tokens: ragged graphs: the packed `(Tq, Tkv)` token counts of this call (the graph does not fix them).
        """
        b, t, s, n, k, h, hv = self.b, self.t, self.s, self.n, self.k, self.h, self.hv
        if self.modifier is not None and uid >= MODIFIER_ARG_UID:
            return self.modifier.arg_dims[uid - MODIFIER_ARG_UID], "float32"
        if uid in FP8_SCALES or uid in FP8_AMAXES:
            return (1,), "float32"
        if self.fp8 and uid in (Uid.Q, Uid.K, Uid.V, Uid.O):
            return self._dense_shape(uid), "float8_e4m3fn"
        if self.ragged:
            if tokens is None:
                raise ValueError("ragged graphs need the packed token counts to shape their arrays")
            tq, tkv = tokens
            packed = {Uid.Q: (tq, n, h), Uid.DQ: (tq, n, h), Uid.K: (tkv, k, h), Uid.DK: (tkv, k, h),
                      Uid.V: (tkv, k, hv), Uid.DV: (tkv, k, hv), Uid.O: (tq, n, hv), Uid.DO: (tq, n, hv)}
            if uid in packed:
                return packed[uid], self.dtype
            if uid == Uid.STATS and self.ragged_stats:
                return (tq, n), "float32"
            if uid in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS):
                return (b + 1, 2), "int32"
        if self.pages:
            num_pages, page_size, pages_per_seq = self.pages
            if uid == Uid.K:
                return (num_pages, page_size, k, h), self.dtype
            if uid == Uid.V:
                return (num_pages, page_size, k, hv), self.dtype
            if uid in (Uid.PT_K, Uid.PT_V):
                return (b, pages_per_seq), "int32"
        if uid in (Uid.Q, Uid.DQ, Uid.K, Uid.DK, Uid.V, Uid.DV, Uid.O, Uid.DO):
            return self._dense_shape(uid), self.dtype
        return {
            Uid.STATS: ((b, n, t), "float32"),
            Uid.SCORE_MAX: ((b, n, t), "float32"),
            Uid.SUM_EXP: ((b, n, t), "float32"),
            Uid.BIAS: ((self.bias_b, self.bias_n, t, s), self.dtype),
            Uid.DBIAS: ((self.bias_b, self.bias_n, t, s), self.dtype),
            Uid.SEQ_Q: ((b,), "int32"),
            Uid.SEQ_KV: ((b,), "int32"),
            Uid.SEED: ((1,), "int32"),
            Uid.OFFSET: ((1,), "int32"),
            Uid.SINK: ((n,), "float32"),
        }[uid]

    def _dense_shape(self, uid: Uid) -> tuple[int, ...]:
        """`[b, rows, heads, dim]` of a dense Q, K, V, O or gradient."""
        rows, heads = (self.t, self.n) if uid in (Uid.Q, Uid.DQ, Uid.O, Uid.DO) else (self.s, self.k)
        dim = self.h if uid in (Uid.Q, Uid.DQ, Uid.K, Uid.DK) else self.hv
        return (self.b, rows, heads, dim)


def _layout(uid: Uid, spec: GraphSpec) -> tuple[list[int], list[int]]:
    """cuDNN dims and strides of `uid` for the row-major JAX array of `spec.shape(uid)`."""
    b, t, s, n, k, h, hv = spec.b, spec.t, spec.s, spec.n, spec.k, spec.h, spec.hv

    def bthd(rows: int, heads: int, dim: int) -> tuple[list[int], list[int]]:
        return [b, heads, rows, dim], [rows * heads * dim, dim, heads * dim, 1]

    if spec.modifier is not None and uid >= MODIFIER_ARG_UID:
        dims = list(spec.modifier.arg_dims[uid - MODIFIER_ARG_UID])
        return dims, [int(np.prod(dims[i + 1 :], dtype=np.int64)) for i in range(4)]
    if spec.pages and uid in (Uid.K, Uid.V):
        num_pages, page_size, _ = spec.pages
        dim = h if uid == Uid.K else hv
        return [num_pages, k, page_size, dim], [page_size * k * dim, dim, k * dim, 1]
    if uid in (Uid.Q, Uid.DQ):
        return bthd(t, n, h)
    if uid in (Uid.K, Uid.DK):
        return bthd(s, k, h)
    if uid in (Uid.V, Uid.DV):
        return bthd(s, k, hv)
    if uid in (Uid.O, Uid.DO):
        return bthd(t, n, hv)
    if uid in (Uid.SCORE_MAX, Uid.SUM_EXP):
        return [b, n, t, 1], [n * t, t, 1, 1]
    if uid == Uid.STATS:
        if spec.ragged_stats:  # token-major [Tq, N]: one row of N per query token
            return [b, n, t, 1], [n * t, 1, n, 1]
        return [b, n, t, 1], [n * t, t, 1, 1]
    if uid in (Uid.BIAS, Uid.DBIAS):
        return [spec.bias_b, spec.bias_n, t, s], [spec.bias_n * t * s, t * s, s, 1]
    if uid in (Uid.SEQ_Q, Uid.SEQ_KV):
        return [b, 1, 1, 1], [1, 1, 1, 1]
    if uid in (Uid.SEED, Uid.OFFSET) or uid in FP8_SCALES or uid in FP8_AMAXES:
        return [1, 1, 1, 1], [1, 1, 1, 1]
    if uid == Uid.SINK:
        return [1, n, 1, 1], [n, 1, 1, 1]
    if uid in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS):
        return [b + 1, 1, 1, 1], [1, 1, 1, 1]
    if uid in (Uid.PT_K, Uid.PT_V):
        pages_per_seq = spec.pages[2]
        return [b, 1, pages_per_seq, 1], [pages_per_seq, pages_per_seq, 1, 1]
    raise ValueError(f"no layout for uid {uid!r}")


def backend_plan_indices(engine_ids: Sequence[int], is_backend: Any) -> list[int]:
    """Indices, in heuristic order, of the plans served by the cuDNN backend (never a Python engine, whose blob C++
    cannot read).

    Raises:
        NotImplementedError: when every plan is a Python engine.
    """
    indices = [i for i, engine_id in enumerate(engine_ids) if engine_id == -1 or is_backend(engine_id)]
    if not indices:
        raise NotImplementedError(
            f"cudnn: only Python-engine plans (engine ids {list(engine_ids)}) serve this graph; their serialized form "
            "cannot be executed by attnlib's C++ extension."
        )
    return indices


def check_blob(blob: bytes) -> None:
    """Reject a blob the C++ executor cannot load."""
    if blob.startswith(PYPLAN_MAGIC):
        raise NotImplementedError(
            "cudnn: the cuDNN frontend serialized a Python-engine plan (CUDNN_FE_PYPLAN), which attnlib's C++ "
            "extension cannot execute."
        )


@functools.cache
def _handle() -> Any:
    import cudnn

    return cudnn.create_handle()


def _data_type(cudnn: Any, name: str) -> Any:
    return {
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
        "float32": cudnn.data_type.FLOAT,
        "int32": cudnn.data_type.INT32,
        "int64": cudnn.data_type.INT64,
        "float8_e4m3fn": cudnn.data_type.FP8_E4M3,
    }[name]


def graph_data_type(uid: Uid, spec: GraphSpec) -> str:
    """The cuDNN data type name of `uid` (ragged offsets are INT64 bound to int32 pairs)."""
    if uid in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS):
        return "int64"
    if spec.modifier is not None and uid >= MODIFIER_ARG_UID:
        return "float32"
    if spec.ragged:
        return spec.shape(uid, (1, 1))[1]
    return spec.shape(uid)[1]


def _modifier_callbacks(modifier: ScoreModifier, args: list[Any]) -> tuple[Any, Any]:
    """cuDNN's `score_mod(graph, score)` and `score_mod_bprop(graph, d_score)` for `modifier`. Inside a backward
    graph cuDNN calls the first (recomputing the forward) before the second, which may read the forward's tensors
    through `store` (`score_mod_lowering.emit_backward`)."""
    import cudnn

    from . import score_mod_lowering as lowering

    store: dict[Any, Any] = {}

    class Indices:
        """batch, head, query row, key column of the callback's score tensor, each created on first use (an unused
        gen_index would be a dangling node, which cuDNN's fused attention does not build)."""

        def __init__(self, graph: Any, like: Any):
            self.graph, self.like, self.made = graph, like, {}

        def __getitem__(self, axis: int) -> Any:
            if axis not in self.made:
                index = self.graph.gen_index(input=self.like, axis=axis)
                index.set_data_type(cudnn.data_type.INT32)
                self.made[axis] = index
            return self.made[axis]

        def __len__(self) -> int:
            return 4

    def indices(graph: Any, like: Any) -> Any:
        return lambda: Indices(graph, like)

    def forward(graph: Any, score: Any) -> Any:
        ops = lowering.CudnnOps(graph)
        return lowering.emit_forward(ops, modifier.jaxpr, score, indices(graph, score), args, store)

    def backward(graph: Any, d_score: Any) -> Any:
        ops = lowering.CudnnOps(graph)
        return lowering.emit_backward(ops, modifier.jaxpr, d_score, indices(graph, d_score), args, store)

    return forward, backward


def _define(spec: GraphSpec) -> Any:
    """The pygraph of `spec` with its execution plans created (heuristics A, then the fallback list)."""
    import cudnn

    io = _data_type(cudnn, "float8_e4m3fn" if spec.fp8 else spec.dtype)
    graph = cudnn.pygraph(
        name=f"attnlib_{spec.direction}",
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(),
    )
    tensors = {}
    uids = spec.in_uids()
    # Offsets first: the packed tensors refer to them.
    for uid in sorted(uids, key=lambda u: u not in RAGGED_OFFSETS.values()):
        dim, stride = _layout(uid, spec)
        extra = {}
        if _ragged_offset(uid, spec) is not None:
            extra["ragged_offset"] = tensors[_ragged_offset(uid, spec)]
        tensors[uid] = graph.tensor(
            dim=dim, stride=stride, data_type=_data_type(cudnn, graph_data_type(uid, spec)), uid=int(uid),
            name=getattr(uid, "name", f"ARG{int(uid)}"), **extra,
        )

    options: dict[str, Any] = {"attn_scale": float(spec.scale)}
    if spec.left_bound is not None or spec.right_bound is not None:
        alignment = cudnn.diagonal_alignment
        bottom_right = spec.alignment == "bottom_right"
        options["diagonal_alignment"] = alignment.BOTTOM_RIGHT if bottom_right else alignment.TOP_LEFT
        if spec.left_bound is not None:
            options["diagonal_band_left_bound"] = int(spec.left_bound)
        if spec.right_bound is not None:
            options["diagonal_band_right_bound"] = int(spec.right_bound)
    if spec.padding:
        options.update(use_padding_mask=True, seq_len_q=tensors[Uid.SEQ_Q], seq_len_kv=tensors[Uid.SEQ_KV])
    if spec.bias_b:
        options["bias"] = tensors[Uid.BIAS]
    if spec.dropout > 0:
        options["dropout"] = (float(spec.dropout), tensors[Uid.SEED], tensors[Uid.OFFSET])
    if spec.sinks:
        options["sink_token"] = tensors[Uid.SINK]
    if spec.pages:
        options.update(
            paged_attention_k_table=tensors[Uid.PT_K],
            paged_attention_v_table=tensors[Uid.PT_V],
            paged_attention_max_seq_len_kv=int(spec.s),
        )
    if spec.ragged and spec.direction == "bwd" and spec.t_total:
        options.update(max_total_seq_len_q=int(spec.t_total), max_total_seq_len_kv=int(spec.s_total))
    if spec.modifier is not None:
        arg_tensors = [tensors[u] for u in spec.in_uids() if u >= MODIFIER_ARG_UID]
        forward, backward = _modifier_callbacks(spec.modifier, arg_tensors)
        options["score_mod"] = forward
        if spec.direction == "bwd":
            options["score_mod_bprop"] = backward

    def set_output(t: Any, uid: Uid) -> None:
        dim, stride = _layout(uid, spec)
        t.set_output(True).set_dim(dim).set_stride(stride).set_uid(int(uid)).set_data_type(
            _data_type(cudnn, graph_data_type(uid, spec))
        )
        if _ragged_offset(uid, spec) is not None:
            t.set_ragged_offset(tensors[_ragged_offset(uid, spec)])

    if spec.direction == "fwd" and spec.fp8:
        scales = [tensors[u] for u in FP8_SCALES]
        for band in ("left", "right"):  # sdpa_fp8 names the diagonal band bounds without the prefix
            if f"diagonal_band_{band}_bound" in options:
                options[f"{band}_bound"] = options.pop(f"diagonal_band_{band}_bound")
        o, stats, amax_s, amax_o = graph.sdpa_fp8(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], *scales, generate_stats=spec.stats, name="sdpa_fp8",
            **options,
        )
        set_output(o, Uid.O)
        if spec.stats:
            set_output(stats, Uid.STATS)
        set_output(amax_s, Uid.AMAX_S)
        set_output(amax_o, Uid.AMAX_O)
    elif spec.direction == "fwd":
        row_max = {}
        if spec.row_max:
            for uid, option in ((Uid.SCORE_MAX, "score_max"), (Uid.SUM_EXP, "score_sum_exp")):
                dim, stride = _layout(uid, spec)
                row_max[uid] = options[option] = graph.tensor(
                    dim=dim, stride=stride, data_type=cudnn.data_type.FLOAT, uid=int(uid), name=uid.name
                )
        o, stats = graph.sdpa(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], generate_stats=spec.stats and not spec.row_max,
            name="sdpa", **options,
        )
        set_output(o, Uid.O)
        for uid, tensor in row_max.items():
            set_output(tensor, uid)
        if spec.stats and not spec.row_max:
            set_output(stats, Uid.STATS)
    else:
        if spec.bias_b and spec.bias_grad:
            dim, stride = _layout(Uid.DBIAS, spec)
            options["dBias"] = graph.tensor(dim=dim, stride=stride, data_type=io, uid=int(Uid.DBIAS), name="DBIAS")
        dq, dk, dv = graph.sdpa_backward(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], tensors[Uid.O], tensors[Uid.DO], tensors[Uid.STATS],
            use_deterministic_algorithm=spec.deterministic, name="sdpa_backward", **options,
        )
        set_output(dq, Uid.DQ)
        set_output(dk, Uid.DK)
        set_output(dv, Uid.DV)
        if spec.bias_b and spec.bias_grad:
            set_output(options["dBias"], Uid.DBIAS)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return graph


@dataclasses.dataclass(frozen=True)
class _BuiltPlan:
    index: int
    name: str
    blob: bytes
    workspace: int


def _finish(graph: Any, index: int) -> _BuiltPlan:
    """Build the plan at `index` of `graph` and serialize it (canonical bytes)."""
    graph.select_plan(index)
    graph.check_support()
    graph.build_plans()
    if graph.selected_engine is not None:
        raise NotImplementedError(
            f"cudnn: the frontend selected Python engine {graph.selected_engine.name!r}, which attnlib's C++ "
            "extension cannot execute."
        )
    workspace = int(graph.get_workspace_size())
    blob = bytes(graph.serialize(as_bytes=True))
    check_blob(blob)
    try:
        name = str(graph.get_plan_name_at_index(index))
    except Exception:  # a name is only for the record
        name = f"plan {index}"
    return _BuiltPlan(index, name, ffi.extension().canonicalize_graph(blob), workspace)


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


def _build_candidates(spec: GraphSpec, graph: Any, candidates: list[int], wanted: int) -> list[_BuiltPlan]:
    """The first `wanted` candidate plans that build, in heuristic order (plans cuDNN cannot build, e.g. a runtime
    compilation failure, are skipped as the frontend's own walk would).

    Raises:
        NotImplementedError: when none builds (with the first plan's error).
    """
    built: list[_BuiltPlan] = []
    errors: list[str] = []
    for index in candidates:
        if len(built) >= wanted:
            break
        try:
            built.append(_finish(graph, index))
            continue
        except Exception:  # the frontend may refuse to re-plan this graph object: retry the plan on a fresh one
            graph = _define(spec)
        try:
            built.append(_finish(graph, index))
        except Exception as e:
            errors.append(f"plan {index}: {e}")
            logger.info("attnlib: cuDNN plan %d of %s did not build (%s).", index, spec.label, e)
            graph = _define(spec)
    if not built:
        raise NotImplementedError("; ".join(errors) or "cuDNN offered no plan")
    return built


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


def build(spec: GraphSpec) -> GraphEntry:
    """Build, finalize and serialize the graph of `spec` on this process's GPU (autotuning its plan, see the module
    docstring).

    Raises:
        NotImplementedError: when cuDNN rejects the graph (with its message).
    """
    support.device()  # initializes JAX's CUDA backend first, so the frontend binds the libcudnn JAX loaded
    import cudnn
    import cudnn.engines

    try:
        graph = _define(spec)
        candidates = backend_plan_indices([p.engine_id for p in graph.plans], cudnn.engines.is_backend_engine)
        built = _build_candidates(spec, graph, candidates, _candidates_wanted(spec))
        if not autotune_enabled():
            chosen, record = built[0], f"{built[0].name} (heuristics' first)"
        elif len(built) == 1:
            chosen, record = built[0], f"{built[0].name} (the only backend plan that builds)"
        else:
            chosen, record = _choose(spec, built)
    except (cudnn.cudnnGraphNotSupportedError, RuntimeError, ValueError, NotImplementedError) as e:
        raise GraphRejected(f"cudnn: cuDNN rejected the {spec.direction} graph ({spec.label}): {e}") from e
    entry = GraphEntry(
        blob=chosen.blob,
        workspace_bytes=chosen.workspace,
        in_uids=tuple(int(u) for u in spec.in_uids()),
        out_uids=tuple(int(u) for u in spec.out_uids()),
        zero_fill=spec.zero_fill(),
        label=spec.label,
        plan=record,
    )
    return entry


def _frontend_package_version() -> str:
    """The installed nvidia-cudnn-frontend version ("absent" on a pure-JAX install, where no graph is ever built)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def cache_key(spec: GraphSpec, device: "support.Device") -> dict[str, Any]:
    """Everything the serialized graph depends on."""

    described = dataclasses.asdict(dataclasses.replace(spec, modifier=None))
    described["modifier"] = None if spec.modifier is None else spec.modifier.key
    return {
        "format": 4,
        "spec": described,
        "plan_selection": {"all": "autotuned_all"}.get(autotune_mode(), autotune_mode()),
        "cudnn": device.cudnn_version,
        "cudnn_frontend": _frontend_package_version(),
        "compute_capability": list(device.compute_capability),
        "gpu": device.name,
    }
