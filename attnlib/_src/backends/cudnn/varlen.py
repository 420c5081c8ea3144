"""cuDNN attention for THD (`cu_seqlens_*`) and packed rows (`*_segment_ids`); paged caches are `paged.py`'s.

THD and packed rows run cuDNN's ragged graphs (`ragged.py` builds the sequence metadata on device): forward and
backward, with graph dims bucketed so that changing lengths reuse a few graphs. Rows cuDNN does not own (past
`cu_seqlens_q[-1]`, segment id 0, rows that see no key, rows cuDNN leaves unwritten) are exactly 0 in the output and
the gradients and get `lse = -inf` (the sink logit with `sinks`). With a top-left diagonal the rows of a sequence that
see no key are a suffix (all of them when it has no key, else the rows past `kv_len + left`), so cuDNN gets query
lengths trimmed to the rows that see a key (`_graph_seq_q`). cuDNN leaves the rows outside every sequence unwritten;
one pass after the graph writes exactly the rows that are not a sequence's own (`row_fill.set_rows`, a Pallas kernel
that touches only those rows): 0, or NaN in the rows of a sequence that overflows the graph's bounds
(`RaggedPlan.overflow_possible`). No memset before the graph and no elementwise pass after it (measured on the
H200: `docs/performance.md`).

Sinks and the ragged backward: cuDNN needs 9.26 for a ragged backward with a sink token. attnlib does not need it:
the forward's Stats already include the sink in the softmax denominator, so a backward graph *without* the sink,
fed those Stats, recomputes exactly the probabilities of the forward (`p = exp(s - lse)`), and `dS = p (dP - D)` with
`D = rowsum(dO * O)` is the sink softmax's gradient because the sink carries no value. The sink's own gradient,
`-sum_i p_sink,i * rowsum(dO_i * O_i)`, is computed in JAX.

"""

import dataclasses
import functools
import logging
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from ... import canonical, dropout as dropout_lib, logs, varying
from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from .. import lse as lse_lib, scores
from ..base import Fallback
from . import executor, ragged, row_fill, support
from .executor import FfiExecutor, GraphExecutor
from .graphs import GraphSpec, Uid


# ---------------------------------------------------------------------------------------------------------------
# THD and packed rows


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """Static description of one ragged problem.

    Attributes:
        fwd, bwd: the graph specs (bucketed dims).
        tokens: packed `(Tq, Tkv)`.
        band: the graphs' built-in mask (`band.py`; the diagonal aligned per sequence).
        config: the call's configuration (for the reference that differentiates `lse`, and `unbounded`).
        rows_exact: statically, every query row cuDNN runs sees a key (a top-left diagonal with trimmed query
            lengths, or self-attention whose mask keeps the diagonal): dO needs no masking before the backward.
        overflow_possible: a sequence may exceed the graph's bounds (NaN rows in `lse` need a pass).
        unbounded: what computes the call, forward and backward, when the batch does not fit the graphs (`fits`
            of `_ragged_sdpa`): the implementation dispatch passes as `unbounded` (`base.Context`).
        executor: what builds and runs the graphs (`GraphExecutor`).
    """

    fwd: GraphSpec
    bwd: GraphSpec
    tokens: tuple[int, int]
    band: Band
    config: AttentionConfig
    rows_exact: bool = False
    overflow_possible: bool = True
    unbounded: Fallback | None = None
    executor: GraphExecutor = FfiExecutor()


RaggedStats = Literal["auto", "per_token", "padded"]
"""Where ragged graphs keep their softmax statistics (`attnlib.Cudnn(ragged_stats=...)`): per query token
(`[Tq, N]`), padded per sequence (`[b, N, t]`), or `"auto"`: by `_ragged_stats`'s rule."""


@dataclasses.dataclass(frozen=True)
class Options:
    """How ragged calls run (`attnlib.Cudnn`'s fields): `ragged_stats` (`RaggedStats`) and the `executor` that builds
    and runs the graphs."""

    executor: GraphExecutor = FfiExecutor()
    ragged_stats: RaggedStats = "auto"


def _offsets(spec: GraphSpec, batch: ragged.RaggedBatch) -> dict[Uid, jax.Array]:
    offsets = {
        Uid.OFF_Q: ragged.element_offsets(batch.off_q, spec.n, spec.h),
        Uid.OFF_K: ragged.element_offsets(batch.off_kv, spec.k, spec.h),
        Uid.OFF_V: ragged.element_offsets(batch.off_kv, spec.k, spec.hv),
        Uid.OFF_O: ragged.element_offsets(batch.off_q, spec.n, spec.hv),
    }
    if spec.ragged_stats:
        offsets[Uid.OFF_STATS] = ragged.element_offsets(batch.off_q, spec.n, 1)
    return offsets


def _graph_seq_q(plan: RaggedPlan, batch: ragged.RaggedBatch) -> jax.Array:
    """The query rows cuDNN runs per sequence: with a top-left diagonal, only the leading rows that see a key."""
    if plan.band.bottom_right:
        return batch.seq_q
    return ragged.rows_seeing_keys(batch.seq_q, batch.seq_kv, plan.band.left)


def _seeds(seeds: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    return (None, None) if seeds is None else (seeds[0:1], seeds[1:2])


def _token_rows(plan: RaggedPlan, batch: ragged.RaggedBatch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows valid `[Bc, t]`, query tokens valid `[Tq]`, flat index of each token's stats row)."""
    t = plan.fwd.t
    valid_rows = plan.band.rows_valid(batch.seq_q, batch.seq_kv, t)
    seq = jnp.clip(batch.tok_seq, 0, plan.fwd.b - 1)
    pos = jnp.clip(batch.tok_pos, 0, t - 1)
    inside = (batch.tok_seq >= 0) & (batch.tok_pos >= 0) & (batch.tok_pos < t)
    tok_valid = inside & valid_rows[seq, pos] & ~batch.q_nan
    return valid_rows, tok_valid, seq * t + pos


def _empty_lse(shape: tuple[int, ...], sinks: jax.Array | None) -> jax.Array:
    if sinks is None:
        return jnp.full(shape, -jnp.inf, jnp.float32)
    return jnp.broadcast_to(sinks.astype(jnp.float32), shape)


def _ragged_forward(plan: RaggedPlan, q, k, v, sinks, seeds, batch):
    spec = plan.fwd
    seed, offset = _seeds(seeds)
    values = {
        Uid.Q: q, Uid.K: k, Uid.V: v, Uid.SEQ_Q: _graph_seq_q(plan, batch), Uid.SEQ_KV: batch.seq_kv, Uid.SEED: seed,
        Uid.OFFSET: offset, Uid.SINK: sinks, **_offsets(spec, batch),
    }  # fmt: skip
    out, stats = executor.run(spec, values, plan.tokens, plan.executor)
    valid_rows, tok_valid, index = _token_rows(plan, batch)
    out = row_fill.set_rows(out, ~tok_valid, batch.q_nan)
    empty = _empty_lse((plan.tokens[0], spec.n), sinks)
    # Rows that see no key (or that cuDNN does not write): finite stats make the backward's probabilities exactly
    # zero there.
    if spec.ragged_stats:  # [Tq, N], one row per query token
        stats = jnp.where(tok_valid[:, None], stats, 0.0)
        lse = jnp.where(tok_valid[:, None], stats, empty)
    else:
        stats = jnp.where(valid_rows[:, None, :], stats, 0.0)
        flat = jnp.reshape(jnp.transpose(stats, (0, 2, 1)), (-1, spec.n))  # [Bc * t, N]
        lse = jnp.where(tok_valid[:, None], jnp.take(flat, index, axis=0), empty)
    return out, _nan_rows(lse, batch.q_nan, plan), stats, tok_valid


def _ragged_stats(b: int, t: int, query_tokens: int) -> bool:
    """Whether ragged graphs keep their softmax statistics per query token (`[Tq, N]`, `GraphSpec.ragged_stats`)
    rather than padded (`[b, N, t]`, whose size grows with the sequence bound): per token when the padded rows
    `b * t` exceed 4x the query tokens (the measurements behind the rule: docs/performance.md, ragged section)."""
    return b * t > 4 * max(query_tokens, 1)


def _nan_rows(x: jax.Array, rows: jax.Array, plan: RaggedPlan) -> jax.Array:
    """`x` with rows `rows` NaN (overflowing sequences), for the small results `row_fill` does not cover."""
    if not plan.overflow_possible:
        return x
    shape = (rows.shape[0],) + (1,) * (x.ndim - 1)
    return jnp.where(jnp.reshape(rows, shape), jnp.full((), jnp.nan, x.dtype), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_sdpa(plan: RaggedPlan, q, k, v, sinks, seeds, batch, reference, fits=None):
    """`(out, lse)` of the ragged graphs. `fits`: None, or a bool scalar that is False when the batch does not fit
    the graphs (`_packed_rows`): `plan.unbounded` then computes the call instead, forward and backward."""
    out, lse, _, _ = _guarded_forward(plan, q, k, v, sinks, seeds, batch, reference, fits)
    return out, lse


def _unpacked(config: AttentionConfig, q, k, v, sinks, reference: dict[str, Any]) -> AttentionInputs:
    """The call's inputs from the packed `[Tq, N, H]` arrays (in the caller's layout) and its `reference` arrays."""
    shape = lambda x, n: x if config.layout == "thd" else jnp.reshape(x, config.batch_shape + (n,) + x.shape[1:])
    return AttentionInputs(
        query=shape(q, config.q_len), key=shape(k, config.kv_len), value=shape(v, config.kv_len), sinks=sinks,
        **reference,
    )  # fmt: skip


def _plain(plan: RaggedPlan, q, k, v, sinks, reference: dict[str, Any]):
    """`(out, lse)` packed like the graphs' (`[Tq, N, Hv]`, `[Tq, N]`) computed by `plan.unbounded` (the fallback
    of `fits`)."""
    assert plan.unbounded is not None
    out, lse = plan.unbounded(plan.config, _unpacked(plan.config, q, k, v, sinks, reference))
    return jnp.reshape(out, (-1,) + out.shape[-2:]).astype(q.dtype), jnp.reshape(lse, (-1, plan.fwd.n))


def _lse_reference(plan: RaggedPlan, q, k, v, sinks, reference: dict[str, Any]) -> jax.Array:
    """float32 lse `[Tq, N]` in plain JAX (used only for gradients flowing into lse); it does not depend on dropout."""
    config = dataclasses.replace(plan.config, dropout_rate=0.0)
    reference = {name: x for name, x in reference.items() if name != "dropout_key"}
    problem = canonical.canonicalize(config, _unpacked(config, q, k, v, sinks, reference))
    visible = scores.visible(config, problem, 0, problem.key.shape[1], None)[:, 0, 0]  # [B, T, S]
    lse = lse_lib.logsumexp(problem.query, problem.key, visible, scale=config.scale, sinks=problem.sinks)
    return jnp.reshape(lse, (-1, plan.fwd.n))


def _guarded_forward(plan: RaggedPlan, q, k, v, sinks, seeds, batch, reference, fits):
    """`_ragged_forward`, or with `fits` False the fallback's `(out, lse)` and placeholder residuals."""
    if fits is None:
        return _ragged_forward(plan, q, k, v, sinks, seeds, batch)

    def fused(q, k, v, sinks, seeds, batch, reference):
        return _ragged_forward(plan, q, k, v, sinks, seeds, batch)

    shapes = jax.eval_shape(fused, q, k, v, sinks, seeds, batch, reference)

    def fallback(q, k, v, sinks, seeds, batch, reference):
        out, lse = _plain(plan, q, k, v, sinks, reference)
        return out, lse, jnp.zeros(shapes[2].shape, shapes[2].dtype), jnp.zeros(shapes[3].shape, shapes[3].dtype)

    return _flat_cond(fits, fused, fallback, q, k, v, sinks, seeds, batch, reference)


def _flat_cond(fits: jax.Array, fused, fallback, *operands):
    """`jax.lax.cond(fits, fused, fallback, *operands)` with every array crossing the cond as one dimension.

    XLA gives each branch of a conditional its own operands, laid out as that branch wants: the plain fallback's dots
    want heads-major Q, K and V, and passed as they are, they were transposed before the conditional on every call,
    whichever branch ran (docs/performance.md, packed rows without a bound). A 1-D array has one layout; the barrier
    keeps XLA from moving the reshapes back out of the branches, so only the fallback pays for its layouts."""
    leaves, tree = jax.tree.flatten(operands)
    shapes = [jnp.shape(x) for x in leaves]
    results, results_tree = jax.tree.flatten(jax.eval_shape(fused, *operands))

    def flat(fn):
        def branch(*flat_leaves):
            flat_leaves = jax.lax.optimization_barrier(flat_leaves)  # keeps XLA from moving the reshapes out
            args = jax.tree.unflatten(tree, [jnp.reshape(x, shape) for x, shape in zip(flat_leaves, shapes)])
            return [jnp.reshape(y, (-1,)) for y in jax.tree.leaves(fn(*args))]

        return branch

    flat_results = jax.lax.cond(fits, flat(fused), flat(fallback), *(jnp.reshape(x, (-1,)) for x in leaves))
    return jax.tree.unflatten(results_tree, [jnp.reshape(y, r.shape) for y, r in zip(flat_results, results)])


def _ragged_sdpa_fwd(plan: RaggedPlan, q, k, v, sinks, seeds, batch, reference, fits=None):
    q, k, v, sinks, seeds, batch, reference, fits = executor.primal_values(
        (q, k, v, sinks, seeds, batch, reference, fits)
    )
    # The residuals are the results themselves (one buffer): cuDNN's backward never reads the rows of a sequence
    # that does not run, and the sink gradient masks them.
    out, lse, stats, tok_valid = _guarded_forward(plan, q, k, v, sinks, seeds, batch, reference, fits)
    residuals = (q, k, v, sinks, seeds, batch, reference, fits, out, lse, stats, tok_valid)
    return (out, lse), residuals


def _ragged_sdpa_bwd(plan: RaggedPlan, residuals, cotangents):
    q, k, v, sinks, seeds, batch, reference, fits, out, lse, stats, tok_valid = residuals
    none = lambda tree: jax.tree.map(lambda _: None, tree)  # noqa: E731
    graph_residuals = (q, k, v, sinks, seeds, batch, reference, out, lse, stats, tok_valid)
    if fits is None:
        dq, dk, dv, dsinks = _ragged_grads(plan, graph_residuals, cotangents)
    else:
        # Symbolic zeros stay out of the cond's operands (they are not arrays) and are put back in each branch.
        symbolic = tuple(isinstance(c, jax.custom_derivatives.SymbolicZero) for c in cotangents)
        arrays = tuple(None if zero else c for c, zero in zip(cotangents, symbolic))
        restore = lambda given: tuple(c if zero else g for c, g, zero in zip(cotangents, given, symbolic))  # noqa: E731

        def fused(graph_residuals, given):
            return _ragged_grads(plan, graph_residuals, restore(given))

        def fallback(graph_residuals, given):
            q, k, v, sinks, _, _, reference = graph_residuals[:7]
            return _plain_grads(plan, q, k, v, sinks, reference, restore(given))

        dq, dk, dv, dsinks = _flat_cond(fits, fused, fallback, graph_residuals, arrays)
    return dq, dk, dv, dsinks, none(seeds), none(batch), none(reference), none(fits)


def _plain_grads(plan: RaggedPlan, q, k, v, sinks, reference, cotangents):
    """Gradients of `_plain` (the fallback of `fits`), recomputing its forward."""
    d_out, d_lse = cotangents
    (out, lse), vjp = jax.vjp(lambda q, k, v, sinks: _plain(plan, q, k, v, sinks, reference), q, k, v, sinks)
    zero = lambda d, x: jnp.zeros(x.shape, x.dtype) if isinstance(d, jax.custom_derivatives.SymbolicZero) else d  # noqa: E731
    return vjp((zero(d_out, out).astype(out.dtype), zero(d_lse, lse).astype(lse.dtype)))


def _ragged_grads(plan: RaggedPlan, residuals, cotangents):
    """`(dq, dk, dv, dsinks)` of the ragged graphs."""
    q, k, v, sinks, seeds, batch, reference, out, lse, stats, tok_valid = residuals
    d_out, d_lse = cotangents
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    d_out = d_out.astype(out.dtype)
    if not plan.rows_exact:
        d_out = jnp.where(tok_valid[:, None, None], d_out, jnp.zeros((), out.dtype))
    spec = plan.bwd
    seed, offset = _seeds(seeds)
    values = {
        Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.DO: d_out, Uid.STATS: stats, Uid.SEQ_Q: _graph_seq_q(plan, batch),
        Uid.SEQ_KV: batch.seq_kv, Uid.SEED: seed, Uid.OFFSET: offset, Uid.SINK: sinks, **_offsets(spec, batch),
    }  # fmt: skip
    dq, dk, dv = executor.run(spec, values, plan.tokens, plan.executor)[:3]
    # Overflowing rows become NaN here already (NaN + anything added below stays NaN).
    kv_zero = ~batch.kv_in
    dq, dk, dv = row_fill.set_rows_many([(dq, ~tok_valid, batch.q_nan), (dk, kv_zero, batch.kv_nan),
                                         (dv, kv_zero, batch.kv_nan)])  # fmt: skip
    dsinks = None
    if sinks is not None:
        row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [Tq, N]
        row = jnp.where(tok_valid[:, None], row, 0.0)  # overflowing rows hold NaN
        p_sink = jnp.where(tok_valid[:, None], jnp.exp(sinks.astype(jnp.float32)[None, :] - lse), 0.0)
        dsinks = -jnp.sum(row * p_sink, axis=0).astype(sinks.dtype)
    if not isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
        # Rows that see no key have lse = sink (with sinks): their cotangent reaches the sinks through the reference.
        d_lse = jnp.where(batch.q_nan[:, None], 0.0, d_lse.astype(jnp.float32))
        lse_reference, vjp = jax.vjp(lambda q, k, sinks: _lse_reference(plan, q, k, v, sinks, reference), q, k, sinks)
        extra = vjp(varying.match(d_lse, lse_reference))
        dq, dk = (g + e.astype(g.dtype) for g, e in zip((dq, dk), extra[:2]))
        if sinks is not None:
            dsinks = dsinks + extra[2].astype(dsinks.dtype)
    return dq, dk, dv, dsinks


_ragged_sdpa.defvjp(_ragged_sdpa_fwd, _ragged_sdpa_bwd, symbolic_zeros=True)


def make_ragged_plan(
    config: AttentionConfig,
    num_sequences: int,
    bounds: tuple[int, int],
    tokens: tuple[int, int],
    *,
    self_attention: bool = False,
    overflow_possible: bool = True,
    ragged_stats: RaggedStats = "auto",
    graph_executor: GraphExecutor = FfiExecutor(),
) -> RaggedPlan:
    """The bucketed graphs of a ragged problem with `num_sequences` sequences of at most `bounds` rows.

    Args:
        self_attention: every sequence has as many key rows as query rows (one `cu_seqlens`, or one set of segment
            ids without padding lengths).
        overflow_possible: a sequence may be longer than `bounds` (or a row have too many segments).
        ragged_stats: where the graphs keep their softmax statistics (`RaggedStats`).
        graph_executor: what builds and runs the graphs.
    """
    band = Band.of(config)
    left, right, bottom_right = band.left, band.right, band.bottom_right
    keeps_diagonal = (left is None or left >= 0) and (right is None or right >= 0)
    b, t = ragged.bucket_sequences(num_sequences), ragged.bucket_length(bounds[0])
    common = dict(
        dtype=np.dtype(config.dtype).name,
        b=b,
        t=t,
        s=ragged.bucket_length(bounds[1]),
        n=config.num_q_heads, k=config.num_kv_heads, h=config.head_dim, hv=config.value_head_dim,
        scale=float(config.scale),
        alignment="bottom_right" if bottom_right else "top_left",
        left_bound=None if left is None else left + 1,
        right_bound=right,
        padding=True,
        dropout=float(config.dropout_rate),
        ragged=True,
        ragged_stats=_ragged_stats(b, t, tokens[0]) if ragged_stats == "auto" else ragged_stats == "per_token",
    )  # fmt: skip
    fwd = GraphSpec(direction="fwd", sinks=config.has_sinks, **common)
    # No sink in the backward graph: the forward's stats carry it (see the module docstring).
    bwd = GraphSpec(
        direction="bwd", deterministic=config.deterministic_backward, t_total=ragged.bucket_tokens(tokens[0]),
        s_total=ragged.bucket_tokens(tokens[1]), **common,
    )  # fmt: skip
    rows_exact = keeps_diagonal and (self_attention or not bottom_right)
    return RaggedPlan(
        fwd, bwd, tokens, band, config, rows_exact=rows_exact, overflow_possible=overflow_possible,
        executor=graph_executor,
    )  # fmt: skip


_LARGE_STATS_BYTES = 1 << 30
"""Padded ragged statistics above this size are logged with a WARNING (they may not fit next to the model)."""


def _warn_large_stats(spec: GraphSpec, config: AttentionConfig) -> None:
    """Log once per graph shape when the padded `[b, N, t]` float32 statistics of a ragged forward are large."""
    size = spec.b * spec.n * spec.t * 4
    if spec.ragged_stats or size <= _LARGE_STATS_BYTES:
        return
    if config.layout != "thd":
        bound = "the packed rows' length T"
    elif config.max_seqlen_q in (None, config.q_len):
        bound = "the token count (max_seqlen_q's default)"
    else:
        bound = f"max_seqlen_q={config.max_seqlen_q}"
    logs.log_once(
        ("ragged stats", spec.b, spec.n, spec.t), logging.WARNING,
        "attnlib's cuDNN ragged attention keeps its softmax statistics as float32 [%d sequences, %d heads, %d rows] "
        "= %.2f GiB: the rows are %s rounded up to a power of two. A max_seqlen_q close to the longest sequence "
        "shrinks them.", spec.b, spec.n, spec.t, size / 2**30, bound,
    )  # fmt: skip


def _slice_right(config: AttentionConfig) -> int | None:
    right = support.effective_right(config)
    masked = right is not None or config.window is not None
    if config.diagonal_alignment == "bottom_right" and masked and right is not None and right <= 0:
        return right
    return None


def _ragged_attention(
    config: AttentionConfig,
    inputs: AttentionInputs,
    options: Options,
    fits: jax.Array | None = None,
    unbounded: Fallback | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` on the ragged graphs; `fits` and `unbounded` as `_ragged_sdpa`'s and `RaggedPlan`'s."""
    N, Hv = config.num_q_heads, config.value_head_dim
    dtype = inputs.query.dtype
    sinks = None if inputs.sinks is None else inputs.sinks.astype(jnp.float32)
    seeds = None
    if config.dropout_rate > 0:
        seeds = jax.lax.bitcast_convert_type(dropout_lib.dropout_seeds(inputs.dropout_key), jnp.int32)
    slice_right = _slice_right(config)
    if config.layout == "thd":
        q, k, v = inputs.query, inputs.key, inputs.value
        cu_q = inputs.cu_seqlens_q
        cu_kv = cu_q if inputs.cu_seqlens_kv is None else inputs.cu_seqlens_kv
        num = int(cu_q.shape[0]) - 1
        bounds = (config.max_seqlen_q or config.q_len, config.max_seqlen_kv or config.kv_len)
        reference = {"cu_seqlens_q": inputs.cu_seqlens_q, "cu_seqlens_kv": inputs.cu_seqlens_kv}
        out_shape = (config.q_len, N, Hv)
        lse_shape = (config.q_len, N)
        self_attention = inputs.cu_seqlens_kv is None
        bucketed = (ragged.bucket_length(bounds[0]), ragged.bucket_length(bounds[1]))
        overflow_possible = bucketed[0] < config.q_len or bucketed[1] < config.kv_len
    else:
        B, T, S = config.batch_size, config.q_len, config.kv_len
        q = jnp.reshape(inputs.query, (B * T, N, config.head_dim))
        k = jnp.reshape(inputs.key, (B * S, config.num_kv_heads, config.head_dim))
        v = jnp.reshape(inputs.value, (B * S, config.num_kv_heads, Hv))
        num = B * config.max_segments_per_row
        bounds = (T, S)
        reference = {
            "q_segment_ids": inputs.q_segment_ids, "kv_segment_ids": inputs.kv_segment_ids,
            "query_seq_lengths": inputs.query_seq_lengths, "key_value_seq_lengths": inputs.key_value_seq_lengths,
        }  # fmt: skip
        if fits is not None and config.dropout_rate > 0:
            reference["dropout_key"] = inputs.dropout_key  # the fallback drops with its own generator
        out_shape = config.batch_shape + (T, N, Hv)
        lse_shape = config.batch_shape + (T, N)
        self_attention = inputs.kv_segment_ids is None and not config.has_q_lengths and not config.has_kv_lengths
        overflow_possible = True  # a row may hold more than max_segments_per_row segments
    tokens = (int(q.shape[0]), int(k.shape[0]))
    if tokens[0] == 0 or tokens[1] == 0:
        return jnp.zeros(out_shape, dtype), _empty_lse(lse_shape, sinks)
    plan = make_ragged_plan(
        config, num, bounds, tokens, self_attention=self_attention, overflow_possible=overflow_possible,
        ragged_stats=options.ragged_stats, graph_executor=options.executor,
    )  # fmt: skip
    plan = dataclasses.replace(plan, unbounded=unbounded)
    _warn_large_stats(plan.fwd, config)
    if config.layout == "thd":
        batch = ragged.thd_batch(
            cu_q, cu_kv, tokens[0], tokens[1], num_buckets=plan.fwd.b, t_bound=plan.fwd.t, s_bound=plan.fwd.s,
            slice_right=slice_right,
        )  # fmt: skip
    else:
        batch = ragged.segment_batch(*_segment_ids(config, inputs), max_segments=config.max_segments_per_row,
                                     num_buckets=plan.fwd.b, t_bound=plan.fwd.t, s_bound=plan.fwd.s,
                                     slice_right=slice_right)  # fmt: skip
    q, k, v, sinks = varying.like_inputs((q, k, v, sinks), (q, k, v, sinks, seeds, batch))
    out, lse = _ragged_sdpa(plan, q, k, v, sinks, seeds, batch, reference, fits)
    return jnp.reshape(out.astype(dtype), out_shape), jnp.reshape(lse, lse_shape)


def _segment_ids(config: AttentionConfig, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
    """`[B, T]` / `[B, S]` segment ids combined with the padding lengths (as `positions.dense_positions` does)."""
    B, T, S = config.batch_size, config.q_len, config.kv_len
    flat = lambda x, n: jnp.reshape(x, (B, n)).astype(jnp.int32)
    q_ids = flat(inputs.q_segment_ids, T)
    kv_ids = q_ids if inputs.kv_segment_ids is None else flat(inputs.kv_segment_ids, S)
    if inputs.query_seq_lengths is not None:
        lengths = jnp.reshape(inputs.query_seq_lengths, (B,)).astype(jnp.int32)
        q_ids = jnp.where(jnp.arange(T, dtype=jnp.int32)[None, :] < lengths[:, None], q_ids, 0)
    if inputs.key_value_seq_lengths is not None:
        lengths = jnp.reshape(inputs.key_value_seq_lengths, (B,)).astype(jnp.int32)
        kv_ids = jnp.where(jnp.arange(S, dtype=jnp.int32)[None, :] < lengths[:, None], kv_ids, 0)
    return q_ids, kv_ids


DEFAULT_SEGMENTS_PER_ROW = 16
"""The bound on segments per packed row used under `jit` when the caller gives no `max_segments_per_row`; a step whose
rows hold more runs on `xla_chunked` instead (docs/performance.md: how it was chosen)."""


def _concrete(*arrays: jax.Array | None) -> bool:
    return all(x is None or not isinstance(x, jax.core.Tracer) for x in arrays)


def _packed_rows(
    config: AttentionConfig, inputs: AttentionInputs, options: Options, unbounded: Fallback | None
) -> tuple[jax.Array, jax.Array]:
    """Packed rows (segment ids) without `max_segments_per_row`: the bound is the rows' own count, rounded up to a
    power of two, when the ids are concrete; under `jit` it is `DEFAULT_SEGMENTS_PER_ROW`, checked on device, and
    a call whose rows hold more runs on `unbounded` (dispatch passes `xla_chunked`; a `lax.cond` inside the custom
    VJP, forward and backward, around the graph calls: the residuals are the graphs' own, with placeholders when the
    fallback ran). Without `unbounded` such a call gets NaN in those rows, as with a bound given."""
    T = config.q_len
    ids = (inputs.q_segment_ids, inputs.kv_segment_ids, inputs.query_seq_lengths, inputs.key_value_seq_lengths)
    if _concrete(*ids):
        with jax.ensure_compile_time_eval():  # concrete ids closed over by a jitted function count too
            most = max(int(jnp.max(ragged.runs_per_row(x), initial=1)) for x in _segment_ids(config, inputs))
        bound = min(1 << (most - 1).bit_length(), max(T, config.kv_len, 1))
        return _ragged_attention(dataclasses.replace(config, max_segments_per_row=bound), inputs, options)
    bound = min(DEFAULT_SEGMENTS_PER_ROW, max(T, config.kv_len, 1))
    if unbounded is None:
        return _ragged_attention(dataclasses.replace(config, max_segments_per_row=bound), inputs, options)
    logs.log_once(
        ("packed rows default bound", config.batch_shape, T, config.kv_len), logging.INFO,
        "attnlib cudnn: packed rows without max_segments_per_row under jit: cuDNN runs with a bound of %d segments "
        "per row; a step whose rows hold more runs on xla_chunked. Pass max_segments_per_row to set the bound.", bound,
    )  # fmt: skip
    q_ids, kv_ids = _segment_ids(config, inputs)
    fits = jnp.maximum(ragged.runs_per_row(q_ids).max(), ragged.runs_per_row(kv_ids).max()) <= bound
    return _ragged_attention(
        dataclasses.replace(config, max_segments_per_row=bound), inputs, options, fits, unbounded
    )


def attention(
    config: AttentionConfig, inputs: AttentionInputs, options: Options, *, unbounded: Fallback | None = None
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` for a THD or packed-row call (see the module docstring) as `options` say; `unbounded` as
    `_packed_rows`'s."""
    if config.layout == "dense" and config.max_segments_per_row is None:
        return _packed_rows(config, inputs, options, unbounded)
    return _ragged_attention(config, inputs, options)
