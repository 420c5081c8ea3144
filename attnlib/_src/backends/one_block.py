"""`xla_chunked` when the keys fit in one block: the forward keeps its unnormalized probabilities and the backward
uses them instead of recomputing (on a CPU this made small problems faster than jax.nn's, docs/performance.md).

Score-sized arrays are laid out `[B, K, G·T, S]` (`scores.rows`). The backward puts `1 / l` on the `[T, Hv]`-sized
`dO` (`dV = pᵀ (dO / l)`) and inside the `dS` pass (`dS = p / l · (dP − D)`), so it adds no pass over the scores.
Under a causal bound the first half of the query rows runs against only the keys it can see (`row_chunks`): a
quarter less work when `T = S`.
"""

import jax
import jax.numpy as jnp

from .. import canonical, explicit_axes
from ..band import Band
from ..config import AttentionConfig
from . import scores


def every_key_visible(config: AttentionConfig, problem: canonical.Problem) -> bool:
    """Statically: every query sees every key with a finite score (no segments or padding, mask, bias, causal or
    window bound, sinks)."""
    return (
        problem.positions.q_segment is None
        and problem.mask is None
        and problem.bias is None
        and problem.sinks is None
        and not Band.of(config).bounded
        and problem.key.shape[1] > 0
    )


def row_chunks(config: AttentionConfig, problem: canonical.Problem) -> tuple[tuple[int, int, int], ...]:
    """`(first row, end row, keys seen)` per chunk of query rows. Two chunks when a causal (right) bound hides at
    least a quarter of the keys from the first half of the rows and the positions are static (no segments or
    padding, bias, mask or `score_mod_args` to slice); otherwise one chunk of everything."""
    T, S = problem.query.shape[1], problem.key.shape[1]
    band = Band.of(config)
    whole = ((0, T, S),)
    simple = problem.positions.q_segment is None and problem.bias is None and problem.mask is None
    if band.right is None or not simple or problem.score_mod_args or T < 128:
        return whole
    half = T // 2
    seen = min(S, int(band.diagonal(half - 1, T, S)) + band.right + 1)  # keys up to the last row's right bound
    if seen <= 0 or seen > 3 * S // 4:
        return whole
    return (0, half, seen), (half, T, S)


def _part(problem: canonical.Problem, t0: int, t1: int, seen: int) -> canonical.Problem:
    """Query rows `t0:t1` against the first `seen` keys (static positions only, see `row_chunks`)."""
    positions = problem.positions
    return problem._replace(
        query=problem.query[:, t0:t1],
        key=problem.key[:, :seen],
        value=problem.value[:, :seen],
        positions=positions._replace(
            q_position=positions.q_position[:, t0:t1], kv_position=positions.kv_position[:, :seen]
        ),
    )


def forward(config: AttentionConfig, problem: canonical.Problem):
    """`xla_chunked`'s forward when the keys fit one block: `out [B, T, N, Hv]`, `lse [B, K, G, T]`, and per chunk
    of `row_chunks` its probabilities and row sums (`_forward_chunk`)."""
    parts = [_forward_chunk(config, _part(problem, *chunk)) for chunk in row_chunks(config, problem)]
    out = jnp.concatenate([part[0] for part in parts], axis=1)
    lse = jnp.concatenate([part[1] for part in parts], axis=3)
    return out, lse, tuple(part[2] for part in parts), tuple(part[3] for part in parts)


def backward(config: AttentionConfig, problem: canonical.Problem, out, lse, ps, row_sums, d_out, d_lse):
    """The gradients of `forward` from its saved probabilities, chunk by chunk: `(dq, dk, dv, dbias, dsinks, dscale)`
    (`dscale`: of a runtime scale, else None)."""
    S = problem.key.shape[1]
    dq, dk, dv, d_sinks, d_scale = [], 0, 0, 0, None
    pad = lambda x, seen: jnp.pad(x, ((0, 0), (0, S - seen), (0, 0), (0, 0)))  # noqa: E731
    for (t0, t1, seen), p, row_sum in zip(row_chunks(config, problem), ps, row_sums, strict=True):
        dq_c, dk_c, dv_c, dbias, d_sinks_c, d_scale_c = _backward_chunk(
            config, _part(problem, t0, t1, seen), out[:, t0:t1], lse[..., t0:t1], p, row_sum,
            d_out[:, t0:t1], d_lse[..., t0:t1],
        )  # fmt: skip
        dq.append(dq_c)
        dk, dv = dk + pad(dk_c, seen), dv + pad(dv_c, seen)
        d_sinks = None if d_sinks_c is None else d_sinks + d_sinks_c
        d_scale = d_scale_c if d_scale is None else d_scale + d_scale_c
    dq = jnp.concatenate(dq, axis=1)
    dq, dk, dv = dq.astype(problem.query.dtype), dk.astype(problem.key.dtype), dv.astype(problem.value.dtype)
    return dq, dk, dv, dbias, d_sinks, d_scale


def _forward_chunk(config: AttentionConfig, problem: canonical.Problem):
    """`xla_chunked`'s forward for a single key block: `out [B, T, N, Hv]`, `lse [B, K, G, T]`, the unnormalized
    probabilities `p = exp(s - shift)` `[B, K, G·T, S]` and their row sums `l` `[B, K, G·T]` (with the sinks; 1
    where nothing is visible)."""
    B, T, N, _ = problem.query.shape
    K, G, S, Hv = config.num_kv_heads, config.group_size, problem.key.shape[1], problem.value.shape[-1]
    acc_dtype = scores.accumulator(problem.query.dtype)
    as_rows = lambda x: scores.rows(jnp.broadcast_to(x, x.shape[:2] + (G, T) + x.shape[4:]))
    q5 = scores.grouped_query(config, problem.query)
    scale_query = acc_dtype == problem.query.dtype  # float32 / float64 (see `scores.raw_scores`)
    s = scores.rows(scores.raw_scores(
        config, q5, problem.key, problem.bias, scale_query=scale_query, scale=problem.scale
    ))
    allowed = as_rows(scores.visible(config, problem, 0, S, problem.mask))
    sinks = None if problem.sinks is None else as_rows(scores.grouped_sinks(config, problem.sinks)[..., None])[..., 0]
    p, row_sum, lse = scores.statistics(s, allowed, sinks, every_key_visible=every_key_visible(config, problem))
    out = jnp.einsum(
        "bkrs,bskh->bkrh", p.astype(problem.value.dtype), problem.value, preferred_element_type=acc_dtype,
        precision=scores.precision(problem.value.dtype),
    ) / row_sum[..., None]  # fmt: skip
    out = jnp.reshape(jnp.transpose(jnp.reshape(out, (B, K, G, T, Hv)), (0, 3, 1, 2, 4)), (B, T, N, Hv))
    return out.astype(problem.query.dtype), jnp.reshape(lse, (B, K, G, T)), p, row_sum


def _backward_chunk(config: AttentionConfig, problem: canonical.Problem, out, lse, p, row_sum, d_out, d_lse):
    """`xla_chunked`'s backward from the forward's probabilities (`_forward_chunk`, `[B, K, G·T, S]`): `P = p / l`, and
    `1 / l` is applied to the `[T, Hv]`-sized `dO` instead of the `[T, S]` probabilities. Returns
    `(dq, dk, dv, dbias, dsinks, dscale)`, the first three in the accumulator dtype (`dscale`: of a runtime scale)."""
    B, T, N, H = problem.query.shape
    K, G = config.num_kv_heads, config.group_size
    acc_dtype = scores.accumulator(problem.query.dtype)
    f32 = lambda x: x.astype(acc_dtype)
    to_rows = lambda x: scores.rows(scores.grouped_query(config, x))  # [B, T, N, X] -> [B, K, G·T, X]
    q_rows = to_rows(problem.query)
    do_rows = to_rows(d_out)
    correction = to_rows(jnp.sum(f32(d_out) * f32(out), axis=-1, keepdims=True))[..., 0]
    correction = correction - jnp.reshape(f32(d_lse), (B, K, G * T))
    inv_l = 1.0 / row_sum
    highest = jax.lax.Precision.HIGHEST
    # summed over the query rows of each key head: also across shards where the group is split (MQA over a mesh axis)
    keys_split = lambda x, y: explicit_axes.sharding_from((x, 0), (x, 3), (x, 1), (y, 3))
    dv_rows = f32(do_rows) * inv_l[..., None]
    dv = jnp.einsum("bkrs,bkrh->bskh", p, dv_rows, precision=highest, out_sharding=keys_split(p, dv_rows))
    dp = jnp.einsum(
        "bkrh,bskh->bkrs", do_rows, problem.value, preferred_element_type=acc_dtype,
        precision=scores.precision(problem.value.dtype),
    )  # fmt: skip
    ds = p * inv_l[..., None] * (dp - correction[..., None])
    dbias = None
    if problem.bias is not None:
        reduce_axes = tuple(a for a in range(4) if problem.bias.shape[a] == 1)
        S = problem.key.shape[1]
        ds_n = jnp.reshape(jnp.reshape(ds, (B, K, G, T, S)), (B, N, T, S))  # in two steps: each keeps a split K
        dbias = jnp.sum(ds_n, axis=reduce_axes, keepdims=True).astype(problem.bias.dtype)
    d_scale = None
    if config.scale is None:
        # a runtime scale: d scale = <dS k, q> (`xla_chunked.scale_gradient`), with dq = scale * dS k
        dq = jnp.einsum("bkrs,bskh->bkrh", ds, f32(problem.key), precision=highest)
        d_scale = jnp.sum(dq * f32(q_rows)).astype(problem.scale.dtype)
        ds = ds * scores.logit_scale(config, problem.scale, ds.dtype)
        dq = dq * scores.logit_scale(config, problem.scale, dq.dtype)
    else:
        ds = ds * jnp.asarray(config.scale, ds.dtype)
        dq = jnp.einsum("bkrs,bskh->bkrh", ds, f32(problem.key), precision=highest)
    dk = jnp.einsum("bkrs,bkrh->bskh", ds, f32(q_rows), precision=highest, out_sharding=keys_split(ds, q_rows))
    d_sinks = None
    if problem.sinks is not None:
        d_sinks = scores.sinks_gradient(config, problem.sinks, lse, jnp.reshape(correction, (B, K, G, T)))
    dq = jnp.reshape(jnp.transpose(jnp.reshape(dq, (B, K, G, T, H)), (0, 3, 1, 2, 4)), (B, T, N, H))
    return dq, dk, dv, dbias, d_sinks, d_scale
