"""Paged key/value decode on TPU: JAX's bundled Pallas paged-attention kernel, one query per sequence.

`jax.experimental.pallas.ops.tpu.paged_attention` reads head-major pools `[K, P, page_size, H']`, takes the query
already scaled, applies the soft cap, and returns the output only (no log-sum-exp). A `PagedKVCache` created with
`layout="head_major"` holds its pools so (head dims padded to 128 lanes at `create`): the call reads them as they
are. Token-major pools (bare arrays, or a `"token_major"` cache) are laid out head-major by each call, padding the
head dim in the same copy (zero columns change no score): a copy of the whole pool per step, which `explain` names.
A `"combined"` cache goes to JAX's ragged paged-attention kernel instead (`ragged.py`). Page-table entries are
clamped into the pool, as on every path (`kv_layouts.PoolLayout.gather`). Rows that see no key (a sequence of length
0, a padding query) get `out = 0`.

The kernel is forward only. As on cuDNN's paged path, a gradient differentiates the `fallback` that dispatch
passes (`xla`, recomputing the attention in plain JAX); with `implementation="pallas_tpu"` named alone there is none
and a gradient raises.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...band import Band
from ...config import AttentionConfig, AttentionInputs
from .. import kernel_settings
from ..base import Fallback, fallback_gradients
from . import blocks, partitioning, unseen_mesh


BLOCK_TOKENS = 512
"""Key tokens per kernel step: `pages_per_compute_block` is the largest divisor of `pages_per_seq` whose pages hold at
most this many tokens (one page when a page is larger). Not tuned on a TPU yet."""


TPU_PAGE_SIZE_MULTIPLE = 16
"""On a TPU, page sizes the kernel is given are multiples of this: JAX tests its paged-attention kernel on TPUs with
pages of 16, 32 and 64 tokens (a bfloat16 tile holds 16 rows); other sizes are left to the plain-JAX path rather than
risk a kernel that does not compile. Interpret mode takes any size."""


def output_only_reason(config: AttentionConfig, kernel: str) -> str | None:
    """What both paged kernels (`kernel` names one) decline alike: they return the output only, have no sink term
    and take a static scale."""
    unsupported = [
        (config.return_residual, f"the log-sum-exp (`return_residual=True`) with a paged KV cache is not supported: "
                                 f"{kernel} returns the output only"),
        (config.has_sinks, f"`sinks` with a paged KV cache are not supported: {kernel} has no sink term and "
                           "returns no log-sum-exp to add one"),
        (config.scale is None, f"an array `scale` with a paged KV cache is not supported: {kernel} takes a static "
                               "scale"),
    ]  # fmt: skip
    return next((reason for declined, reason in unsupported if declined), None)


def decline_reason(config: AttentionConfig, *, on_tpu: bool) -> str | None:
    """Why the paged kernels cannot serve the paged call `config` (a sentence naming the feature and the limit), or
    None; `on_tpu`: for a real TPU (not interpret mode). Pure Python; the features splash declines for every layout
    are `implementation.feature_reason`'s. A `"combined"` cache is the ragged kernel's (`ragged.decline_reason`)."""
    if config.ragged_queries or config.q_len != 1:
        queries = "ragged queries (`cu_seqlens_q`)" if config.ragged_queries else f"T={config.q_len} queries"
        return (
            f"paged KV caches with {queries} per sequence need the cache's \"combined\" layout (JAX's ragged "
            f"paged-attention kernel); this one is {config.kv_layout!r}, whose kernel decodes one query per "
            "sequence: create it with PagedKVCache.create(..., layout=\"combined\") or convert it once with "
            "cache.to_layout(\"combined\")"
        )
    if config.dtype != np.dtype("bfloat16"):
        return (
            f"paged KV caches (`page_table`) with {config.dtype} inputs are not supported: JAX's paged-attention "
            "kernel rounds keys and values to bfloat16"
        )
    reason = output_only_reason(config, "JAX's paged-attention kernel")
    if reason is not None:
        return reason
    if on_tpu and config.page_size % TPU_PAGE_SIZE_MULTIPLE:
        return (
            f"paged KV caches with pages of {config.page_size} tokens are not served on a TPU: JAX's paged-attention "
            f"kernel is tested there with pages of 16, 32 and 64 tokens (attnlib takes multiples of "
            f"{TPU_PAGE_SIZE_MULTIPLE})"
        )
    band = Band.of(config)
    sees_every_key = band.left is None and (band.right is None or (band.bottom_right and band.right >= 0))
    if not sees_every_key:
        return (
            "with a paged KV cache only a decode query that sees every key of its sequence is supported (no mask, or "
            f"causal aligned bottom-right); got is_causal={config.is_causal}, local_window_size={config.window}, "
            f"diagonal_alignment={config.diagonal_alignment!r}"
        )
    return None


def pages_per_block(page_size: int, pages_per_seq: int) -> int:
    """The kernel's `pages_per_compute_block` (see `BLOCK_TOKENS`)."""
    fits = [d for d in range(1, pages_per_seq + 1) if pages_per_seq % d == 0 and d * page_size <= BLOCK_TOKENS]
    return max(fits, default=1)


@dataclasses.dataclass(frozen=True)
class PagedPlan:
    """Static description of one paged call (decode here, or the ragged kernel's: `ragged.py`).

    Attributes:
        config: the call's configuration (also what the fallback backward recomputes).
        interpret: run the kernel in Pallas TPU interpret mode.
        fallback: what a gradient differentiates, or None (a gradient then raises).
    """

    config: AttentionConfig
    interpret: bool
    fallback: Fallback | None

    @property
    def head_dim(self) -> int:
        """The head dim padded to 128 lanes."""
        return blocks.round_up(self.config.head_dim, blocks.LANES)


def _head_major_pool(pool: jax.Array, head_dim: int, kv_layout: str) -> jax.Array:
    """A pool as `[K, P, page_size, head_dim]`: as it is when head-major (padded at `create`), else the
    token-major `[P, page_size, K, H]` transposed and zero-padded (a copy)."""
    if kv_layout == "head_major":
        return pool
    pool = jnp.pad(pool, ((0, 0), (0, 0), (0, 0), (0, head_dim - pool.shape[3])))
    return jnp.transpose(pool, (2, 0, 1, 3))


def interpret_mode():
    """A context in which JAX's bundled paged kernels (which take no `interpret` argument) run in Pallas interpret
    mode: its HLO interpreter (`unseen_mesh.hlo_interpreter`), as `interpret=True` gives splash's kernels. Not TPU
    interpret mode (`pltpu.force_tpu_interpret_mode()`, which also checks races and bounds): that one simulates the
    chip through ordered callbacks, which XLA's partitioner cannot split (a `custom_partitioning` of one fails to
    compile on more than one device), while the HLO interpreter's program has no effects, so an interpreted call
    partitions as on a TPU (`partitioning`). Tests run TPU interpret mode's race detector around
    `PallasTpu(interpret=False)`, with the call unpartitioned."""
    return unseen_mesh.hlo_interpreter()


def decode_kernel(query, k_pool, v_pool, lengths, table, *, soft_cap, pages_per_block, interpret):
    """JAX's paged-attention kernel: `[B, N, H']` from the scaled query `[B, N, H']`, head-major pools
    `[K, P, page_size, H']`, lengths `[B]` and the page table `[B, pages_per_seq]` (entries inside the pool)."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    kernel = functools.partial(
        paged_attention, query, k_pool, v_pool, lengths, table,
        attn_logits_soft_cap=soft_cap, pages_per_compute_block=pages_per_block,
    )  # fmt: skip
    # The kernel mixes a float32 query with bfloat16 pages, and indexes in int32: traced under JAX's defaults.
    with kernel_settings.as_written():
        if not interpret:
            return kernel()
        with interpret_mode():
            return kernel()


def _kernel(plan: PagedPlan, query, k_pages, v_pages, page_table, seq_kv):
    """`decode_kernel` on the call's operands, as one partitionable call (`partitioning.PAGED`)."""
    config = plan.config
    run = functools.partial(
        decode_kernel, soft_cap=config.logits_soft_cap,
        pages_per_block=pages_per_block(config.page_size, config.pages_per_seq), interpret=plan.interpret,
    )  # fmt: skip
    pools = tuple(_head_major_pool(x, plan.head_dim, config.kv_layout) for x in (k_pages, v_pages))
    # A sequence of length 0 reads one key, so that the kernel writes finite values there (masked after it).
    operands = (query, *pools, jnp.maximum(seq_kv, 1), jnp.clip(page_table, 0, config.num_pages - 1))
    return partitioning.call(run, partitioning.PAGED, operands)


def _forward(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_q, seq_kv):
    config = plan.config
    H = config.head_dim
    query = (q[:, 0].astype(jnp.float32) * config.scale).astype(q.dtype)  # [B, N, H]: T = 1
    query = jnp.pad(query, ((0, 0), (0, 0), (0, plan.head_dim - H)))
    out = _kernel(plan, query, k_pages, v_pages, page_table, seq_kv)
    valid = Band.of(config).rows_valid(seq_q, seq_kv, 1)  # [B, 1]
    out = jnp.where(valid[:, :, None, None], out[:, None, :, :H], jnp.zeros((), out.dtype))
    return out, jnp.full(out.shape[:-1], -jnp.inf, jnp.float32)  # no lse: `decline_reason` keeps it dropped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _paged(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_q, seq_kv, lengths):
    return _forward(plan, q, k_pages, v_pages, page_table, seq_q, seq_kv)


def _paged_fwd(plan: PagedPlan, q, k_pages, v_pages, page_table, seq_q, seq_kv, lengths):
    residuals = (q, k_pages, v_pages, page_table, lengths)
    return _forward(plan, q, k_pages, v_pages, page_table, seq_q, seq_kv), residuals


def _paged_bwd(plan: PagedPlan, residuals, cotangents):
    q, k_pages, v_pages, page_table, lengths = residuals
    if plan.fallback is None:
        raise NotImplementedError(
            "pallas_tpu: gradients of paged key/value attention (`page_table`) are not supported: JAX's "
            "paged-attention kernel is forward only. Use implementation=None (the kernel forward, `xla` backward) or "
            "implementation='xla' to differentiate it."
        )
    inputs = AttentionInputs(query=q, key=k_pages, value=v_pages, page_table=page_table, **lengths)
    # The lse is never returned (`decline_reason`): its cotangent is zero.
    dq, dk, dv = fallback_gradients(plan.fallback, plan.config, inputs, cotangents[0], None)
    return dq, dk, dv, None, None, None, jax.tree.map(lambda _: None, lengths)


_paged.defvjp(_paged_fwd, _paged_bwd)


def attention(
    config: AttentionConfig, inputs: AttentionInputs, *, interpret: bool, fallback: Fallback | None
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` of a paged decode call (`decline_reason(config)` is None) in the caller's layout; `lse` is -inf
    (the call does not return it)."""
    B, N = config.batch_size, config.num_q_heads
    q = jnp.reshape(inputs.query, (B, 1, N, config.head_dim))
    seq_kv = jnp.clip(jnp.reshape(inputs.key_value_seq_lengths, (B,)).astype(jnp.int32), 0, config.kv_len)
    if inputs.query_seq_lengths is None:
        seq_q = jnp.ones((B,), jnp.int32)
    else:
        seq_q = jnp.clip(jnp.reshape(inputs.query_seq_lengths, (B,)).astype(jnp.int32), 0, 1)
    plan = PagedPlan(config, interpret, fallback)
    lengths = {"key_value_seq_lengths": inputs.key_value_seq_lengths, "query_seq_lengths": inputs.query_seq_lengths}
    out, lse = _paged(plan, q, inputs.key, inputs.value, inputs.page_table.astype(jnp.int32), seq_q, seq_kv, lengths)
    return jnp.reshape(out, config.batch_shape + (1, N, config.value_head_dim)), jnp.reshape(
        lse, config.batch_shape + (1, N)
    )
