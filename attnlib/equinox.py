"""Equinox layers backed by `attnlib.attention` (imports Equinox; `import attnlib` does not).

`MultiheadAttention` is a drop-in for `equinox.nn.MultiheadAttention`; `DotProductAttention` is the attention core
without projections.
"""

from ._src.layers.equinox import (
    DotProductAttention as DotProductAttention,
    MultiheadAttention as MultiheadAttention,
)
