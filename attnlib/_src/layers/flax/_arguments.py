"""Flax's attention arguments mapped onto `attnlib.attention`'s: dtype promotion, dropout, precision, and the
arguments a fused kernel cannot honour (declined with the argument's name).

Messages follow attnlib's style: the argument in backticks, what was required, then "Got …".
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as linen_dtypes

from .. import _common


def flag(name: str, value: Any) -> bool:
    """A Python or NumPy bool (Flax's flags are static: they choose the computation)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be a bool. Got {name}={value!r}.")
    return bool(value)


def decline_einsums(**einsums: Any) -> None:
    """`einsum_dot_general`, `qk_attn_weights_einsum`, `attn_weights_value_einsum`: only None (Flax's default)."""
    for name, value in einsums.items():
        if value is not None:
            raise NotImplementedError(
                f"`{name}` is not supported by attnlib.flax.dot_product_attention: the fused attention has no einsum "
                f"or dot_general to replace (quantized einsums, e.g. AQT, need Flax's own dot_product_attention). "
                f"Pass {name}=None. Got {name}={value!r}."
            )


def promote(query: Any, key: Any, value: Any, dtype: Any, promote_dtype: Callable | None) -> tuple[jax.Array, ...]:
    """`query`, `key`, `value` in one dtype, as Flax does before attending: `dtype` when given, else the promoted
    dtype of the three (made inexact). `promote_dtype` (flax.nnx's keyword) replaces Flax's promotion: it is called
    as `promote_dtype((query, key, value), dtype=dtype)`."""
    if promote_dtype is None:
        return tuple(linen_dtypes.promote_dtype(query, key, value, dtype=dtype))
    if not callable(promote_dtype):
        raise TypeError(
            "`promote_dtype` must be None or a function `promote_dtype((query, key, value), dtype=dtype)` (as "
            f"flax.nnx.nn.dtypes.promote_dtype). Got promote_dtype={promote_dtype!r}."
        )
    return tuple(promote_dtype((query, key, value), dtype=dtype))


def _is_key(x: Any) -> bool:
    """A PRNG key as Flax's dropout takes it: a typed key array `[]` or a raw `uint32[2]` key."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        return False
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x.shape == ()
    return x.dtype == np.uint32 and x.shape == (2,)


def dropout(dropout_rate: Any, dropout_rng: Any, deterministic: bool) -> tuple[float, jax.Array | None]:
    """`(dropout_rate, dropout_key)` for `attnlib.attention`, with Flax's rule: dropout runs when
    `not deterministic and dropout_rate > 0`."""
    if deterministic:
        return 0.0, None
    rate = _common.dropout_rate("dropout_rate", dropout_rate)
    if rate == 0.0:
        return 0.0, None
    if dropout_rng is None:
        raise ValueError(
            f"`dropout_rng` is required when dropout is active (dropout_rate={rate}, deterministic=False). "
            "Got dropout_rng=None. Pass a PRNG key, or deterministic=True to switch dropout off."
        )
    if not _is_key(dropout_rng):
        shape, dtype = getattr(dropout_rng, "shape", None), getattr(dropout_rng, "dtype", None)
        raise TypeError(
            "`dropout_rng` must be a PRNG key (jax.random.key(...) or jax.random.PRNGKey(...)). "
            f"Got {type(dropout_rng).__name__} with shape={shape}, dtype={dtype}."
        )
    return rate, dropout_rng


def _one_precision(precision: Any) -> str:
    """One Flax precision as the name of a `jax.default_matmul_precision` setting (aliases made one name:
    `"float32"` and `"highest"` are `"highest"`)."""
    if isinstance(precision, jax.lax.Precision):
        return precision.name.lower()
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return "default" if precision == jax.lax.DotAlgorithmPreset.DEFAULT else precision.name
    if isinstance(precision, str):
        try:
            return jax.lax.Precision(precision.lower()).name.lower()  # "float32", "bfloat16", "fastest", ...
        except ValueError:
            pass
        if precision.upper() in jax.lax.DotAlgorithmPreset.__members__:
            return _one_precision(jax.lax.DotAlgorithmPreset[precision.upper()])
    if isinstance(precision, jax.lax.DotAlgorithm):
        raise NotImplementedError(
            "`precision` as a custom jax.lax.DotAlgorithm is not supported by attnlib.flax.dot_product_attention: "
            "attnlib takes the precision of its matrix products from jax.default_matmul_precision, which accepts "
            f"jax.lax.Precision values and jax.lax.DotAlgorithmPreset names. Got precision={precision!r}."
        )
    raise ValueError(
        "`precision` must be None, a jax.lax.Precision or its name (e.g. 'highest', 'float32', 'bfloat16'), a "
        "jax.lax.DotAlgorithmPreset or its name, or a pair of one of these. "
        f"Got precision={precision!r}."
    )


def matmul_precision(precision: Any) -> str | None:
    """Flax's `precision` as a `jax.default_matmul_precision` setting for the attention call (None: leave the
    caller's setting). A pair of operand precisions must name one setting: attnlib has one for all its products."""
    if precision is None:
        return None
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        first, second = (_one_precision(p) for p in precision)
        if first != second:
            raise NotImplementedError(
                "`precision` with two different operand precisions is not supported by "
                "attnlib.flax.dot_product_attention: attnlib applies one precision to every matrix product of the "
                f"call (jax.default_matmul_precision). Pass one of them. Got precision={precision!r}."
            )
        return first
    return _one_precision(precision)


def attention_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The extra keyword arguments forwarded to `attnlib.attention` (`dropout_key` is Flax's `dropout_rng`)."""
    if "dropout_key" in kwargs:
        raise TypeError(
            "`dropout_key` is not an argument of attnlib.flax.dot_product_attention: pass the key as Flax's "
            "`dropout_rng`. Got dropout_key."
        )
    return kwargs
