"""What the Equinox and Haiku layers share: argument checks, softmax types / sinks, and the one attention call.

Imports neither framework. Messages follow attnlib's style: the argument in backticks, what was required, then
"Got …".
"""

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

from .. import argument_checks, dispatch
from ..attention import attention
from ..backends.base import Implementation


SoftmaxType = Literal["vanilla", "off_by_one", "learnable"]
SOFTMAX_TYPES: tuple[str, ...] = ("vanilla", "off_by_one", "learnable")
_ATTENTION_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


# ------------------------------------------------------------------------------------------------------------------
# constructor checks: each returns the normalised (hashable, static) value or raises ValueError naming the argument


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive int. Got {name}={value!r}.")
    return int(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Got {name}={value!r}.")
    return value


def num_kv_heads(value: Any, num_heads: int) -> int:
    value = positive_int("num_kv_heads", value)
    if num_heads % value != 0:
        raise ValueError(
            f"`num_kv_heads` must divide `num_heads` (query head n uses key/value head n // (num_heads // "
            f"num_kv_heads)). Got num_heads={num_heads}, num_kv_heads={value}."
        )
    return value


def local_window_size(value: Any) -> int | tuple[int, int] | None:
    argument_checks.parse_window(value)  # raises ValueError naming `local_window_size`
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else value  # type: ignore[return-value]


def softmax_type(value: Any) -> str:
    if value not in SOFTMAX_TYPES:
        raise ValueError(f"`softmax_type` must be one of {list(SOFTMAX_TYPES)}. Got softmax_type={value!r}.")
    return value


def logits_soft_cap(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"`logits_soft_cap` must be None or a positive finite float. Got logits_soft_cap={value!r}.")
    return float(value)


def fp8(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value == "current"):
        return value
    raise ValueError(
        "`fp8` must be None or 'current' (a layer quantizes its own projections; pre-quantized inputs with "
        f"attnlib.Fp8Scales go to attnlib.attention). Got fp8={value!r}."
    )


def scale(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"`scale` must be None or a finite float. Got scale={value!r}.")
    return float(value)


def dropout_rate(name: str, value: Any) -> float:
    """A static dropout probability in `[0, 1)`; a traced value cannot choose attnlib's static dropout."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"`{name}` must be a concrete Python float: attnlib's dropout rate is static. Got a traced value "
            f"{value!r} (keep it out of `jax.jit`'s traced arguments, e.g. with `equinox.filter_jit`)."
        )
    if (
        isinstance(value, bool)
        or not isinstance(value, (numbers.Real, jax.Array))
        or getattr(value, "ndim", 0) != 0
        or not 0.0 <= float(value) < 1.0
    ):
        raise ValueError(f"`{name}` must be a float in [0, 1). Got {name}={value!r}.")
    return float(value)


def diagonal_alignment(value: Any) -> str:
    if value not in ("top_left", "bottom_right"):
        raise ValueError(
            f"`diagonal_alignment` must be 'top_left' or 'bottom_right'. Got diagonal_alignment={value!r}."
        )
    return value


def modifier(name: str, value: Any) -> Callable | None:
    """`score_mod` / `mask_mod`: None or a callable (kept as given: it is static, part of the layer's structure)."""
    if value is not None and not callable(value):
        signature = (
            "score_mod(score, batch, head, q_idx, kv_idx, *args)"
            if name == "score_mod"
            else "mask_mod(batch, head, q_idx, kv_idx, *args)"
        )
        raise TypeError(f"`{name}` must be None or a function `{signature}`. Got {name}={value!r}.")
    return value


def implementation(value: Any) -> dispatch.ImplementationRequest:
    dispatch.requested_implementations(value)  # raises ValueError naming `implementation`
    if value is None or isinstance(value, (str, Implementation)):
        return value
    return tuple(value)


# ------------------------------------------------------------------------------------------------------------------
# call-time helpers


def attention_dtype(layer: str, x: jax.Array) -> None:
    """The projected heads must have a dtype attnlib computes in."""
    if x.dtype not in _ATTENTION_DTYPES:
        raise TypeError(
            f"{layer} computes attention in float16, bfloat16, float32 or float64, but the projected heads have "
            f"dtype {x.dtype}. Got heads.dtype={x.dtype}."
        )


def bool_mask(mask: Any) -> jax.Array | None:
    """A host-layer mask as attnlib's bool mask: like `jnp.where(mask, …)`, any nonzero value means "may attend"."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask.astype(jnp.bool_)


def sinks_for(kind: str, learned: jax.Array | None, num_heads: int, dtype: Any) -> jax.Array | None:
    """The `sinks` argument of `attention` for a softmax type: None, zeros (off-by-one) or the learned `[N]`."""
    if kind == "vanilla":
        return None
    if kind == "off_by_one":
        return jnp.zeros((num_heads,), dtype)
    assert learned is not None
    return learned


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    sinks: jax.Array | None,
    dropout_rate: float,
    dropout_key: Any,
    implementation: str | Sequence[str] | None,
    **options: Any,
) -> Any:
    """The one `attnlib.attention` call behind every layer.

    A `PagedKVCache` as `key` (with `value=None`) reaches `attnlib.attention` unchanged, which unpacks it.
    """
    if dropout_rate == 0.0:
        dropout_key = None
    return attention(
        query,
        key,
        value,
        bias,
        mask,
        sinks=sinks,
        dropout_rate=dropout_rate,
        dropout_key=dropout_key,
        implementation=implementation,
        **options,
    )
