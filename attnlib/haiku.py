"""Haiku modules backed by `attnlib.attention` (imports Haiku; `import attnlib` does not).

`MultiHeadAttention` is a drop-in for `haiku.MultiHeadAttention` (same parameter names); `DotProductAttention` is the
attention core without projections.
"""

try:
    import haiku as _haiku  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "attnlib.haiku needs Haiku: pip install dm-haiku (or attnlib's `haiku` extra: pip install 'attnlib[haiku]')."
    ) from e

from ._src.layers.haiku import (
    DotProductAttention as DotProductAttention,
    MultiHeadAttention as MultiHeadAttention,
)
