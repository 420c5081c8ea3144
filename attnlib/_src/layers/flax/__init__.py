"""Flax's `attention_fn` backed by `attnlib.attention` (imports Flax: reached through `attnlib.flax` only)."""

from .dot_product import dot_product_attention as dot_product_attention
