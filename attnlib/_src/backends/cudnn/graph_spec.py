"""What determines one cuDNN SDPA graph: `GraphSpec`, the tensor UIDs `Uid`, and each tensor's shape, layout and type.

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
"""

import dataclasses
import enum
from typing import Literal

import numpy as np

from .modifier import ScoreModifier


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
    ATTN_SCALE = 34


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
        scale: the logit scale (baked into the graph), or None: a runtime scale, the float32 `[1]` input
            `Uid.ATTN_SCALE` (one graph for every value of a traced or learned `scale`).
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
    scale: float | None
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

    def __post_init__(self) -> None:
        if self.fp8 and self.dropout > 0:
            # validation.py refuses the combination first; this keeps the graph builder from ever emitting it.
            raise NotImplementedError(
                "cudnn: an FP8 graph with dropout is not supported (cuDNN's sdpa_fp8 with dropout faulted with an "
                f"illegal memory access on an H200, cuDNN 9.19 and 9.27). Got dropout={self.dropout}."
            )

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
        if self.scale is None:
            uids.append(Uid.ATTN_SCALE)
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
            Uid.ATTN_SCALE: ((1,), "float32"),
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
    if uid in (Uid.SEED, Uid.OFFSET, Uid.ATTN_SCALE) or uid in FP8_SCALES or uid in FP8_AMAXES:
        return [1, 1, 1, 1], [1, 1, 1, 1]
    if uid == Uid.SINK:
        return [1, n, 1, 1], [n, 1, 1, 1]
    if uid in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS):
        return [b + 1, 1, 1, 1], [1, 1, 1, 1]
    if uid in (Uid.PT_K, Uid.PT_V):
        pages_per_seq = spec.pages[2]
        return [b, 1, pages_per_seq, 1], [pages_per_seq, pages_per_seq, 1, 1]
    raise ValueError(f"no layout for uid {uid!r}")


def graph_data_type(uid: Uid, spec: GraphSpec) -> str:
    """The cuDNN data type name of `uid` (ragged offsets are INT64 bound to int32 pairs)."""
    if uid in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS):
        return "int64"
    if spec.modifier is not None and uid >= MODIFIER_ARG_UID:
        return "float32"
    if spec.ragged:
        return spec.shape(uid, (1, 1))[1]
    return spec.shape(uid)[1]
