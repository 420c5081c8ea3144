"""`attnlib.PallasTpu`: the Pallas TPU implementation, its options and the calls it declines, with reasons."""

import dataclasses
import logging
from typing import Any, ClassVar

import jax
import numpy as np

from ... import logs
from ...config import AttentionConfig, AttentionInputs
from .. import mesh_visibility, placement
from ..base import Context, Implementation
from . import blocks, mesh_call, paged, ragged
from .flex import support as flex_support


MAX_HEAD_DIM = 256
"""The largest head dim (after padding to 128 lanes) attnlib hands splash: its blocks hold whole heads in VMEM."""

DTYPES = (np.dtype("bfloat16"), np.dtype("float32"))

AUTO_MIN_LENGTH = 512
"""With `implementation=None`, calls whose T and S are both at most this are left to `xla_chunked` (one key block:
its forward keeps the probabilities for the backward). Measured on a TPU v5e, b8 T=S=512 N16 H64 causal bf16
(`benchmarks/bench_tpu.py`, small_512): xla_chunked 0.15 / 0.77 ms forward / forward + backward, splash 0.27 / 0.83
with its best blocks, attnlib's splash call 0.33 / 0.89. Paged decode measured likewise (`bench_tpu_decode.py`,
b32 N32 K8 H128, S = 512, 2026-12-07): on token-major or head-major pools xla_chunked 0.18 ms beats JAX's
paged-attention kernel (0.23 ms), so the rule holds there too; on a `"combined"` cache the ragged kernel (0.15 ms)
beats every other path (xla_chunked reads that layout at 0.52 ms), so a combined cache is never left to
xla_chunked."""


def float32_precision_reason(config: AttentionConfig) -> str | None:
    """Why splash cannot serve a float32 call on a TPU at the precision it asks for (`precision.py`), or None.

    Splash's matrix products run at the TPU's default precision, as `jnp.matmul` on float32 does there unless asked
    for more: JAX's convention, which attnlib follows. Measured on a TPU v5e (jax 0.10.2, docs/semantics.md): at the
    default the error against float64 is that of jax.nn's float32 call on the same inputs."""
    if config.dtype != np.dtype("float32") or config.fp8 is not None or config.matmul_precision is None:
        return None
    return (
        f"float32 inputs under jax.default_matmul_precision({config.matmul_precision!r}) are not served on a TPU: "
        "splash's matrix products run at the TPU's default precision (one bfloat16 pass), so the call runs a "
        "plain-JAX implementation with full-precision matrix products"
    )


KERNELS = ("auto", "splash", "flex")
"""`PallasTpu.kernel`: which kernel serves dense and THD calls."""


def tpu_visible() -> bool:
    """Whether JAX sees a TPU: attached, or the calls traced now placed on one of a deviceless topology
    (`jax.default_device` or `jax.set_mesh`, compiling ahead of time for a slice from a host without one)."""
    if placement.placement_platform() == "tpu":
        return True
    try:
        return any(d.platform == "tpu" for d in jax.devices())
    except RuntimeError:
        return False


def _backward_kernels_reason() -> str | None:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    if not all(hasattr(sk, n) for n in ("_splash_attention_bwd_dkv", "_splash_attention_bwd_dq")):
        return "this JAX's splash attention lacks the dK/dV and dQ kernels attnlib's backward calls"
    return None


TYPED_VARYING = (
    "calls inside `jax.shard_map(..., check_vma=True)` (the default) are not served: this JAX's Pallas TPU kernels "
    "give their outputs no varying-axes type (pallas_call raises); pass check_vma=False to `jax.shard_map` to run "
    "them there"
)


def feature_reason(config: AttentionConfig) -> str | None:
    """Why splash cannot serve `config` (a sentence naming the feature and the limit), or None. Pure Python."""
    if config.typed_varying:
        return TYPED_VARYING
    if config.fp8 is not None:
        return "FP8 attention (`fp8=`) is not supported: splash runs bfloat16 and float32"
    if config.dtype not in DTYPES:
        return f"{config.dtype} inputs are not supported: splash runs bfloat16 and float32"
    unsupported = [
        (config.has_bias, "`bias` is not supported: splash takes no additive bias"),
        (config.has_mask, "`mask` arrays are not supported: splash takes static masks and segment ids only"),
        (config.dropout_rate > 0, "dropout is not supported: splash has no dropout"),
        (config.has_modifiers, "`score_mod` / `mask_mod` are not supported: splash has no score modifiers"),
        (config.deterministic_backward, "`deterministic_backward=True` is not supported: splash does not promise a "
                                        "bitwise reproducible backward"),
    ]  # fmt: skip
    for declined, reason in unsupported:
        if declined:
            return reason
    for name, dim in (("H", config.head_dim), ("Hv", config.value_head_dim)):
        if blocks.round_up(dim, blocks.LANES) > MAX_HEAD_DIM:
            return f"head dim {name}={dim} is not supported: at most {MAX_HEAD_DIM}"
    if config.q_len == 0 or config.kv_len == 0:
        return f"empty sequences (T={config.q_len}, S={config.kv_len}) are not supported"
    banded = config.is_causal or config.window is not None
    if banded and config.separate_kv_structure:
        return (
            "a causal mask or window over packed sequences with their own key structure (`kv_segment_ids` or "
            "`cu_seqlens_kv`) is not supported: splash's masks have one static offset, not one per sequence"
        )
    lengths = config.has_q_lengths or config.has_kv_lengths
    if banded and lengths and config.diagonal_alignment == "bottom_right" and config.layout == "dense":
        return (
            "a bottom-right aligned causal mask or window with padding lengths is not supported: the offset differs "
            "per row and splash's masks have one static offset"
        )
    return None


@dataclasses.dataclass(frozen=True)
class PallasTpu(Implementation):
    """`implementation="pallas_tpu"`: fused attention on TPU through JAX's bundled Pallas TPU kernels (splash
    attention), forward and backward. Pass an instance wherever `implementation` takes a name (alone or in a
    sequence); the name stands for `PallasTpu()`.

    It serves dense and THD layouts with causal masks (both diagonal alignments), two-sided windows, padding
    lengths, packed segment ids, GQA / MQA, `logits_soft_cap`, float or array `scale`, attention `sinks`, the
    returned `lse` and gradients of query, key, value and sinks (through `lse` too), in bfloat16 and float32 (float32 at
    the TPU's default matrix-product precision, as `jnp.matmul`; under `jax.default_matmul_precision("highest")` it
    declines on a TPU, `float32_precision_reason`); and
    paged KV caches: one bfloat16 decode query per sequence through JAX's paged-attention kernel on token-major or
    `"head_major"` pools (`paged.py`), and any number of queries per sequence (dense, or ragged with
    `cu_seqlens_q`: mixed prefill and decode) through JAX's ragged paged-attention kernel on a `"combined"`
    `PagedKVCache` (`ragged.py`). Where splash declines a dense or THD call, attnlib's own Pallas kernel (`flex/`)
    serves it: `score_mod` / `mask_mod` compiled into the kernel with block sparsity, `bias` and `mask` arrays, MLA,
    dropout, float32 under "highest", `deterministic_backward=True`, per-row diagonal offsets. What it declines, and
    why, and which kernel runs, `attnlib.explain` says (docs/implementations.md).

    Attributes:
        block_sizes: splash's tiles: None (the default) for attnlib's table by shape (`blocks.py`), or a
            `jax.experimental.pallas.ops.tpu.splash_attention.BlockSizes` (backward blocks it leaves unset follow
            its forward blocks; every block a multiple of 128; lengths are padded to multiples of its blocks).
        interpret: run the Pallas kernels in interpret mode: slow, but on any backend (CPU included); for tests.
            Defaults to False: off a TPU the implementation then declines ("no TPU visible to JAX").
        flex_blocks: `(block_q, block_k)` of attnlib's flex kernel: query tokens (times the GQA group) and keys per
            tile. None (the default) for tiles of about 1024 query rows and 1024 keys (`flex/plan.py`); multiples
            of 8, and on a TPU `block_q` a multiple of 16 and `block_k` of 128 (interpret-mode tests use small
            blocks so that every case has several).
        kernel: which kernel serves dense and THD calls: `"auto"` (the default) splash where it serves the call
            and attnlib's flex kernel elsewhere; `"splash"` splash only (declining what it cannot serve);
            `"flex"` attnlib's flex kernel only (to compare the two, or where it is measured faster).
    """

    block_sizes: Any = None
    interpret: bool = False
    flex_blocks: tuple[int, int] | None = None
    kernel: str = "auto"
    name: ClassVar[str] = "pallas_tpu"

    def __post_init__(self):
        if self.block_sizes is not None:
            blocks.check_user_block_sizes(self.block_sizes)
        if self.kernel not in KERNELS:
            raise ValueError(f"`kernel` must be one of {KERNELS}. Got kernel={self.kernel!r}.")
        if not isinstance(self.interpret, bool):
            raise TypeError(f"`interpret` must be a bool. Got interpret={self.interpret!r}.")
        if self.flex_blocks is not None:
            ok = isinstance(self.flex_blocks, tuple) and len(self.flex_blocks) == 2
            bad = lambda b: isinstance(b, bool) or not isinstance(b, int) or b <= 0 or b % 8
            if not ok or any(bad(b) for b in self.flex_blocks):
                raise ValueError(
                    "`flex_blocks` must be None or a tuple `(block_q, block_k)` of positive multiples of 8 (on a TPU "
                    f"block_k a multiple of 128). Got flex_blocks={self.flex_blocks!r}."
                )

    def decline_reason(self, config: AttentionConfig, context: Context) -> str | None:
        if not self.interpret and not tpu_visible():
            return "no TPU visible to JAX"
        if not self.interpret and (elsewhere := placement.elsewhere_reason("tpu")) is not None:
            return elsewhere
        ragged_kernel = config.layout == "paged" and config.kv_layout == "combined"
        if context.automatic and not ragged_kernel and max(config.q_len, config.kv_len) <= AUTO_MIN_LENGTH:
            return (
                f"automatic dispatch leaves sequences of at most {AUTO_MIN_LENGTH} tokens (T={config.q_len}, "
                f"S={config.kv_len}) to xla_chunked, faster there on a TPU v5e; name pallas_tpu to force it"
            )
        if config.layout == "paged":
            if (reason := float32_precision_reason(config)) is not None and not self.interpret:
                return reason
            kernel = ragged if config.kv_layout == "combined" else paged
            return feature_reason(config) or kernel.decline_reason(config, on_tpu=not self.interpret)
        if config.typed_varying:
            return TYPED_VARYING  # splash's kernels and attnlib's flex kernel alike
        reasons = []  # one per kernel this instance may run, in order; any that serves the call accepts it
        if self.kernel != "flex":
            if (splash_reason := self.splash_reason(config)) is None:
                return None
            reasons.append(splash_reason)
        if self.kernel != "splash":
            if (flex_reason := flex_support.decline_reason(config)) is None:
                return None
            reasons.append(f"{flex_support.NAME}: {flex_reason}")
        return "; ".join(reasons) + ("" if self.kernel == "auto" else f" (kernel={self.kernel!r})")

    def _runs_flex(self, config: AttentionConfig) -> str | None:
        """Why a dense or THD call this implementation serves runs the flex kernel (None: it runs splash)."""
        if self.kernel == "flex":
            return "kernel='flex'"
        if self.kernel == "splash":
            return None
        reason = self.splash_reason(config)
        return None if reason is None else f"splash declined: {reason}"

    def splash_reason(self, config: AttentionConfig) -> str | None:
        """Why splash cannot serve a dense or THD call (the flex kernel then may), or None."""
        return float32_precision_reason(config) or feature_reason(config) or _backward_kernels_reason()

    def kernel_note(self, config: AttentionConfig, context: Context) -> str | None:
        notes = []
        if config.layout != "paged" and (why := self._runs_flex(config)) is not None:
            notes.append(f"runs {flex_support.NAME} ({why})")
        if (on_mesh := mesh_call.explain(jax.sharding.get_abstract_mesh())) is not None:
            notes.append(on_mesh)
        return ", and ".join(notes) or None

    def declines_loudly(self) -> bool:
        # A call placed on a TPU that falls back to plain JAX loses most of its speed: say so loudly. Elsewhere it is
        # expected.
        return placement.placement_platform() == "tpu"

    def attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        reason = self.decline_reason(config, context)
        if reason is not None:
            raise NotImplementedError(f"pallas_tpu: {reason}")
        mesh = jax.sharding.get_abstract_mesh()
        if mesh_visibility.explicit_axes(mesh):
            run = lambda inputs: self._attention(config, inputs, context)  # noqa: E731
            return mesh_call.with_automatic_axes(run, inputs, mesh)
        return self._attention(config, inputs, context)

    def _attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        from . import splash  # the kernels load when a call is traced, not at import
        if config.layout == "paged" and config.kv_layout == "combined":
            return ragged.attention(config, inputs, interpret=self.interpret, fallback=context.fallback)
        if config.layout == "paged":
            return paged.attention(config, inputs, interpret=self.interpret, fallback=context.fallback)
        if (why := self._runs_flex(config)) is not None:
            from .flex import attention as flex_attention

            message = f"attnlib.attention: pallas_tpu runs {flex_support.NAME} ({why})."
            logs.log_once((config, message), logging.INFO, message)
            return flex_attention.attention(config, inputs, interpret=self.interpret, block_sizes=self.flex_blocks)
        return splash.attention(config, inputs, splash.layout(config, self.block_sizes, self.interpret))
