"""Equinox layers, one per module, re-exported here (imports Equinox: reached through `attnlib.equinox` only)."""

from .dot_product import DotProductAttention as DotProductAttention
from .multihead import MultiheadAttention as MultiheadAttention
