"""What both Haiku modules share: the dropout rate and key of a call, and the `sinks` parameter."""

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from .. import _common


def _dropout(default: float, override: float | None, dropout_key: Any) -> tuple[float, Any]:
    """`(dropout_rate, dropout_key)`: the call's rate (else the module's) and, when > 0, a key (else Haiku's)."""
    rate = _common.dropout_rate("dropout_rate", default if override is None else override)
    if rate == 0.0:
        return 0.0, None
    if dropout_key is None:
        dropout_key = hk.next_rng_key()  # raises Haiku's own error when `apply` got no rng
    return rate, dropout_key


def _sinks(softmax_type: str, num_heads: int, dtype: Any) -> jax.Array | None:
    """The sinks for a softmax type; `"learnable"` creates / reads the parameter `sinks` `[num_heads]` (zeros)."""
    learned = None
    if softmax_type == "learnable":
        learned = hk.get_parameter("sinks", [num_heads], dtype, init=jnp.zeros)
    return _common.sinks_for(softmax_type, learned, num_heads, dtype)
