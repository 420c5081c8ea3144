"""cuDNN attention on dense `[*B, T, N, H]` inputs: the plan of graphs, the custom VJP, padding rows.

Layers, bottom up (the graph calls themselves are `executor.py`'s):
- `_sdpa`: forward graph + backward graph as a `jax.custom_vjp`, with padding rows zeroed.

Padding rows. cuDNN writes zeros in the rows past a sequence's length (O and dQ past `seq_len_q`, dK and dV past
`seq_len_kv`) but skips a batch element without keys, and with a top-left diagonal the rows of a sequence that see
no key are a suffix: every row when the sequence has no key, else the rows `i >= seq_len_kv + left` of a window
reaching `left` keys back. The graph gets query lengths trimmed to the rows that see a key, and a sequence without
keys gets one key and no query row, so the padding costs no pass over the output or the gradients and no memset
(`Plan.rows_by_length`, `support.writes_padding_zeros`; docs/performance.md, "How attnlib's choices were measured").
With a bottom-right diagonal the rows that see no key come first; those calls mask the output and the gradients in JAX.
- `attention(config, inputs)`: the dense entry point (flattening `*B`, slicing bottom-right `T > S`); THD and
  packed rows are `varlen.py`'s, paged caches `paged.py`'s.
"""

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ... import canonical, dropout as dropout_lib, fp8 as fp8_lib, logs, masks as masks_lib, varying
from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from .. import lse as lse_lib, lse_backward
from . import executor, graphs, modifier as modifier_lib, ragged, support
from .executor import FfiExecutor, GraphExecutor
from .graphs import GraphSpec, Uid


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of one cuDNN attention problem `[B, T, N, H]` (after flattening and slicing).

    Attributes:
        fwd, bwd: the graph specs.
        band: the graphs' built-in mask (`band.py`), bottom-right only where the alignment changes something; none
            with a score modifier (which holds the mask).
        all_rows_valid: statically, every query row sees at least one key (no masking of rows needed).
        rows_by_length: padded top-left graphs: the graphs get the trimmed query lengths of `_graph_seq_q` and
            zero-fill their results, so rows that see no key need no masking pass.
        inference: the forward graph without softmax stats, run when nothing differentiates the call and the caller
            wants no `lse` (as `jax.nn`'s cuDNN inference); None when the call has dropout or returns `lse`.
        detect_masked: rows may see no key for reasons only the data knows (a boolean `mask`, a modifier's masks):
            a row whose softmax statistic is below `masked_below` saw no key and is zeroed.
        masked_below: that threshold (`modifier.masked_below`).
        lse_backward: the backward runs in plain JAX from the forward's statistics (`lse_backward.gradients`)
            instead of `bwd`'s graph (`_short_query_backward`).
        executor: what builds and runs the graphs (`GraphExecutor`).
    """

    fwd: GraphSpec
    bwd: GraphSpec
    band: Band
    all_rows_valid: bool
    inference: GraphSpec | None = None
    detect_masked: bool = False
    masked_below: float = -1e29
    lse_backward: bool = False
    executor: GraphExecutor = FfiExecutor()

    @property
    def rows_by_length(self) -> bool:
        return self.fwd.rows_by_length


def _row_valid(plan: Plan, seq_q: jax.Array | None, seq_kv: jax.Array | None) -> jax.Array:
    """Bool `[B, T, 1]`: the query row exists and sees at least one key (by the lengths and built-in masks)."""
    spec = plan.fwd
    q_len = jnp.full((spec.b,), spec.t, jnp.int32) if seq_q is None else seq_q
    kv_len = jnp.full((spec.b,), spec.s, jnp.int32) if seq_kv is None else seq_kv
    valid = plan.band.rows_valid(q_len, kv_len, spec.t)
    return valid[:, :, None]


def _graph_seq_q(plan: Plan, seq_q: jax.Array | None, seq_kv: jax.Array | None) -> jax.Array | None:
    """The query lengths the graphs get: with `plan.rows_by_length`, trimmed to the rows that see a key."""
    if not plan.rows_by_length or seq_q is None or seq_kv is None:
        return seq_q
    return ragged.rows_seeing_keys(seq_q, seq_kv, plan.band.left)


def _graph_seq_kv(plan: Plan, seq_kv: jax.Array | None) -> jax.Array | None:
    """The key lengths the graphs get. Without the memset (`_memset_rows`), a sequence with no key gets one: cuDNN
    skips a batch element with `seq_len_kv = 0` without writing its output, but writes zeros in every row past
    `seq_len_q`, here all of them (the trimmed query length is 0, so no query reads that key)."""
    if not plan.rows_by_length or plan.fwd.memset_rows or seq_kv is None:
        return seq_kv
    return jnp.maximum(seq_kv, 1)


def _operands(spec: GraphSpec, values: dict[Uid, jax.Array | None]) -> list[jax.Array]:
    return [values[uid] for uid in spec.in_uids()]  # pyright: ignore[reportReturnType]


def _masked_lse(stats: jax.Array, valid: jax.Array | None, sinks: jax.Array | None) -> jax.Array:
    """`[B, N, T]` stats -> lse `[B, T, N]` with rows that see no key (`valid` `[B, T, 1|N]` False) set to the sink
    (or -inf)."""
    lse = jnp.transpose(stats, (0, 2, 1))
    if valid is None:
        return lse
    empty = jnp.full_like(lse, -jnp.inf) if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32), lse.shape)
    return jnp.where(valid, lse, empty)


def _head_major(valid: jax.Array) -> jax.Array:
    """`[B, T, 1|N]` -> `[B, 1|N, T]` (the stats layout)."""
    return jnp.swapaxes(valid, 1, 2)


def _arg_values(args: tuple[jax.Array, ...]) -> dict[int, jax.Array]:
    return {graphs.MODIFIER_ARG_UID + i: a for i, a in enumerate(args)}


@dataclasses.dataclass(frozen=True)
class Fp8Operands:
    """What an FP8 forward graph reads: float8_e4m3fn `[B, T|S, N|K, H]` query, key, value and the float32 `[1]`
    scales of `graphs.FP8_SCALES` (dequantization of q, k, v and the probabilities; quantization of the probabilities
    and the output)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scales: tuple[jax.Array, ...]

    @property
    def output_scale(self) -> jax.Array:
        return self.scales[-1]


jax.tree_util.register_dataclass(Fp8Operands, data_fields=["q", "k", "v", "scales"], meta_fields=[])


def _fp8_inputs(config: AttentionConfig, inputs: AttentionInputs, q, k, v, dtype) -> tuple[Any, Any, Any, Fp8Operands]:
    """`(q̂, k̂, v̂, operands)` of an `fp8=` call (`fp8.py`): the dequantized inputs in the 16-bit `dtype`, which the
    backward graph differentiates (straight through the rounding with `fp8="current"`), and the FP8 graph's operands."""
    dequantize, rounding = fp8_lib.plan(config.fp8, inputs.query, inputs.key, inputs.value, inputs.fp8_scales)
    stop = jax.lax.stop_gradient
    inputs16 = (q, k, v)
    q8, k8, v8 = (stop(dequantize.fp8_values(x, i)) for i, x in enumerate(inputs16))
    per_tensor = [jnp.reshape(stop(x), (1,)).astype(jnp.float32) for x in dequantize.scales]
    probability = jnp.full((1,), fp8_lib.PROBABILITY_SCALE, jnp.float32)
    scales = (*per_tensor, 1 / probability, probability, jnp.reshape(stop(rounding.output_scale), (1,)))
    q_hat, k_hat, v_hat = (dequantize(x, i, x8).astype(dtype) for i, (x, x8) in enumerate(zip(inputs16, (q8, k8, v8))))
    return q_hat, k_hat, v_hat, Fp8Operands(q8, k8, v8, scales)


def _forward(
    plan: Plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8: Fp8Operands | None = None,
    spec: GraphSpec | None = None, scale: jax.Array | None = None,
):
    """(out, stats or None, valid rows `[B, T, 1|N]` or None, row maxima `[B, N, T]` or None) of the forward graph
    `spec` (default `plan.fwd`). An FP8 graph reads `fp8` instead of `q`, `k`, `v`; its output is dequantized to
    `q`'s dtype. A `row_max` graph's stats are `score_max + log(score_sum_exp)`. `scale`: the float32 `[1]` runtime
    scale of a graph with `spec.scale` None."""
    spec = plan.fwd if spec is None else spec
    seed, offset = (None, None) if seeds is None else (seeds[0:1], seeds[1:2])
    values = {
        Uid.Q: q, Uid.K: k, Uid.V: v, Uid.BIAS: bias, Uid.SEQ_Q: _graph_seq_q(plan, seq_q, seq_kv),
        Uid.SEQ_KV: _graph_seq_kv(plan, seq_kv), Uid.SEED: seed, Uid.OFFSET: offset, Uid.SINK: sinks,
        Uid.ATTN_SCALE: scale, **_arg_values(args),
    }
    if spec.fp8:
        assert fp8 is not None
        values.update({Uid.Q: fp8.q, Uid.K: fp8.k, Uid.V: fp8.v, **dict(zip(graphs.FP8_SCALES, fp8.scales))})
    results = executor.graph_call(spec, plan.executor)(*_operands(spec, values))
    out, stats = (results[0], results[1]) if spec.stats else (results[0], None)
    row_max = None
    if spec.row_max:
        row_max, stats = results[1], results[1] + jnp.log(results[2])
    if spec.fp8:
        out = (out.astype(jnp.float32) / fp8.output_scale[0]).astype(q.dtype)  # pyright: ignore[reportOptionalMemberAccess]
    valid = None if plan.all_rows_valid else _row_valid(plan, seq_q, seq_kv)
    if plan.detect_masked:
        # A row whose every score was masked (about -1e30) has a statistic far below any real one.
        seen = jnp.transpose(stats, (0, 2, 1)) > plan.masked_below
        valid = seen if valid is None else valid & seen
        out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype))
    elif valid is not None:
        if not plan.rows_by_length or spec.fp8:
            out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype))
        if stats is not None:
            # Rows that see no key: finite stats make the backward's probabilities exactly zero there.
            stats = jnp.where(_head_major(valid), stats, 0.0)
    return out, stats, valid, row_max


def _visible(plan: Plan, seq_q: jax.Array | None, seq_kv: jax.Array | None) -> jax.Array:
    """Bool `[B, t, S]`: the keys each query row of the graphs sees by the lengths and the built-in band."""
    spec = plan.fwd
    i = jnp.arange(spec.t, dtype=jnp.int32)[None, :, None]  # int32 under `jax_enable_x64` too, as the lengths
    j = jnp.arange(spec.s, dtype=jnp.int32)[None, None, :]
    q_len = jnp.full((spec.b,), spec.t, jnp.int32) if seq_q is None else seq_q
    kv_len = jnp.full((spec.b,), spec.s, jnp.int32) if seq_kv is None else seq_kv
    diagonal = plan.band.diagonal(i, q_len[:, None, None], kv_len[:, None, None])
    return (i < q_len[:, None, None]) & (j < kv_len[:, None, None]) & plan.band.allows(j - diagonal)


def _lse_reference(plan: Plan, q, k, bias, sinks, seq_q, seq_kv, args, scale) -> jax.Array:
    """float32 lse `[B, T, N]` of the graphs' scores in plain JAX (used only for gradients flowing into lse)."""
    spec = plan.fwd
    score_mod = None
    if spec.modifier is not None:
        score_mod = functools.partial(modifier_lib.reference_scores, spec.modifier, args=args)
    return lse_lib.logsumexp(
        q, k, _visible(plan, seq_q, seq_kv), scale=_scale_value(spec, scale), bias=bias, sinks=sinks,
        score_mod=score_mod, masked_below=plan.masked_below if plan.detect_masked else None,
    )


def _scale_value(spec: GraphSpec, scale: jax.Array | None) -> Any:
    """The graph's logit scale: `spec.scale`, or the runtime float32 `[1]` `scale` as a 0-d array."""
    return spec.scale if spec.scale is not None else scale[0]


def _scale_gradient(q: jax.Array, dq: jax.Array, scale: jax.Array) -> jax.Array:
    """float32 `[1]` gradient of the graph's runtime scale from the query gradient: `s = scale * q k^T` gives
    `dq = scale * dS k`, so `d scale = sum dS * (q k^T) = <dq, q> / scale` (q enters only through `s`, whatever the
    score modifier, soft cap or bias after it). Undefined (NaN) at `scale == 0`, where `dq` is zero."""
    inner = jnp.sum(dq.astype(jnp.float32) * q.astype(jnp.float32))
    return jnp.reshape(jnp.where(scale[0] != 0, inner / scale[0], jnp.nan), (1,))


def _head_maxima(row_max: jax.Array | None, valid: jax.Array | None) -> jax.Array | None:
    """`[B, N, T]` score maxima -> the largest of each head `[B, N]`, over the rows that see a key (-inf when none
    does); None without a `row_max` graph. Reduced in the stats layout: no transpose."""
    if row_max is None:
        return None
    if valid is not None:
        row_max = jnp.where(_head_major(valid), row_max, -jnp.inf)
    return jnp.max(row_max, axis=-1, initial=-jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sdpa(plan: Plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale):
    """`(out, lse, per-head maxima `[B, N]` or None)`; the maxima are a statistic (no gradient flows from them).
    `scale`: the float32 `[1]` runtime scale of graphs with `GraphSpec.scale` None, else None."""
    if plan.inference is not None:
        out, _, _, _ = _forward(
            plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, spec=plan.inference, scale=scale
        )
        # The caller drops lse (return_residual=False); it only has to have lse's type.
        unused = jnp.full((plan.fwd.b, plan.fwd.t, plan.fwd.n), -jnp.inf, jnp.float32)
        return out, varying.vary_over(unused, varying.union_axes(out)), None
    out, stats, valid, row_max = _forward(plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale=scale)
    return out, _masked_lse(stats, valid, sinks), _head_maxima(row_max, valid)


def _sdpa_fwd(plan: Plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale):
    is_primal = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    if any(x.perturbed for x in jax.tree.leaves(args, is_leaf=is_primal) if is_primal(x)):
        raise NotImplementedError(
            "cudnn: gradients with respect to `score_mod_args` are not supported by the cuDNN implementation (its "
            "backward graph returns gradients for query, key, value, bias and sinks only); use "
            "implementation='xla_chunked' or 'xla', or wrap the arguments in jax.lax.stop_gradient."
        )
    if plan.bwd.modifier is not None:
        # Build the backward now: a modifier cuDNN rejects fails here, where dispatch can fall back.
        plan.executor.get_entry(plan.bwd)
    unwrap = lambda x: x.value if is_primal(x) else x
    primals = (q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale)
    q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale = jax.tree.map(unwrap, primals, is_leaf=is_primal)
    out, stats, valid, row_max = _forward(plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale=scale)
    # An FP8 forward is differentiated by the 16-bit backward graph at the dequantized inputs q, k, v (`fp8.py`).
    residuals = (q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, jax.tree.map(lambda _: None, fp8), out, stats,
                 valid, scale)
    return (out, _masked_lse(stats, valid, sinks), _head_maxima(row_max, valid)), residuals


def _sdpa_bwd(plan: Plan, residuals, cotangents):
    q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, no_fp8, out, stats, valid, scale = residuals
    d_out, d_lse, _ = cotangents  # the row maxima are a statistic
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    d_out = d_out.astype(out.dtype)
    mask_rows = valid is not None and (plan.detect_masked or not plan.rows_by_length)
    if mask_rows:
        d_out = jnp.where(valid[..., None], d_out, jnp.zeros((), d_out.dtype))
    if plan.lse_backward:
        logs.log_once(
            ("lse backward", plan.fwd.t, plan.fwd.s), logging.INFO,
            "attnlib cudnn: the backward of %d query rows over %d keys runs in plain JAX from the forward's "
            "statistics (lse_backward), faster than cuDNN's backward graph for so few rows.", plan.fwd.t, plan.fwd.s,
        )  # fmt: skip
        # Exact zeros wherever a row or a key is not visible: no masking pass over the gradients.
        dq, dk, dv, dbias = lse_backward.gradients(
            q, k, v, out, d_out, stats, _visible(plan, seq_q, seq_kv), scale=_scale_value(plan.bwd, scale),
            bias=bias,
        )
    else:
        dq, dk, dv, dbias = _graph_gradients(plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, out, stats,
                                             d_out, valid if mask_rows else None, scale)  # fmt: skip
    dsinks = None
    if sinks is not None:
        # d out_i / d sink = -p_sink,i * out_i with p_sink,i = exp(sink - lse_i); rows that see no key have out = 0.
        row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - stats)  # [B, N, T]
        if valid is not None:
            p_sink = jnp.where(_head_major(valid), p_sink, 0.0)
        dsinks = -jnp.einsum("btn,bnt->n", row, p_sink).astype(sinks.dtype)
    if not isinstance(d_lse, jax.custom_derivatives.SymbolicZero):
        # Gradients flowing into lse: cuDNN's backward has no input for them; differentiate a reference lse.
        diff = (q, k, bias, sinks)
        lse_reference, vjp = jax.vjp(lambda *a: _lse_reference(plan, *a, seq_q, seq_kv, args, scale), *diff)
        extra = vjp(varying.match(d_lse.astype(jnp.float32), lse_reference))
        dq, dk = (g + e.astype(g.dtype) for g, e in zip((dq, dk), extra[:2]))
        if bias is not None:
            dbias = dbias + extra[2].astype(dbias.dtype)
        if sinks is not None:
            dsinks = dsinks + extra[3].astype(dsinks.dtype)
    d_scale = None if scale is None else _scale_gradient(q, dq, scale)  # dq: every path to q, lse's included
    return dq, dk, dv, dbias, dsinks, None, None, None, jax.tree.map(lambda _: None, args), no_fp8, d_scale


def _graph_gradients(plan: Plan, q, k, v, bias, sinks, seq_q, seq_kv, seeds, args, out, stats, d_out, valid_rows,
                     scale=None):  # fmt: skip
    """`(dq, dk, dv, dbias)` from the backward graph, zero in the rows `valid_rows` `[B, T, 1|N]` marks invalid (None:
    no row masking) and, unless the graph zero-fills them, in the keys past `seq_kv`."""
    seed, offset = (None, None) if seeds is None else (seeds[0:1], seeds[1:2])
    values = {
        Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: out, Uid.DO: d_out, Uid.STATS: stats, Uid.BIAS: bias,
        Uid.SEQ_Q: _graph_seq_q(plan, seq_q, seq_kv), Uid.SEQ_KV: _graph_seq_kv(plan, seq_kv), Uid.SEED: seed,
        Uid.OFFSET: offset,
        Uid.SINK: sinks, Uid.ATTN_SCALE: scale,
        **_arg_values(args),
    }
    grads = executor.graph_call(plan.bwd, plan.executor)(*_operands(plan.bwd, values))
    dq, dk, dv = grads[:3]
    dbias = None
    if bias is not None:
        dbias = grads[3] if plan.bwd.bias_grad else jnp.zeros(bias.shape, bias.dtype)
    zero = lambda x: jnp.zeros((), x.dtype)
    if valid_rows is not None:
        dq = jnp.where(valid_rows[..., None], dq, zero(dq))
    if seq_kv is not None and not plan.rows_by_length:
        key_valid = jnp.arange(plan.fwd.s, dtype=jnp.int32)[None, :] < seq_kv[:, None]
        dk = jnp.where(key_valid[:, :, None, None], dk, zero(dk))
        dv = jnp.where(key_valid[:, :, None, None], dv, zero(dv))
    return dq, dk, dv, dbias


_sdpa.defvjp(_sdpa_fwd, _sdpa_bwd, symbolic_zeros=True)


def _memset_rows(padded: bool, device: support.Device | None) -> bool:
    """Whether padded top-left graphs (`Plan.rows_by_length`) zero O, dQ, dK and dV with a memset before cuDNN runs:
    only on a cuDNN (of `device`, default this process's) not known to write those zeros itself
    (`support.writes_padding_zeros`), logged once."""
    if not padded:
        return False
    try:
        version = (support.device() if device is None else device).cudnn_version
    except NotImplementedError:  # no GPU: no graph runs here (plans built on a CPU, in tests)
        return False
    if support.writes_padding_zeros(version):
        return False
    logs.log_once(
        ("memset rows", version), logging.INFO,
        "attnlib cudnn: cuDNN %s is not known to write zeros in padded rows (checked on 9.19); padded calls zero-fill "
        "their results first (a memset, 5-8 %% of a padded call).", support.version_string(version),
    )  # fmt: skip
    return True


def make_plan(
    config: AttentionConfig,
    b: int,
    t: int,
    bias_shape: tuple[int, int] | None,
    *,
    bias_grad: bool = True,
    mask_bias: bool = False,
    row_max: bool = False,
    graph_executor: GraphExecutor = FfiExecutor(),
    device: support.Device | None = None,
) -> Plan:
    """The graphs for a `[b, t, N, H]` problem (`t` after any bottom-right slicing) of `config`.

    With a score modifier (`modifier.uses_modifier`) causal, window and bottom-right alignment live in the modifier
    and key padding in the bias (`bias_shape` must then include it), so the graphs have no built-in mask.
    `mask_bias`: the bias carries masks (`_mask_bias`), so rows may see no key.
    `row_max`: the forward writes each row's score maximum (`GraphSpec.row_max`, for `return_max_logit`).
    `graph_executor` builds and runs the graphs; `device` is the GPU they are for (default: this process's).
    """
    s = config.kv_len
    padded = config.has_q_lengths or config.has_kv_lengths
    band = Band.of(config)
    if band.bottom_right and t == s and not padded:
        band = dataclasses.replace(band, bottom_right=False)
    rows_valid = not padded and band.all_rows_valid(t, s)
    score_modifier = None
    if modifier_lib.uses_modifier(config):
        offset = s - t if config.diagonal_alignment == "bottom_right" else 0
        score_modifier = modifier_lib.build(config, offset, t, s)
        band = Band(None, None, False)
        padded = False
    common = dict(
        dtype=np.dtype(config.output_dtype).name,
        b=b, t=t, s=s, n=config.num_q_heads, k=config.num_kv_heads, h=config.head_dim, hv=config.value_head_dim,
        scale=None if config.scale is None else float(modifier_lib.folded_scale(config)),
        alignment="bottom_right" if band.bottom_right else "top_left",
        left_bound=None if band.left is None else band.left + 1,
        right_bound=band.right,
        padding=padded,
        bias_b=0 if bias_shape is None else bias_shape[0],
        bias_n=0 if bias_shape is None else bias_shape[1],
        dropout=float(config.dropout_rate),
        sinks=config.has_sinks,
        memset_rows=_memset_rows(padded, device),  # read with `rows_by_length` only
        modifier=score_modifier,
        bias_grad=bias_grad,
    )
    fwd = GraphSpec(direction="fwd", fp8=config.fp8 is not None, row_max=row_max, **common)
    bwd = GraphSpec(direction="bwd", deterministic=config.deterministic_backward, **common)
    # Rows that see no key are found from the statistics when a caller's mask or modifier may hide a row's keys, or
    # when a band inside the modifier hides some row's (a soft cap alone is finite: no pass over the output).
    detect = config.has_mask or config.modifiers is not None or mask_bias
    detect = detect or (score_modifier is not None and not rows_valid)
    inference = None
    plain = score_modifier is None and not detect and not row_max
    if not config.return_residual and config.dropout_rate == 0 and plain:
        inference = dataclasses.replace(fwd, stats=False)
    all_valid = rows_valid and not detect
    return Plan(
        fwd, bwd, band, all_valid, inference, detect_masked=detect,
        masked_below=modifier_lib.masked_below(config.dtype),
        lse_backward=_short_query_backward(fwd) and score_modifier is None and not detect and not config.dropout_rate,
        executor=graph_executor,
    )


# Few query rows against many keys: cuDNN 9.19's backward graph is up to 1.5x slower than one plain-JAX pass from
# the forward's statistics there (decode steps; measured in docs/performance.md).
SHORT_QUERY_ROWS = 16
SHORT_QUERY_MIN_KEYS = 1024
SHORT_QUERY_SCORE_BYTES = 1 << 28


def _short_query_backward(fwd: GraphSpec) -> bool:
    """Whether a dense backward without modifier, mask or dropout runs `lse_backward.gradients` instead of
    cuDNN's graph: at most `SHORT_QUERY_ROWS` query rows, at least `SHORT_QUERY_MIN_KEYS` keys, and float32 scores
    `[B, N, T, S]` within `SHORT_QUERY_SCORE_BYTES`."""
    score_bytes = 4 * fwd.b * fwd.n * fwd.t * fwd.s
    few_rows = fwd.t <= SHORT_QUERY_ROWS and fwd.s >= SHORT_QUERY_MIN_KEYS
    return few_rows and not fwd.fp8 and score_bytes <= SHORT_QUERY_SCORE_BYTES


def _bias_rank4(bias: jax.Array, batch_shape: tuple[int, ...], n: int, t: int, s: int, dtype: Any) -> jax.Array:
    """Bias broadcastable to `[*B, N, T, S]` -> `[B|1, N|1, T, S]` in the io dtype."""
    nb = len(batch_shape)
    x = jnp.reshape(bias, (1,) * (nb + 3 - bias.ndim) + bias.shape)
    if all(d == 1 for d in x.shape[:nb]):
        x = jnp.reshape(x, (1,) + x.shape[nb:])
    else:
        x = jnp.reshape(jnp.broadcast_to(x, batch_shape + x.shape[nb:]), (-1,) + x.shape[nb:])
    heads = n if x.shape[1] != 1 else 1
    return jnp.broadcast_to(x, (x.shape[0], heads, t, s)).astype(dtype)


def _visibility(config: AttentionConfig, inputs: AttentionInputs) -> jax.Array:
    """Bool `[B, 1, T, S]`: which keys each query sees by the sequence structure (lengths, segment ids) and the
    built-in causal / window masks, per-sequence alignment included (`modifier.visibility_as_bias`)."""
    p = canonical.dense_token_positions(config, inputs)
    seen = masks_lib.visible(
        p.q_segment, p.q_position, p.kv_segment, p.kv_position, is_causal=config.is_causal, window=config.window
    )
    return seen[:, None]


def _mask_bias(config, inputs, B, N, t, S, skip, seq_kv, dtype, visibility=None) -> jax.Array | None:
    """The additive bias `[B|1, N|1, t, S]` (0 = kept, `modifier.mask_bias_value` = masked) that carries a boolean
    `mask`, the `visibility` of `_visibility`, and, in a graph with a score modifier, key padding; None when there is
    none of them."""
    masked = modifier_lib.mask_bias_value(dtype)
    keep = visibility
    if inputs.mask is not None:
        mask = _bias_rank4(inputs.mask, config.batch_shape, N, config.q_len, S, jnp.bool_)[:, :, skip:, :]
        keep = mask if keep is None else keep & mask
    if modifier_lib.uses_modifier(config) and seq_kv is not None:
        keys = (jnp.arange(S, dtype=jnp.int32)[None, :] < seq_kv[:, None])[:, None, None, :]
        keep = keys if keep is None else keep & keys
    if keep is None:
        return None
    keep = jnp.broadcast_to(keep, keep.shape[:2] + (t, S))
    return jnp.where(keep, jnp.zeros((), dtype), jnp.asarray(masked, dtype))


def _modifier_args(config, inputs, t, S, skip) -> tuple[jax.Array, ...]:
    """`score_mod_args` as float32 `[1, N|1, t|1, S|1]` tensors (the graph's `arg_dims`)."""
    if config.modifiers is None:
        return ()
    args = []
    for x, dims in zip(inputs.score_mod_args, modifier_lib.arg_dims(config, t, S), strict=True):
        x = jnp.asarray(x)
        x = jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else jnp.reshape(x, (1,) + x.shape[-3:])
        if x.shape[2] != 1:
            x = x[:, :, skip:, :]
        args.append(jnp.broadcast_to(x, dims).astype(jnp.float32))
    return tuple(args)


def attention(
    config: AttentionConfig,
    inputs: AttentionInputs,
    graph_executor: GraphExecutor,
    device: support.Device | None = None,
) -> tuple[jax.Array, ...]:
    """`(out [*B, T, N, Hv], lse float32 [*B, T, N])` of a dense call (with `config.max_logit`, also `max_logit`
    `[*B, N]` when the forward graph can give it) computed by cuDNN graphs that `graph_executor` builds and runs for
    `device` (default: this process's GPU)."""
    visibility = None
    if modifier_lib.visibility_as_bias(config):
        visibility = _visibility(config, inputs)
        config = modifier_lib.without_visibility(config)
    batch_shape = () if config.unbatched else config.batch_shape
    B, T, S, N = config.batch_size, config.q_len, config.kv_len, config.num_q_heads
    dtype = np.dtype(config.output_dtype)
    q = jnp.reshape(inputs.query, (B, T, N, config.head_dim))
    k = jnp.reshape(inputs.key, (B, S, config.num_kv_heads, config.head_dim))
    v = jnp.reshape(inputs.value, (B, S, config.num_kv_heads, config.value_head_dim))
    sinks = None if inputs.sinks is None else inputs.sinks.astype(jnp.float32)

    def finish(out: jax.Array, lse: jax.Array, maxima: jax.Array | None = None) -> tuple[jax.Array, ...]:
        out = jnp.reshape(out.astype(dtype), batch_shape + (T, N, config.value_head_dim))
        maxima = () if maxima is None else (jnp.reshape(maxima, batch_shape + (N,)),)
        return out, jnp.reshape(lse, batch_shape + (T, N)), *maxima

    if B == 0 or T == 0 or S == 0:
        out = jnp.zeros((B, T, N, config.value_head_dim), dtype)
        empty = jnp.full((B, T, N), -jnp.inf, jnp.float32) if sinks is None else jnp.broadcast_to(sinks, (B, T, N))
        return finish(out, empty)

    fp8 = None
    if config.fp8 is not None:
        q, k, v, fp8 = _fp8_inputs(config, inputs, q, k, v, dtype)
    padded = config.has_q_lengths or config.has_kv_lengths
    seq_q = seq_kv = None
    if padded:
        full = lambda x, n: jnp.full((B,), n, jnp.int32) if x is None else jnp.reshape(x, (B,)).astype(jnp.int32)
        seq_q = jnp.clip(full(inputs.query_seq_lengths, T), 0, T)
        seq_kv = jnp.clip(full(inputs.key_value_seq_lengths, S), 0, S)

    # Bottom-right with more queries than keys: the first T - S queries see nothing (a causal mask or a window
    # with right <= 0; policy guarantees it for graphs without a modifier) and are not computed.
    t, _ = support.graph_rows(config)
    skip = T - t
    bias = None
    if inputs.bias is not None:
        bias = _bias_rank4(inputs.bias, config.batch_shape, N, T, S, dtype)[:, :, skip:, :]
    masks = _mask_bias(config, inputs, B, N, t, S, skip, seq_kv, dtype, visibility)
    bias_grad = bias is not None
    if masks is not None:
        bias = masks if bias is None else bias + masks
    args = _modifier_args(config, inputs, t, S, skip)
    seeds = None
    if config.dropout_rate > 0:
        seeds = jax.lax.bitcast_convert_type(dropout_lib.dropout_seeds(inputs.dropout_key), jnp.int32)

    bias_shape = None if bias is None else (bias.shape[0], bias.shape[1])
    plan = make_plan(config, B, t, bias_shape, bias_grad=bias_grad, mask_bias=masks is not None,
                     row_max=_fused_max_logit(config), graph_executor=graph_executor, device=device)
    if plan.fwd.row_max:
        try:
            graph_executor.get_entry(plan.fwd)
        except graphs.GraphRejected as e:
            logs.log_once(
                ("row max graph", plan.fwd.label), logging.WARNING,
                "attnlib cudnn: the forward graph with score_max refused to build (%s); return_max_logit takes its "
                "own pass over the keys.", e,
            )  # fmt: skip
            plan = make_plan(config, B, t, bias_shape, bias_grad=bias_grad, mask_bias=masks is not None,
                             graph_executor=graph_executor, device=device)
    scale = None  # a runtime scale: one float32 [1] graph input for every value (`GraphSpec.scale` None)
    if config.scale is None:
        scale = jnp.reshape(modifier_lib.folded_scale(config, inputs.scale).astype(jnp.float32), (1,))
    # Inside shard_map: differentiable inputs vary like the rest, so custom_vjp cotangent types match.
    q, k, v, bias, sinks, scale = varying.like_inputs(
        (q, k, v, bias, sinks, scale), (q, k, v, bias, sinks, seq_q, seq_kv, seeds, scale)
    )
    if fp8 is not None and skip:
        fp8 = dataclasses.replace(fp8, q=fp8.q[:, skip:])
    out, lse, maxima = _sdpa(plan, q[:, skip:], k, v, bias, sinks, seq_q, seq_kv, seeds, args, fp8, scale)
    if skip:
        out = jnp.concatenate([jnp.zeros((B, skip) + out.shape[2:], out.dtype), out], axis=1)
        head = jnp.full((B, skip, N), -jnp.inf, jnp.float32) if sinks is None else jnp.broadcast_to(sinks, (B, skip, N))
        lse = jnp.concatenate([head, lse], axis=1)
    return finish(out, lse, maxima)


def _fused_max_logit(config: AttentionConfig) -> bool:
    """`return_max_logit` comes from the forward graph's `score_max` (dense graphs without FP8, sinks (the sink
    would enter the maximum) or a score modifier); otherwise `max_logit.py` takes its own pass."""
    return config.max_logit and config.fp8 is None and not config.has_sinks and not modifier_lib.uses_modifier(config)
