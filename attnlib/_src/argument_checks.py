"""Checks of one argument each, shared by every entry point (`attention`, context parallelism, the layers).

Each names its argument in backticks, says what was required and ends with what was given; `ValueError` for shapes
and values, `TypeError` for dtypes and kinds. Helpers for the group checks (`feature_checks`, `geometry`) live here
too: dtype tests, shape and broadcast checks, whether an array is concrete.
"""

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import fp8 as fp8_lib


FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def require_int_array(name: str, x: Any) -> None:
    if not _is_int(x.dtype):
        raise TypeError(f"`{name}` must have an integer dtype. Got {name}.dtype={x.dtype}.")


def int_array(name: str, x: Any, shape: tuple[int, ...], meaning: str) -> jax.Array:
    """`x` as an int32 array of `shape` (`meaning` names its axes in the message), or a `TypeError` / `ValueError`
    naming `name`."""
    x = jnp.asarray(x)
    require_int_array(name, x)
    require_shape(name, x, shape, meaning)
    return x.astype(jnp.int32)


def require_shape(name: str, x: Any, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"`{name}` must have shape {meaning}={tuple(expected)}. Got {name}.shape={tuple(x.shape)}.")


def require_bool(name: str, value: Any) -> None:
    """A `TypeError` naming `name` unless `value` is a Python (or NumPy) bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a Python bool. Got {value!r} of type {type(value).__name__}.")


def require_positive_int(name: str, value: Any) -> int:
    """`value` as an int, or a `ValueError` naming `name` when it is not a positive Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"`{name}` must be a positive Python int. Got {value!r}.")
    return int(value)


def is_concrete(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer)


def check_broadcastable(name: str, x: Any, target: tuple[int, ...], meaning: str) -> None:
    shape = tuple(x.shape)
    ok = len(shape) <= len(target) and all(
        d == 1 or d == t for d, t in zip(shape[::-1], target[::-1], strict=False)
    )
    if not ok:
        raise ValueError(
            f"`{name}` must be broadcastable to {meaning}={target}. Got {name}.shape={shape}."
        )


def require_alignment(diagonal_alignment: Any) -> None:
    """A `ValueError` naming `diagonal_alignment` unless it is 'top_left' or 'bottom_right'."""
    if diagonal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"`diagonal_alignment` must be 'top_left' or 'bottom_right'. Got {diagonal_alignment!r}."
        )


def require_sinks(sinks: Any, num_q_heads: int) -> None:
    """A `TypeError` / `ValueError` naming `sinks` unless it is a float array of shape `[N]=(num_q_heads,)`."""
    if not is_float(sinks.dtype):
        raise TypeError(f"`sinks` must have a floating dtype. Got sinks.dtype={sinks.dtype}.")
    require_shape("sinks", sinks, (num_q_heads,), "[N]")


def parse_window(local_window_size: Any) -> tuple[int, int] | None:
    """`local_window_size` as `(left, right)` (None stays None); a `ValueError` naming it when it is not a
    non-negative int or a pair of them."""
    if local_window_size is None:
        return None
    is_count = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0
    if is_count(local_window_size):
        return int(local_window_size), int(local_window_size)
    if (
        isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(is_count(v) for v in local_window_size)
    ):
        return int(local_window_size[0]), int(local_window_size[1])
    raise ValueError(
        "`local_window_size` must be a non-negative int or a pair (left, right) of non-negative ints. "
        f"Got {local_window_size!r}."
    )


def parse_scale(scale: Any, H: int) -> Any:
    """`scale`: None (`1/sqrt(H)`), a finite real number (static: baked into graphs) or a 0-d float array, traced or
    not (a runtime scale: one graph for every value, differentiable). Returns the float or the array."""
    if scale is None:
        return 1.0 / math.sqrt(H)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"`scale` must be a float or a 0-d float array, not a bool. Got {scale!r}.")
    if isinstance(scale, numbers.Real):
        if not math.isfinite(scale):
            raise ValueError(f"`scale` must be finite. Got {scale!r}.")
        return float(scale)
    shape, dtype = getattr(scale, "shape", None), getattr(scale, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"`scale` must be a float or a 0-d float array. Got {type(scale).__name__} {scale!r}.")
    if not jnp.issubdtype(dtype, jnp.floating) or jnp.dtype(dtype) == fp8_lib.E4M3:
        raise TypeError(
            f"`scale` must be a float or a 0-d float array (float16/bfloat16/float32/float64). Got dtype={dtype}."
        )
    if tuple(shape) != ():
        raise ValueError(f"`scale` must be a scalar: a 0-d array, shape (). Got shape={tuple(shape)}.")
    if isinstance(scale, np.ndarray | np.generic) or (
        isinstance(scale, jax.Array) and not isinstance(scale, jax.core.Tracer)
    ):
        if not math.isfinite(float(scale)):
            raise ValueError(f"`scale` must be finite. Got {scale!r}.")
    return scale
