"""cuDNN attention over paged key/value caches (`page_table`): cuDNN's paged forward (decode and chunked prefill).

Ragged queries (`cu_seqlens_q` with `page_table`: a step mixing prefill chunks and decodes) run on the same graph:
the packed tokens are copied into rows `[B, max_seqlen_q, N, H]` with each sequence's query count as its padding
length (`canonical.ragged_rows`, the rows the plain-JAX implementations attend with), and each token's result is
read back from its row.

cuDNN has no paged backward, so the backward rule differentiates the `fallback` implementation that dispatch passes
(`xla`, which recomputes the attention in plain JAX) and `jax.grad` works as on every other path; without one
(`implementation="cudnn"` named alone) it raises `NotImplementedError`. A backward rule is the only place that knows a
gradient was asked for; dispatch cannot know it when it picks.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import canonical
from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from ..base import Fallback, fallback_gradients
from . import executor
from .executor import GraphExecutor
from .graphs import GraphSpec, Uid


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """Static description of one paged problem.

    Attributes:
        fwd: the forward graph spec.
        band: the call's mask (`band.py`).
        fallback: what a gradient differentiates (`base.Implementation`); None when cuDNN was named alone: a
            gradient then raises.
        config: the call's configuration (for the fallback backward).
        executor: what builds and runs the graph (`GraphExecutor`).
    """

    fwd: GraphSpec
    band: Band
    fallback: Fallback | None
    config: AttentionConfig
    executor: GraphExecutor


def _query_rows(plan: PagedPlan, q, reference) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`(rows [B, T, N, H], seq_q [B], token_rows)` the graph reads: dense queries with their padding lengths, or
    ragged ones laid out as rows (`token_rows` `[Tq]`: where each token's result is read back; None when dense)."""
    config, T = plan.config, plan.fwd.t
    if config.ragged_queries:
        laid_out = canonical.ragged_rows(config, q, reference["cu_seqlens_q"])
        return laid_out.query, laid_out.lengths, laid_out.rows
    lengths = reference["query_seq_lengths"]
    if lengths is None:
        return q, jnp.full((plan.fwd.b,), T, jnp.int32), None
    return q, jnp.clip(jnp.reshape(lengths, (plan.fwd.b,)).astype(jnp.int32), 0, T), None


def _paged_forward(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_kv, reference):
    spec = plan.fwd
    rows, seq_q, token_rows = _query_rows(plan, q, reference)
    values = {
        Uid.Q: rows, Uid.K: k_pages, Uid.V: v_pages, Uid.SEQ_Q: seq_q, Uid.SEQ_KV: seq_kv,
        Uid.PT_K: page_table, Uid.PT_V: page_table,
    }  # fmt: skip
    outputs = executor.run(spec, values, executor=plan.executor)
    valid = plan.band.rows_valid(seq_q, seq_kv, spec.t)
    out = jnp.where(valid[:, :, None, None], outputs[0], jnp.zeros((), outputs[0].dtype))
    if spec.stats:
        lse = jnp.where(valid[:, :, None], jnp.transpose(outputs[1], (0, 2, 1)), -jnp.inf)
    else:  # return_residual=False: the caller drops lse
        lse = jnp.full((spec.b, spec.t, spec.n), -jnp.inf, jnp.float32)
    if token_rows is None:
        return out, lse
    return canonical.gather_rows(out, token_rows), canonical.gather_rows(lse, token_rows, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged_sdpa(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_kv, reference):
    return _paged_forward(plan, q, k_pages, v_pages, page_table, seq_kv, reference)


def _paged_sdpa_fwd(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_kv, reference):
    args = executor.primal_values((q, k_pages, v_pages, page_table, seq_kv, reference))
    return _paged_forward(plan, *args), args


def _paged_sdpa_bwd(plan: PagedPlan, residuals, cotangents):
    q, k_pages, v_pages, page_table, seq_kv, reference = residuals
    run = plan.fallback
    if run is None:
        raise NotImplementedError(
            "cudnn: gradients of paged key/value attention (`page_table`) are not supported: cuDNN's paged "
            "attention is forward only. Use implementation=None (cuDNN forward, `xla` backward) or "
            "implementation='xla' to differentiate it."
        )
    d_out, d_lse = cotangents
    d_out = jnp.zeros(q.shape[:-1] + (v_pages.shape[-1],), q.dtype) if isinstance(
        d_out, jax.custom_derivatives.SymbolicZero) else d_out  # fmt: skip
    d_lse = jnp.zeros(q.shape[:-1], jnp.float32) if isinstance(
        d_lse, jax.custom_derivatives.SymbolicZero) else d_lse  # fmt: skip

    # The caller's own arrays (packed queries with `cu_seqlens_q` when ragged): the fallback recomputes the call.
    inputs = AttentionInputs(query=q, key=k_pages, value=v_pages, page_table=page_table, **reference)
    dq, dk, dv = fallback_gradients(run, plan.config, inputs, d_out, d_lse)
    return dq, dk, dv, None, None, jax.tree.map(lambda _: None, reference)


_paged_sdpa.defvjp(_paged_sdpa_fwd, _paged_sdpa_bwd, symbolic_zeros=True)


def attention(
    config: AttentionConfig, inputs: AttentionInputs, graph_executor: GraphExecutor, *,
    fallback: Fallback | None,
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` of a paged call on cuDNN's paged forward graph, built and run by `graph_executor`; a gradient
    differentiates `fallback` (see the module docstring).

    Returns:
        `out` `[B, T, N, Hv]` and float32 `lse` `[B, T, N]`; ragged queries: `[Tq, N, Hv]` and `[Tq, N]`.
    """
    if config.ragged_queries:
        B, T, q = config.num_sequences, config.max_seqlen_q, inputs.query
    else:
        B, T = config.batch_size, config.q_len
        q = jnp.reshape(inputs.query, (B, T, config.num_q_heads, config.head_dim))
    seq_kv = jnp.clip(jnp.reshape(inputs.key_value_seq_lengths, (B,)).astype(jnp.int32), 0, config.kv_len)
    band = Band.of(config)  # decode's no-op causal mask is already dropped (`band.causal_mask_is_a_no_op`)
    spec = GraphSpec(
        direction="fwd", dtype=np.dtype(config.dtype).name, b=B, t=T, s=config.kv_len, n=config.num_q_heads,
        k=config.num_kv_heads, h=config.head_dim, hv=config.value_head_dim, scale=float(config.scale),
        alignment="bottom_right" if band.bottom_right else "top_left",
        left_bound=None if band.left is None else band.left + 1, right_bound=band.right, padding=True,
        pages=(config.num_pages, config.page_size, config.pages_per_seq), stats=config.return_residual,
    )  # fmt: skip
    plan = PagedPlan(spec, band, fallback, config, graph_executor)
    reference = {
        "key_value_seq_lengths": inputs.key_value_seq_lengths, "query_seq_lengths": inputs.query_seq_lengths,
        "cu_seqlens_q": inputs.cu_seqlens_q,
    }  # fmt: skip
    page_table = inputs.page_table.astype(jnp.int32)
    out, lse = _paged_sdpa(plan, q, inputs.key, inputs.value, page_table, seq_kv, reference)
    if config.ragged_queries:
        return out, lse
    return jnp.reshape(out, config.batch_shape + (T, config.num_q_heads, config.value_head_dim)), jnp.reshape(
        lse, config.batch_shape + (T, config.num_q_heads)
    )
