"""Haiku modules backed by `attnlib.attention` (imports Haiku; `import attnlib` does not).

`MultiHeadAttention` is a drop-in for `haiku.MultiHeadAttention` (same parameter names); `DotProductAttention` is the
attention core without projections.
"""

from ._src.layers.haiku import (
    DotProductAttention as DotProductAttention,
    MultiHeadAttention as MultiHeadAttention,
)
