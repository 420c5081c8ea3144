"""Flax support for `attnlib.attention` (imports Flax; `import attnlib` does not).

`dot_product_attention` has the signature of `flax.linen.dot_product_attention` (plus `flax.nnx.dot_product_attention`'s
`promote_dtype` and `is_causal`): pass it as the `attention_fn` of `flax.linen.MultiHeadDotProductAttention` or
`flax.nnx.MultiHeadAttention`.
"""

try:
    import flax as _flax  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "attnlib.flax needs Flax: pip install flax (or attnlib's `flax` extra: pip install 'attnlib[flax]')."
    ) from e

from ._src.layers.flax import dot_product_attention as dot_product_attention
