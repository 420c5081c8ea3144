"""`implementation="xla"`: materialise all scores; the readable reference. Gradients by JAX autodiff."""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from .. import canonical, explicit_axes, fp8 as fp8_lib
from ..config import AttentionConfig, AttentionInputs
from . import scores
from .base import Context, Implementation


def attend(config: AttentionConfig, problem: canonical.Problem) -> tuple[jax.Array, jax.Array]:
    """Canonical attention: `out [B, T, N, Hv]` in the query dtype and float32 `lse [B, T, N]` (its rows with
    nothing visible as `scores.returned_lse` says).

    With `config.fp8` the probabilities are rounded as an FP8 kernel rounds them (`fp8.py`; the problem then holds
    the dequantized float32 inputs and `fp8.emulate` rounds the output).
    """
    B, T, N, _ = problem.query.shape
    S = problem.key.shape[1]
    q5 = scores.grouped_query(config, problem.query)
    s = scores.raw_scores(config, q5, problem.key, problem.bias, scale=problem.scale)  # [B, K, G, T, S]
    allowed = scores.visible(config, problem, 0, S, problem.mask)
    if config.modifiers is not None:
        # score_mod and mask_mod as written, vectorised; autodiff differentiates them (closures included). Under
        # explicit mesh axes they run on automatic ones, the arrays they close over entering as operands: traced.
        indices = scores.modifier_indices(config, problem, 0, S)
        args = scores.grouped_args(config, problem.score_mod_args)
        explicit = explicit_axes.any_explicit(problem)
        fns = scores.traced_fns(config.modifiers, s.dtype) if explicit else scores.modifier_fns(config.modifiers)
        s, allowed = scores.modify(fns, s, allowed, indices, args)
    s = scores.soft_cap(config, s)
    sinks = None if problem.sinks is None else scores.grouped_sinks(config, problem.sinks)
    if config.fp8 is not None:
        weights, denominator, lse = _rounded_probabilities(s, allowed, sinks)
    else:
        weights, lse = softmax_with_lse(s, allowed, sinks)
        denominator = None
    if problem.dropout_seeds is not None:
        keep = scores.dropout_keep(config, problem.dropout_seeds, B, T, 0, S)
        weights = jnp.where(keep, weights / (1.0 - config.dropout_rate), 0.0)

    out = scores.rows_dot(
        weights.astype(problem.value.dtype),
        problem.value,
        preferred_element_type=scores.accumulator(problem.value.dtype),
        precision=scores.precision(problem.value.dtype),
    )
    if denominator is not None:
        out = out / denominator[..., None]
    out = jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (B, T, N, config.value_head_dim))
    out = out.astype(problem.query.dtype)
    lse = jnp.transpose(jnp.reshape(lse, (B, N, T)), (0, 2, 1))
    return out, scores.returned_lse(config, lse)


@jax.custom_jvp
def softmax_with_lse(s: jax.Array, allowed: jax.Array, sinks: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """`(p, lse)`: the softmax of scores `s [..., S]` over the `allowed` entries (0 elsewhere and on rows with
    nothing visible), with the sink logits `[...]` in every denominator, and its log-sum-exp (`scores.hidden_score`
    where nothing is visible and there is no sink).

    Its derivative is written out (`dp = p (ds - Σ p ds)`, `dlse = Σ p ds + p_sink dsink`) as jax.nn's softmax does:
    the backward is one pass over the probabilities instead of autodiff through the max, exp, sum and divide.
    """
    unnormalised, denominator, lse = scores.statistics(s, allowed, sinks)
    return unnormalised / denominator[..., None], lse


@softmax_with_lse.defjvp
def _softmax_with_lse_jvp(primals, tangents):
    s, allowed, sinks = primals
    d_s, _, d_sinks = tangents
    p, lse = softmax_with_lse(s, allowed, sinks)
    d_s = jnp.where(allowed, d_s, 0.0)  # hidden entries may hold anything (a modifier's -inf)
    d_lse = jnp.sum(p * d_s, axis=-1)
    if sinks is not None:
        d_lse = d_lse + jnp.exp(sinks - lse) * d_sinks  # the sink's probability; lse >= sinks
    return (p, lse), (p * (d_s - d_lse[..., None]), d_lse)


def _rounded_probabilities(s: jax.Array, allowed: jax.Array, sinks: jax.Array | None):
    """FP8 (`fp8.py`): `(P8, the row sums, lse)` with `P8` the E4M3 rounding of `exp(s - m)` against the final row
    max; the output is divided by the unrounded row sum after the PV product. Differentiated by autodiff."""
    unnormalised, denominator, lse = scores.statistics(s, allowed, sinks)
    return fp8_lib.Rounding.probabilities(unnormalised), denominator, lse


@dataclasses.dataclass(frozen=True)
class Xla(Implementation):
    """`implementation="xla"`: plain JAX that materialises every score; the readable reference. Pass an instance
    wherever `implementation` takes a name (alone or in a sequence); the name stands for `Xla()`. It has no options."""

    name: ClassVar[str] = "xla"

    def decline_reason(self, config: AttentionConfig, context: Context) -> str | None:
        return None

    def attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        # Serves every call it accepts by itself: nothing in `context` changes how.
        if config.fp8 is not None:
            return fp8_lib.emulate(config, inputs, lambda problem: attend(config, problem))
        problem = canonical.canonicalize(config, inputs)
        return canonical.restore(config, *attend(config, problem), problem)
