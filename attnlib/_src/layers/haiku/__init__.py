"""Haiku modules, one per file, re-exported here (imports Haiku: reached through `attnlib.haiku` only)."""

from .dot_product import DotProductAttention as DotProductAttention
from .multihead import MultiHeadAttention as MultiHeadAttention
