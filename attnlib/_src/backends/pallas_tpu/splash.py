"""Running splash attention on a canonical problem: layout, padding, segment ids, scale, empty rows and gradients.

Splash runs one batch row at a time on `q [N, T', H']`, `k [K, S', H']`, `v [K, S', Hv']` (GQA: query head `n`
reads key/value head `n // (N // K)`, as attnlib's contract has it); attnlib vmaps it over the batch (one fused
call). Lengths are padded to the block grid (`blocks.padded_lengths`) and head dims to 128 lanes with zeros (zero
columns change no score and add only zero output columns). Splash has no scale argument: the query is multiplied by
the scale first (in float32, rounded once), so a traced scale gets its gradient from JAX.

Sequence structure (padding lengths, packed segments, THD sequences, padded keys) reaches the kernel as segment
ids: `positions.TokenPositions` ids, with "sees nothing" (`0`) mapped to sentinels no key / query carries.

Sinks (per query head, `[N]`) are splash's own operand: its forward starts each row's running max at the sink and
its running sum at 1, so the sink is one more logit in every denominator, neither scaled (the scale is folded into the
query) nor soft-capped (splash caps only `q.k`), as attnlib's contract has it. The kernels' `lse` then includes it.

Rows that see no key (only where the call's structure or band can leave one empty: `Kernel.empty_rows`): without sinks
splash leaves them at its mask value (or NaN where every block of the row was skipped). The forward sets their output
to 0 and their `lse` to `scores.hidden_score` (`-inf` when returned); the backward zeroes their cotangents and gives
the kernels `lse = 0` there, so their probabilities are exactly 0. With a (finite) sink such a row is exact from the
kernel: out 0 (its keys' `exp(mask value - sink)` is 0), `lse = sink`, and it counts as seen.

Gradients: attnlib's own `custom_vjp` around splash's forward and its dK/dV and dQ kernels. The `lse` cotangent
enters exactly through the kernels' row term: `dS = P (dP - D)` with `D = rowsum(dO * O) - dlse`. The sink is a
column with no value (`dP = 0`), so `dsink[n] = -Σ_{b,t} p_sink D` with `p_sink = exp(sink - lse)`.

The caller's JAX settings (`jax_enable_x64`, `jax_default_matmul_precision`, dtype and rank promotion) do not reach
the kernels: every kernel call, the backward's included (traced after the forward, under the settings in force then),
goes through `partitioning.call`, which traces it under `kernel_settings.as_written()`. Around the kernels, the
arithmetic is elementwise in float32 (no matrix product a precision setting would change).
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ... import canonical
from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from .. import scores
from . import blocks, masks, partitioning


Q_NONE = -(2**31)
"""Segment id of a query that sees nothing (attnlib's id 0, padding): no key carries it."""
KV_NONE = -(2**31) + 1
"""Segment id of a key no query sees (attnlib's id 0, padding, the padded tail): no query carries it."""


def _seen(call: masks.Kernel, lse: jax.Array, q_ids: jax.Array | None) -> jax.Array:
    """bool `[B, N, T']`: the rows that saw a key or a sink. From the segment ids where they say it
    (`call.empty_rows_from_ids`), else from the raw splash `lse`: above half the mask value (an empty row without a
    sink sits at the mask value, -inf or NaN)."""
    if call.empty_rows_from_ids:
        return jnp.broadcast_to((q_ids != Q_NONE)[:, None, :], lse.shape)
    return lse > 0.5 * scores.hidden_score(jnp.float32)


def _kernel_call(call: masks.Kernel, q, k, v, q_ids, kv_ids, sinks) -> tuple[jax.Array, jax.Array]:
    """Splash's forward over the batch: `out [B, N, T', Hv']` and the raw float32 `lse [B, N, T']` (the sinks `[N]`,
    or None, shared by every batch row)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    kernel = masks.kernel(call)

    def one(q, k, v, q_ids, kv_ids, sinks):
        segment_ids = None if q_ids is None else SegmentIds(q_ids, kv_ids)
        out, (lse,) = kernel(q, k, v, segment_ids, sinks)
        return out, lse

    batched = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None))
    return partitioning.call(batched, partitioning.FORWARD, (q, k, v, q_ids, kv_ids, sinks))


def _out_only(call: masks.Kernel, q, k, v, q_ids, kv_ids, sinks) -> jax.Array:
    """Splash's forward without residuals over the batch: `out [B, N, T', Hv']` (every row sees a key)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    kernel = masks.kernel(call, save_residuals=False)

    def one(q, k, v, q_ids, kv_ids, sinks):
        return kernel(q, k, v, None if q_ids is None else SegmentIds(q_ids, kv_ids), sinks)

    batched = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None))
    return partitioning.call(batched, partitioning.OUT_ONLY, (q, k, v, q_ids, kv_ids, sinks))


def _forward(call: masks.Kernel, q, k, v, q_ids, kv_ids, sinks):
    out, lse = _kernel_call(call, q, k, v, q_ids, kv_ids, sinks)
    if not call.empty_rows:
        return out, lse
    seen = _seen(call, lse, q_ids)
    out = jnp.where(seen[..., None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(seen, lse, scores.hidden_score(jnp.float32))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _splash(call: masks.Kernel, q, k, v, q_ids, kv_ids, sinks) -> tuple[jax.Array, jax.Array]:
    """`(out [B, N, T', Hv'], lse [B, N, T'])` of `q [B, N, T', H']` (already scaled), `k [B, K, S', H']`,
    `v [B, K, S', Hv']`, int32 segment ids `[B, T']`, `[B, S']` (or None) and sink logits `[N]` (or None); rows
    that see neither a key nor a sink: out 0, `lse = hidden_score`. Outside differentiation, a call whose `lse` is
    dropped (`call.lse_needed` False) runs the forward without residuals and gives `lse = -inf` (as cuDNN's paged
    forward does for a dropped `lse`)."""
    if not call.lse_needed:
        out = _out_only(call, q, k, v, q_ids, kv_ids, sinks)
        return out, jnp.full(out.shape[:3], -jnp.inf, jnp.float32)
    return _forward(call, q, k, v, q_ids, kv_ids, sinks)


def _splash_fwd(call, q, k, v, q_ids, kv_ids, sinks):
    out, lse = _forward(call, q, k, v, q_ids, kv_ids, sinks)
    return (out, lse), (q, k, v, q_ids, kv_ids, sinks, out, lse)


def _collapse(mask_info):
    """Splash's `MaskInfo` with its partial mask blocks as one `[blocks, bq, bkv]` stack (as its own call does)."""
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks_ = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks_.reshape(-1, *blocks_.shape[-2:]))


def _backward_kernels(call: masks.Kernel, q, k, v, q_ids, kv_ids, sinks, lse, d_out, di):
    """Splash's dK/dV (and dQ) kernels for one batch row with the row term `di` given. The sinks enter through
    `lse` (which includes them: `P = exp(S - lse)`); the kernels take them as an operand as splash's own backward
    passes them."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds, splash_attention_kernel as sk

    kernel = masks.kernel(call)
    bs = call.block_sizes
    segment_ids = None if q_ids is None else SegmentIds(q_ids, kv_ids)
    common = dict(
        is_mqa=False, mask_value=sk.DEFAULT_MASK_VALUE, attn_logits_soft_cap=call.soft_cap,
        q_layout=bs.q_layout, k_layout=bs.k_layout, v_layout=bs.v_layout,
        mask_function=kernel.kwargs["mask_function"], interpret=call.interpret,
    )  # fmt: skip
    dq, dk, dv = sk._splash_attention_bwd_dkv(
        q, k, v, segment_ids, sinks, lse, d_out, di,
        bq=bs.block_q_dkv, bkv=bs.block_kv_dkv, bkv_compute=bs.block_kv_dkv_compute,
        mask_info=_collapse(kernel.dkv_mask_info), use_fused_bwd_kernel=bs.use_fused_bwd_kernel, **common,
    )  # fmt: skip
    if not bs.use_fused_bwd_kernel:
        dq = sk._splash_attention_bwd_dq(
            q, k, v, segment_ids, sinks, lse, d_out, di,
            bq=bs.block_q_dq, bkv=bs.block_kv_dq, mask_info=_collapse(kernel.dq_mask_info), **common,
        )  # fmt: skip
    return dq, dk, dv


def _sinks_gradient(sinks: jax.Array, lse: jax.Array, seen: jax.Array | None, di: jax.Array) -> jax.Array:
    """`dsink [N] = -Σ_{b,t} p_sink D` with `p_sink = exp(sink - lse)` (0 on rows that see nothing: `seen` False;
    None: every row sees a key) and the row term `D = rowsum(dO * O) - dlse`, `[B, N, T']`: the sink column has no
    value, so its `dP` is 0."""
    sinks32 = sinks.astype(jnp.float32)[None, :, None]
    logit = sinks32 - lse
    p_sink = jnp.exp(logit if seen is None else jnp.where(seen, logit, scores.hidden_score(jnp.float32)))
    return jnp.sum(-p_sink * di, axis=(0, 2)).astype(sinks.dtype)


def _splash_bwd(call, residuals, cotangents):
    q, k, v, q_ids, kv_ids, sinks, out, lse = residuals
    d_out, d_lse = cotangents
    kernel_lse, seen = lse, None
    if call.empty_rows:
        seen = _seen(call, lse, q_ids)
        d_out = jnp.where(seen[..., None], d_out, jnp.zeros((), d_out.dtype))
        d_lse = jnp.where(seen, d_lse, 0.0)
        kernel_lse = jnp.where(seen, lse, 0.0)  # empty rows: exp(mask value - 0) = 0
    # A float32 sum of products, not an einsum: no matmul precision setting (the caller's) applies to it.
    di = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1) - d_lse
    per_row = jax.vmap(functools.partial(_backward_kernels, call), in_axes=(0, 0, 0, 0, 0, None, 0, 0, 0))
    operands = (q, k, v, q_ids, kv_ids, sinks, kernel_lse, d_out, di)
    dq, dk, dv = partitioning.call(per_row, partitioning.BACKWARD, operands)
    d_sinks = None if sinks is None else _sinks_gradient(sinks, lse, seen, di)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, d_sinks


_splash.defvjp(_splash_fwd, _splash_bwd)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one call maps onto splash: padded lengths and head dims, its kernel, and whether it needs segment ids."""

    kernel: masks.Kernel
    q_len: int
    kv_len: int
    head_dim: int
    value_head_dim: int
    segmented: bool


def layout(config: AttentionConfig, block_sizes: Any | None, interpret: bool) -> Layout:
    """The splash layout of a call `PallasTpu.decline_reason` accepted."""
    T, S = config.q_len, config.kv_len
    Tp, Sp = blocks.padded_lengths(T, S, block_sizes)
    chosen = blocks.default_block_sizes(Tp, Sp) if block_sizes is None else blocks.with_backward_blocks(block_sizes)
    offset = S - T if config.diagonal_alignment == "bottom_right" else 0
    mask = masks.mask_spec(is_causal=config.is_causal, window=config.window, offset=offset, q_len=Tp, kv_len=Sp)
    # Padded keys need hiding unless the static mask already keeps every real query short of them.
    reach = {"causal": 0, "local": None if mask.window is None else mask.window[1]}.get(mask.kind)
    keys_hidden = Sp == S or (reach is not None and T - 1 + offset + reach <= S - 1)
    structured = config.has_q_lengths or config.has_kv_lengths or config.has_segments or config.layout == "thd"
    segmented = structured or not keys_hidden
    band = Band.of(config)
    empty_rows = segmented or not band.all_rows_valid(T, S)
    diagonal_kept = (band.left is None or band.left >= 0) and (band.right is None or band.right >= 0)
    from_ids = (
        segmented  # (so `empty_rows`)
        and T == S
        and diagonal_kept
        and not (config.separate_kv_structure or config.has_q_lengths or config.has_kv_lengths or config.has_sinks)
    )
    kernel = masks.Kernel(mask, chosen, config.logits_soft_cap, interpret, config.return_residual, empty_rows, from_ids)
    return Layout(
        kernel=kernel,
        q_len=Tp, kv_len=Sp,
        head_dim=blocks.round_up(config.head_dim, blocks.LANES),
        value_head_dim=blocks.round_up(config.value_head_dim, blocks.LANES),
        segmented=segmented,
    )  # fmt: skip


def _segment_ids(problem: canonical.Problem, lay: Layout) -> tuple[jax.Array | None, jax.Array | None]:
    """int32 `[B, T']`, `[B, S']` splash segment ids of the call (None when it needs none)."""
    if not lay.segmented:
        return None, None
    p = problem.positions.with_segments()
    q_ids = jnp.where(p.q_segment != 0, p.q_segment, Q_NONE).astype(jnp.int32)
    kv_ids = jnp.where(p.kv_segment != 0, p.kv_segment, KV_NONE).astype(jnp.int32)
    q_ids = jnp.pad(q_ids, ((0, 0), (0, lay.q_len - q_ids.shape[1])), constant_values=Q_NONE)
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, lay.kv_len - kv_ids.shape[1])), constant_values=KV_NONE)
    return q_ids, kv_ids


def attention(config: AttentionConfig, inputs: AttentionInputs, lay: Layout) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` in the caller's layout (`Implementation.attention`)."""
    problem = canonical.canonicalize(config, inputs)
    q = problem.query
    scale = scores.logit_scale(config, problem.scale, jnp.float32)
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    q_ids, kv_ids = _segment_ids(problem, lay)
    out, lse = _splash(
        lay.kernel,
        blocks.heads_major(q, lay.q_len, lay.head_dim),
        blocks.heads_major(problem.key, lay.kv_len, lay.head_dim),
        blocks.heads_major(problem.value, lay.kv_len, lay.value_head_dim),
        q_ids,
        kv_ids,
        problem.sinks,
    )
    T, Hv = config.q_len, config.value_head_dim
    out = jnp.transpose(out[:, :, :T, :Hv], (0, 2, 1, 3))
    lse = jnp.transpose(lse[:, :, :T], (0, 2, 1))
    return canonical.restore(config, out, scores.returned_lse(config, lse))
