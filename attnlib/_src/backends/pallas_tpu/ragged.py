"""Paged key/value attention on TPU for any number of queries per sequence: JAX's bundled Pallas
`ragged_paged_attention` kernel (the kernel TPU serving engines use) on a `PagedKVCache` in the `"combined"` layout.

The kernel reads one pool `[P, page_size, 2K, D']` (keys at even, values at odd head slots; `D'` a multiple of 128,
padded at `PagedKVCache.create`), packed queries `[T, N, D']` with `cu_q_lens` (one range per sequence: prefill
chunks and single-token decodes mixed in one launch), causal bottom-right per sequence, an optional sliding window
and soft cap; it returns the output only (no log-sum-exp). Dense `[B, T, N, H]` queries are packed as `B` ranges of
`T`. Rows that see no key (past `cu_seqlens_q[-1]`, a sequence with more queries than cached keys, a padding
decode row) get `out = 0`.

Forward only, as `paged.py`: a gradient differentiates the `fallback` dispatch passes (`xla`).

Under `jit` on a mesh the kernel's call partitions over the heads (`partitioning.RAGGED`): with the query heads and
the pool's key/value heads split over a mesh axis (tensor parallelism), each device runs the kernel on its own
heads and its slice of the pool, with no communication; the per-sequence operands are replicated. A split that
leaves a shard a head count the kernel cannot tile (`_kv_heads_tile`) keeps the heads whole (logged).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import positions
from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from .. import kernel_settings
from ..base import Fallback, fallback_gradients
from . import partitioning
from .paged import output_only_reason, PagedPlan, TPU_PAGE_SIZE_MULTIPLE


def _kv_heads_tile(num_kv_heads: int, dtype: np.dtype) -> bool:
    """Whether the kernel can tile `2K` combined heads of `dtype` (its `get_min_heads_per_blk` rule)."""
    packing = 4 // np.dtype(dtype).itemsize
    combined = 2 * num_kv_heads
    if combined % packing:
        return False
    combined //= packing
    return combined in (1, 2, 4, 8) or combined % 8 == 0


def decline_reason(config: AttentionConfig, *, on_tpu: bool) -> str | None:
    """Why the ragged paged kernel cannot serve the paged call `config` on a `"combined"` cache (a sentence naming
    the feature and the limit), or None. The features splash declines for every layout are
    `implementation.feature_reason`'s."""
    if config.dtype not in (np.dtype("bfloat16"), np.dtype("float32")):
        return f"{config.dtype} inputs with a paged KV cache are not supported: bfloat16 and float32"
    reason = output_only_reason(config, "JAX's ragged paged-attention kernel")
    if reason is not None:
        return reason
    if not config.ragged_queries and config.q_len > 1 and config.has_q_lengths:
        return (
            "`query_seq_lengths` with T > 1 queries per sequence on a paged KV cache are not supported: pass the "
            "queries packed, with `cu_seqlens_q`"
        )
    if not _kv_heads_tile(config.num_kv_heads, config.dtype):
        return (
            f"K={config.num_kv_heads} key/value heads are not supported by JAX's ragged paged-attention kernel in "
            f"{config.dtype} (it tiles 2K combined heads: K of 1, 2, 4 or a multiple of 8 in bfloat16; 1, 2 or a "
            "multiple of 4 in float32)"
        )
    if on_tpu and config.page_size % TPU_PAGE_SIZE_MULTIPLE:
        return (
            f"paged KV caches with pages of {config.page_size} tokens are not served on a TPU: attnlib gives JAX's "
            f"ragged paged-attention kernel multiples of {TPU_PAGE_SIZE_MULTIPLE}"
        )
    band = Band.of(config)
    decode_rows = not config.ragged_queries and config.q_len == 1
    if decode_rows:
        sees_to_the_end = band.right is None or (band.bottom_right and band.right >= 0)
    else:
        sees_to_the_end = band.bottom_right and band.right == 0
    if not sees_to_the_end or (band.left is not None and not band.bottom_right):
        return (
            "with a paged KV cache only causal attention aligned bottom-right (or one decode query that sees every "
            "key), optionally with a window to the left, is supported; got "
            f"is_causal={config.is_causal}, local_window_size={config.window}, "
            f"diagonal_alignment={config.diagonal_alignment!r}"
        )
    return None


KV_BLOCK_TOKENS = 512
"""Key tokens per kernel step where JAX's tuned table has no entry (it covers caches of at most 1280 tokens per
sequence; its default of 128 pages per step overflows the 16 MiB of scoped VMEM on a v5e for 32-token pages and
16 combined heads): the most pages that hold at most this many tokens (one page when a page is larger)."""

QUERIES_PER_BLOCK = 32
"""Query tokens per kernel step where the table has no entry (the kernel's own default)."""


INTERPRET_UNSUPPORTED = (
    "pallas_tpu: a \"combined\" paged cache runs JAX's ragged_paged_attention kernel, which Pallas interpret mode "
    "cannot run (JAX 0.10.2 to 0.12.1: the kernel reshapes a VMEM ref, which neither the HLO interpreter nor TPU "
    "interpret mode implements), so PallasTpu(interpret=True) cannot serve it. Run it on a TPU; off a TPU use "
    "implementation='xla' or 'xla_chunked', or a \"head_major\" or \"token_major\" cache (cache.to_layout(...)), "
    "whose decode kernel interprets."
)


def kernel_blocks(q, pool, page_table, *, interpret: bool) -> dict:
    """`num_kv_pages_per_block` and `num_queries_per_block` for the kernel: its table tuned per TPU generation
    where that has the shape, else `KV_BLOCK_TOKENS` / `QUERIES_PER_BLOCK`."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes as tuned

    _, page_size, combined, head_dim = pool.shape
    pages_per_seq = page_table.shape[1]
    if not interpret:
        q_heads, kv_heads = kernel.get_min_heads_per_blk(q.shape[1], combined, q.dtype, pool.dtype)
        key = tuned.simplify_key(
            (q.dtype, pool.dtype, q_heads, kv_heads // 2, head_dim, page_size, q.shape[0], pages_per_seq)
        )
        table = tuned.TUNED_BLOCK_SIZES.get(tuned.get_device_name(), {})
        if tuned.get_tpu_version() >= 5 and key in table:
            pages, queries = table[key]
            return dict(num_kv_pages_per_block=min(pages_per_seq, pages), num_queries_per_block=min(q.shape[0], queries))
    pages = max(1, min(pages_per_seq, KV_BLOCK_TOKENS // page_size))
    return dict(num_kv_pages_per_block=pages, num_queries_per_block=min(q.shape[0], QUERIES_PER_BLOCK))


def ragged_kernel(q, pool, kv_lens, page_table, cu_q_lens, *, scale, window_left, soft_cap, interpret):
    """JAX's ragged paged-attention kernel: `[T, N, D']` from queries `[T, N, D']`, the combined pool, kv lengths
    `[B]`, the page table `[B, pages_per_seq]` (entries inside the pool) and `cu_q_lens` `[B + 1]`."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    if interpret:
        raise NotImplementedError(INTERPRET_UNSUPPORTED)
    num_seqs = jnp.array([page_table.shape[0]], jnp.int32)
    blocks = kernel_blocks(q, pool, page_table, interpret=interpret)
    kernel = functools.partial(
        ragged_paged_attention, q, pool, kv_lens, page_table, cu_q_lens, num_seqs, sm_scale=scale,
        sliding_window=None if window_left is None else window_left + 1, soft_cap=soft_cap, **blocks,
    )  # fmt: skip
    with kernel_settings.as_written():
        return kernel()


def _kernel(plan: PagedPlan, query, pool, kv_lens, page_table, cu_q):
    """`ragged_kernel` on the call's operands, as one call partitioned over the heads (`partitioning.RAGGED`)."""
    config = plan.config
    run = functools.partial(
        ragged_kernel, scale=config.scale, window_left=Band.of(config).left, soft_cap=config.logits_soft_cap,
        interpret=plan.interpret,
    )  # fmt: skip
    operands = (query, pool, kv_lens, jnp.clip(page_table, 0, config.num_pages - 1), cu_q)
    return partitioning.call(
        run, partitioning.RAGGED, operands, kv_heads_ok=lambda k: _kv_heads_tile(k, np.dtype(pool.dtype))
    )


def _forward(plan: PagedPlan, q, pool, page_table, cu_q, kv_lens):
    config = plan.config
    D = pool.shape[-1]
    query = jnp.pad(q, ((0, 0), (0, 0), (0, D - config.head_dim)))
    out = _kernel(plan, query, pool, kv_lens, page_table, cu_q)
    out = _zero_rows_without_keys(out[:, :, : config.value_head_dim], cu_q, kv_lens)
    return out, jnp.full(out.shape[:-1], -jnp.inf, jnp.float32)  # no lse: `decline_reason` keeps it dropped


def _zero_rows_without_keys(out, cu_q, kv_lens):
    """`out` `[T, N, Hv]` with the rows that see no key set to 0 (the kernel leaves rows outside `cu_q` unwritten
    and averages masked keys in a row whose keys are all masked). Serving steps rarely have the second kind, and
    unpadded ones neither: the per-token search and the pass over `out` run only on a step that needs them."""
    T = out.shape[0]
    q_count = cu_q[1:] - cu_q[:-1]
    padded = (cu_q[0] > 0) | (cu_q[-1] < T)
    short = jnp.any((q_count > kv_lens) & (q_count > 0))  # a sequence with more queries than cached keys
    zero = lambda valid: jnp.where(valid[:, None, None], out, jnp.zeros((), out.dtype))  # noqa: E731
    token = jnp.arange(T, dtype=jnp.int32)
    branches = (
        lambda: out,
        lambda: zero((token >= cu_q[0]) & (token < cu_q[-1])),
        lambda: zero(_rows_with_keys(cu_q, kv_lens, T)),
    )
    return jax.lax.switch(jnp.where(short, 2, padded.astype(jnp.int32)), branches)


def _rows_with_keys(cu_q, kv_lens, T: int):
    """Whether each of `T` packed query rows sees a key: inside `cu_q` and at a bottom-right aligned position >= 0."""
    tokens = positions.packed_tokens(cu_q, T)
    q_count = cu_q[tokens.sequence + 1] - cu_q[tokens.sequence]
    return tokens.inside & (tokens.offset + kv_lens[tokens.sequence] - q_count >= 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(plan: PagedPlan, q, pool, page_table, cu_q, kv_lens, lengths):
    return _forward(plan, q, pool, page_table, cu_q, kv_lens)


def _ragged_fwd(plan: PagedPlan, q, pool, page_table, cu_q, kv_lens, lengths):
    return _forward(plan, q, pool, page_table, cu_q, kv_lens), (q, pool, page_table, lengths)


def _ragged_bwd(plan: PagedPlan, residuals, cotangents):
    q, pool, page_table, lengths = residuals
    if plan.fallback is None:
        raise NotImplementedError(
            "pallas_tpu: gradients of paged key/value attention are not supported: JAX's ragged paged-attention "
            "kernel is forward only. Use implementation=None (the kernel forward, `xla` backward) or "
            "implementation='xla' to differentiate it."
        )
    config = plan.config
    query = q if config.ragged_queries else jnp.reshape(q, config.batch_shape + (config.q_len,) + q.shape[1:])
    out_cotangent = jnp.reshape(cotangents[0], query.shape[:-1] + (config.value_head_dim,))
    inputs = AttentionInputs(query=query, key=pool, value=pool, page_table=page_table, **lengths)
    dq, dk, dv = fallback_gradients(plan.fallback, config, inputs, out_cotangent, None)
    # `key` and `value` are the one combined pool: its cotangent is the sum of both.
    return jnp.reshape(dq, q.shape), dk + dv, None, None, None, jax.tree.map(lambda _: None, lengths)


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _packed_queries(config: AttentionConfig, inputs: AttentionInputs, kv_lens: jax.Array):
    """Queries `[T, N, H]`, `cu_q_lens` `[B + 1]` and the kv lengths `[B]` the kernel reads: a dense call's `T`
    queries per sequence are `B` ranges of `T`; a padding decode row (`query_seq_lengths` 0, `T == 1` by
    `decline_reason`) is given no keys, so it is zeroed as a row that sees none."""
    if config.ragged_queries:
        return inputs.query, inputs.cu_seqlens_q.astype(jnp.int32), kv_lens
    B, T, N, H = config.num_sequences, config.q_len, config.num_q_heads, config.head_dim
    q = jnp.reshape(inputs.query, (B * T, N, H))
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    if inputs.query_seq_lengths is not None:
        kv_lens = jnp.where(jnp.reshape(inputs.query_seq_lengths, (B,)) > 0, kv_lens, 0)
    return q, cu, kv_lens


def attention(
    config: AttentionConfig, inputs: AttentionInputs, *, interpret: bool, fallback: Fallback | None
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` of a paged call on a `"combined"` cache (`decline_reason(config)` is None) in the caller's
    layout; `lse` is -inf (the call does not return it)."""
    B = config.num_sequences
    kv_lens = jnp.clip(jnp.reshape(inputs.key_value_seq_lengths, (B,)).astype(jnp.int32), 0, config.kv_len)
    q, cu, kv_lens = _packed_queries(config, inputs, kv_lens)
    table = inputs.page_table.astype(jnp.int32)
    lengths = {name: getattr(inputs, name) for name in ("key_value_seq_lengths", "query_seq_lengths", "cu_seqlens_q")}
    out, lse = _ragged(PagedPlan(config, interpret, fallback), q, inputs.key, table, cu, kv_lens, lengths)
    if config.ragged_queries:
        return out, lse
    T, N = config.q_len, config.num_q_heads
    return (
        jnp.reshape(out, config.batch_shape + (T, N, config.value_head_dim)),
        jnp.reshape(lse, config.batch_shape + (T, N)),
    )
