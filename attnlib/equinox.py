"""Equinox layers backed by `attnlib.attention` (imports Equinox; `import attnlib` does not).

`MultiheadAttention` is a drop-in for `equinox.nn.MultiheadAttention`; `DotProductAttention` is the attention core
without projections.
"""

try:
    import equinox as _equinox  # noqa: F401
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "attnlib.equinox needs Equinox: pip install equinox (or attnlib's `equinox` extra: "
        "pip install 'attnlib[equinox]')."
    ) from e

from ._src.layers.equinox import (
    DotProductAttention as DotProductAttention,
    MultiheadAttention as MultiheadAttention,
)
