"""Which keys a query may see: the causal / window / segment rule shared by the plain-JAX implementations."""

import jax
import jax.numpy as jnp

from .band import Band


def visible(
    q_segment: jax.Array | None,
    q_position: jax.Array,
    kv_segment: jax.Array | None,
    kv_position: jax.Array,
    *,
    is_causal: bool,
    window: tuple[int, int] | None,
) -> jax.Array:
    """Bool `[B, T, S]`: query `i` may attend to key `j`.

    Args:
        q_segment, q_position: int `[B, T]` sequence ids (0 = none; None = one sequence per row) and aligned
            positions (see `positions.py`).
        kv_segment, kv_position: int `[B, S]` sequence ids (None with `q_segment`) and positions.
        is_causal: keys after the (aligned) query position are hidden.
        window: `(left, right)`: only keys at aligned offsets `-left … +right` are visible.
    """
    allowed = jnp.ones((q_position.shape[0], q_position.shape[1], kv_position.shape[1]), bool)
    if q_segment is not None:
        qs = q_segment[:, :, None]
        allowed = (qs != 0) & (qs == kv_segment[:, None, :])
    offset = kv_position[:, None, :] - q_position[:, :, None]
    return allowed & Band.from_mask(is_causal=is_causal, window=window).allows(offset)
