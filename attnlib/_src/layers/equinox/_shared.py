"""What both Equinox layers share: the default parameter dtype and the dropout plan of a call."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .. import _common


def _default_dtype() -> Any:
    # As `equinox._misc.default_floating_dtype` (private): float64 in JAX's x64 mode, else float32.
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32  # pyright: ignore[reportAttributeAccessIssue]


def _dropout_plan(
    dropout: eqx.nn.Dropout, key: PRNGKeyArray | None, inference: bool | None, layer: str
) -> tuple[float, PRNGKeyArray | None]:
    """`(dropout_rate, dropout_key)` for `attnlib.attention`, following `equinox.nn.Dropout.__call__`'s rules."""
    if inference is None:
        inference = dropout.inference
    # Same order as Equinox: a Python zero rate or inference mode switches dropout off before the rate is read,
    # so a model whose `dropout.p` is traced (plain `jax.jit`) still runs with `inference=True`.
    if isinstance(dropout.p, (int, float)) and dropout.p == 0:
        return 0.0, None
    if inference:
        return 0.0, None
    rate = _common.dropout_rate("dropout.p", dropout.p)
    if rate == 0.0:
        return 0.0, None
    if key is None:
        raise RuntimeError(
            f"{layer} applies dropout (dropout.p={rate}, inference=False) and requires a PRNG `key`. Got key=None. "
            "Pass `key=...`, or `inference=True` (or `equinox.nn.inference_mode`) to switch dropout off."
        )
    return rate, key
