"""`return_max_logit=True` (docs/semantics.md): per batch row (THD: per sequence) and query head, the largest logit any
kept query-key pair reached, for QK-clip / MuonClip. A statistic: not differentiable.

cuDNN's dense graphs return it with the output (`score_max`, `from_implementation`); everywhere else it is
computed by its own blocked plain-JAX pass over the keys (`xla_chunked.row_max`, `max_logit`): memory linear in the
key length.
"""

import jax
import jax.numpy as jnp

from . import canonical, fp8 as fp8_lib, positions as positions_lib
from .backends import scores, xla_chunked
from .band import Band
from .config import AttentionConfig, AttentionInputs


def max_logit(config: AttentionConfig, inputs: AttentionInputs) -> jax.Array:
    """float32 `[*B, N]` (THD and ragged paged queries: `[B, N]` with `B = len(cu_seqlens_q) - 1`; float64 for float64 inputs): the largest
    logit (after bias, `score_mod` and soft cap, before softmax) of any kept pair of the row and head; -inf where
    nothing is kept."""
    problem = canonical.canonicalize(config, inputs)
    if config.fp8 is not None:  # the logits an FP8 kernel computes: from the quantized inputs
        dequantize, _ = fp8_lib.plan(config.fp8, inputs.query, inputs.key, inputs.value, inputs.fp8_scales)
        problem = problem._replace(query=dequantize(problem.query, 0), key=dequantize(problem.key, 1))
    rows = xla_chunked.row_max(config, problem, band=Band.on_indices(config, inputs))  # [B, K, G, T]
    B, K, G, T = rows.shape
    rows = jnp.reshape(rows, (B, K * G, T))
    if config.layout == "thd":
        sequence = positions_lib.batch_index(problem.positions, B, thd=True)[0]  # [T]
        per_token = jnp.transpose(rows[0])  # [T, N]
        hidden = scores.hidden_score(per_token.dtype)
        empty = jnp.full((config.num_sequences, per_token.shape[1]), hidden, per_token.dtype)
        out = empty.at[sequence].max(per_token)
        return jax.lax.stop_gradient(scores.neg_inf_where_empty(out).astype(scores.accumulator(config.dtype)))
    return _per_head(config, scores.neg_inf_where_empty(jnp.max(rows, axis=-1)))


def from_implementation(config: AttentionConfig, maxima: jax.Array) -> jax.Array:
    """`max_logit` as an implementation returned it with its output (`[*B, N]`), as a statistic."""
    return jax.lax.stop_gradient(maxima.astype(scores.accumulator(config.dtype)))


def _per_head(config: AttentionConfig, out: jax.Array) -> jax.Array:
    """`[B, N]` maxima -> `[*B, N]` (`[N]` unbatched), not differentiable."""
    if config.unbatched:
        out = out[0]
    elif not config.ragged_queries:  # ragged paged queries: one row per sequence already
        out = jnp.reshape(out, config.batch_shape + (config.num_q_heads,))
    return jax.lax.stop_gradient(out.astype(scores.accumulator(config.dtype)))
