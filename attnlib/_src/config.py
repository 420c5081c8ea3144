"""The validated, static description of one attention call, shared by every implementation.

Shape letters (jax.nn): `B` batch (flattened `*B`), `T` query length, `S` key/value length, `N` query heads,
`K` key/value heads, `H` query/key head dim, `Hv` value head dim, `P` pages.
"""

import dataclasses
from typing import Any, Literal

import jax
import numpy as np

from .kv_layouts import PoolLayout
from .modifiers import Modifiers


Layout = Literal["dense", "thd", "paged"]
Alignment = Literal["top_left", "bottom_right"]

IMPLEMENTATIONS = ("cudnn", "pallas_tpu", "xla_chunked", "xla")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one call: what a graph, a cache key or a dispatch decision depends on.

    Attributes:
        layout: `"dense"` (`[*B, T, N, H]`), `"thd"` (packed tokens `[T, N, H]` with `cu_seqlens`) or `"paged"`
            (key/value page pools with a page table).
        batch_shape: the `*B` dims of `query` (empty when unbatched or THD).
        unbatched: `query` was `[T, N, H]` without THD.
        q_len, kv_len: `T` and `S` (for paged: `pages_per_seq * page_size`).
        num_q_heads, num_kv_heads: `N` and `K`.
        head_dim, value_head_dim: `H` and `Hv`.
        dtype: the shared dtype of query, key and value.
        scale: the logit scale (already defaulted to `1/sqrt(H)`); None when it is an array (a traced or learned
            temperature): then `AttentionInputs.scale` holds it and one graph serves every value.
        is_causal, diagonal_alignment: causal mask and where its diagonal sits.
        window: `(left, right)` or None.
        bias_shape, mask_shape: the caller's shapes, or None.
        has_q_lengths, has_kv_lengths: padding lengths given.
        has_segments: packed rows via segment ids.
        separate_kv_structure: keys carry their own sequence structure (`kv_segment_ids` or `cu_seqlens_kv` given),
            rather than the queries'.
        max_segments_per_row: the static bound on segments per row, or None.
        num_sequences: THD: `B` of `cu_seqlens` (`len(cu_seqlens) - 1`); paged: rows of the page table.
        max_seqlen_q, max_seqlen_kv: THD static bounds (default: the token counts).
        page_size, pages_per_seq, num_pages: paged-KV geometry.
        logits_soft_cap: `c` in `c * tanh(s / c)`, or None.
        has_sinks: per-head sink logits given.
        dropout_rate: the dropout probability (0 = off).
        return_residual: also return `lse`.
        deterministic_backward: the backward must be bitwise reproducible.
        modifiers: the call's `score_mod` / `mask_mod` (traced, with a structural key), or None.
        fp8: `"current"` (16/32-bit inputs quantized by the call), `"scaled"` (float8_e4m3fn inputs with
            `Fp8Scales`) or None (see `fp8.py`).
        fp8_output_dtype: with `fp8="scaled"`, `Fp8Scales.output_dtype`; else None.
        max_logit: `return_max_logit=True`: an implementation may return each row's largest logit with its
            results (cuDNN's dense graphs do, `Implementation.attention`); it never changes which one serves.
        typed_varying: the arrays carry the manual mesh axes they vary over: the call is traced inside
            `jax.shard_map` with `check_vma=True` (kernels must then type their outputs' variation).
        ragged_queries: paged only: the queries are packed tokens `[T, N, H]` with `cu_seqlens_q` (one range per
            page-table row: a mixed batch of prefill chunks and decodes); `batch_shape` is then `()` and
            `num_sequences` the page table's rows.
        kv_layout: paged only: the pools' memory layout (`kv_layouts.py`): `"token_major"` for bare arrays, a
            `PagedKVCache`'s layout otherwise (`key` and `value` are then its pools, the same array for
            `"combined"`).
        matmul_precision: the caller's `jax_default_matmul_precision` when the call was traced (`precision.py`):
            None for the device's default, else its name (`"highest"`, `"float32"`, ...).
    """

    layout: Layout
    batch_shape: tuple[int, ...]
    unbatched: bool
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: np.dtype
    scale: float | None
    is_causal: bool
    diagonal_alignment: Alignment
    window: tuple[int, int] | None
    bias_shape: tuple[int, ...] | None
    mask_shape: tuple[int, ...] | None
    has_q_lengths: bool
    has_kv_lengths: bool
    has_segments: bool
    max_segments_per_row: int | None
    num_sequences: int | None
    max_seqlen_q: int | None
    max_seqlen_kv: int | None
    page_size: int | None
    pages_per_seq: int | None
    num_pages: int | None
    logits_soft_cap: float | None
    has_sinks: bool
    dropout_rate: float
    return_residual: bool
    deterministic_backward: bool
    modifiers: Modifiers | None = None
    fp8: Literal["current", "scaled"] | None = None
    fp8_output_dtype: np.dtype | None = None
    max_logit: bool = False
    separate_kv_structure: bool = False
    typed_varying: bool = False
    ragged_queries: bool = False
    kv_layout: str = "token_major"
    matmul_precision: str | None = None

    @property
    def output_dtype(self) -> np.dtype:
        """The dtype of the result: `dtype`, or `Fp8Scales.output_dtype` for pre-quantized inputs."""
        return self.dtype if self.fp8_output_dtype is None else self.fp8_output_dtype

    @property
    def batch_size(self) -> int:
        """The flattened `*B` (1 when unbatched or THD)."""
        return int(np.prod(self.batch_shape, dtype=np.int64))

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (`N // K`)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def pool_layout(self) -> PoolLayout:
        """Paged calls: the pools' layout with the true head dims."""
        return PoolLayout(self.kv_layout, self.head_dim, self.value_head_dim)

    @property
    def has_mask(self) -> bool:
        return self.mask_shape is not None

    @property
    def has_modifiers(self) -> bool:
        """A `score_mod` or `mask_mod` was given."""
        return self.modifiers is not None


def _array(**kwargs: Any) -> Any:
    """A field that is also an array argument of `attnlib.attention` (given as an array-like, `jnp.asarray`'d)."""
    return dataclasses.field(metadata={"array_argument": True}, **kwargs)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The arrays of one call, as the caller gave them (after `jnp.asarray`); None where absent.

    `dropout_key` is kept as given (a typed or raw PRNG key). `score_mod_args` are the arrays `score_mod` /
    `mask_mod` see one element of (each broadcastable to `[*B, N, T, S]`; empty without them). `fp8_scales`: the
    `Fp8Scales` of pre-quantized inputs (`config.fp8 == "scaled"`), else None. `scale`: the 0-d float array of a
    scale given as an array (`config.scale` is then None), else None.
    """

    query: jax.Array = _array()
    key: jax.Array = _array()
    value: jax.Array = _array()
    bias: jax.Array | None = _array(default=None)
    mask: jax.Array | None = _array(default=None)
    query_seq_lengths: jax.Array | None = _array(default=None)
    key_value_seq_lengths: jax.Array | None = _array(default=None)
    q_segment_ids: jax.Array | None = _array(default=None)
    kv_segment_ids: jax.Array | None = _array(default=None)
    cu_seqlens_q: jax.Array | None = _array(default=None)
    cu_seqlens_kv: jax.Array | None = _array(default=None)
    page_table: jax.Array | None = _array(default=None)
    sinks: jax.Array | None = _array(default=None)
    dropout_key: jax.Array | None = None
    score_mod_args: tuple = ()
    fp8_scales: Any = None
    scale: Any = None


ARRAY_ARGUMENTS = tuple(f.name for f in dataclasses.fields(AttentionInputs) if f.metadata.get("array_argument"))
"""The array arguments of `attnlib.attention`, in signature order: what `attention` converts with `jnp.asarray` and
`explain` accepts as `jax.ShapeDtypeStruct`s."""
