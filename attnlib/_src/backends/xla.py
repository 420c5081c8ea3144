"""`implementation="xla"`: materialise all scores; the readable reference. Gradients by JAX autodiff."""

import jax
import jax.numpy as jnp

from .. import canonical, fp8 as fp8_lib
from ..config import AttentionConfig, AttentionInputs
from . import scores


def attend(config: AttentionConfig, problem: canonical.Problem) -> tuple[jax.Array, jax.Array]:
    """Canonical attention: `out [B, T, N, Hv]` in the query dtype and float32 `lse [B, T, N]`.

    With `config.fp8` the probabilities are rounded as an FP8 kernel rounds them (`fp8.py`; the problem then holds
    the dequantized float32 inputs and `fp8.emulate` rounds the output).
    """
    B, T, N, _ = problem.query.shape
    S = problem.key.shape[1]
    q5 = scores.grouped_query(config, problem.query)
    s = scores.raw_scores(config, q5, problem.key, problem.bias)  # [B, K, G, T, S]
    allowed = scores.visible(config, problem, 0, S, problem.mask)
    if config.modifiers is not None:
        # score_mod and mask_mod as written, vectorised; autodiff differentiates them (closures included).
        indices = scores.modifier_indices(config, problem, 0, S)
        args = scores.grouped_args(config, problem.score_mod_args)
        s, allowed = scores.modify(scores.modifier_fns(config.modifiers), s, allowed, indices, args)
    s = scores.soft_cap(config, s)

    s = jnp.where(allowed, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, initial=-jnp.inf)  # [B, K, G, T]
    if problem.sinks is not None:
        sinks = scores.grouped_sinks(config, problem.sinks)
        row_max = jnp.maximum(row_max, sinks)
    # The softmax is invariant to the shift, so it carries no gradient; rows with nothing visible shift by 0.
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    unnormalised = jnp.exp(s - shift[..., None])
    denominator = jnp.sum(unnormalised, axis=-1)
    if problem.sinks is not None:
        denominator = denominator + jnp.exp(sinks - shift)
    has_mass = denominator > 0
    safe_denominator = jnp.where(has_mass, denominator, 1.0)
    lse = jnp.where(has_mass, shift + jnp.log(safe_denominator), -jnp.inf)
    weights = unnormalised  # normalised after the PV product: one pass over [T, S] fewer
    if config.fp8 is not None:
        weights = fp8_lib.Rounding.probabilities(weights)
    if problem.dropout_seeds is not None:
        keep = scores.dropout_keep(config, problem.dropout_seeds, B, T, 0, S)
        weights = jnp.where(keep, weights / (1.0 - config.dropout_rate), 0.0)

    out = jnp.einsum(
        "bkgts,bskh->bkgth",
        weights.astype(problem.value.dtype),
        problem.value,
        preferred_element_type=scores.accumulator(problem.value.dtype),
        precision=scores.precision(problem.value.dtype),
    )
    out = out / safe_denominator[..., None]
    out = jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (B, T, N, config.value_head_dim))
    out = out.astype(problem.query.dtype)
    lse = jnp.transpose(jnp.reshape(lse, (B, N, T)), (0, 2, 1))
    return out, lse


class _Xla:
    name = "xla"

    def decline_reason(self, config: AttentionConfig, *, explicit: bool) -> str | None:
        if config.fp8 is not None and config.dropout_rate > 0:
            return "dropout together with FP8 attention (`fp8=`) is not supported"
        return None

    def attention(self, config: AttentionConfig, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
        if config.fp8 is not None:
            return fp8_lib.emulate(config, inputs, lambda problem: attend(config, problem))
        return canonical.restore(config, *attend(config, canonical.canonicalize(config, inputs)))


IMPLEMENTATION = _Xla()
