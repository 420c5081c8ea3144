"""Splash masks and kernels, built once per static configuration.

Splash describes the causal / window structure of a call with a static mask over the padded `[T', S']` grid
(`CausalMask` / `LocalMask` with an `offset`, or `FullMask`) and turns it into block tables on the host: its
`MaskInfo`, which `mask_info.py` builds from the mask's band in a few NumPy passes (splash's own `make_splash_mha`
evaluates the mask block by block in Python, quadratic in the length: issue #77). `kernel` caches the kernel object
per `Kernel` description with `functools.lru_cache`, so a configuration's tables are built once per process, not per
call or per trace. Sequence structure that varies per
call (padding, segments, THD) is not part of the mask: it reaches the kernel as segment ids (`splash.py`).
"""

import dataclasses
import functools
from typing import Any, Literal


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """The static mask of a call on the padded grid.

    Attributes:
        kind: `"full"`, `"causal"` or `"local"` (a window, causal or not).
        q_len, kv_len: the padded lengths `T'`, `S'`.
        offset: added to a query's index to align it with the keys (`S - T` for `diagonal_alignment="bottom_right"`,
            else 0).
        window: `"local"`: `(left, right)` keys visible around the aligned query (causal folds into `right <= 0`; a
            None side is unbounded, as in splash's `LocalMask`).
    """

    kind: Literal["full", "causal", "local"]
    q_len: int
    kv_len: int
    offset: int = 0
    window: tuple[int | None, int | None] | None = None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Everything static about one splash kernel: what `kernel` is cached on.

    Attributes:
        mask: the static mask.
        block_sizes: splash `BlockSizes` (backward blocks included).
        soft_cap: `logits_soft_cap`, or None.
        interpret: run the Pallas kernels in interpret mode (any backend, CPU included).
        returns_lse: the call returns the log-sum-exp.
        empty_rows: some query row may see no key (sequence structure, or a band that leaves rows empty; with sinks
            too, where a finite sink alone gives such a row out 0 in the kernel, but a -inf one does not): the
            forward and backward then find those rows in the log-sum-exp and mask them; otherwise they skip that
            elementwise pass over the output and its cotangent.
        empty_rows_from_ids: the empty rows are exactly the queries without a segment (splash id `Q_NONE`): every
            other query sees at least its own key (self-attention with one structure for queries and keys, `T = S`,
            no padding lengths, no sinks, a band that keeps the diagonal). The rows are then found from the ids,
            not from the log-sum-exp, so a forward whose log-sum-exp nothing else reads (the first of two under
            full remat) does not relay it out.
    """

    mask: MaskSpec
    block_sizes: Any
    soft_cap: float | None
    interpret: bool
    returns_lse: bool = True
    empty_rows: bool = True
    empty_rows_from_ids: bool = False

    @property
    def lse_needed(self) -> bool:
        """The forward outside differentiation needs the log-sum-exp (the call returns it, or empty rows must be
        found). Otherwise it runs splash's forward without residuals, which writes the log-sum-exp 128 lanes wide
        (`[N, T', 128]` float32: twice the bytes of a bfloat16 output with 128-wide heads)."""
        return self.returns_lse or self.empty_rows


def mask_spec(
    *, is_causal: bool, window: tuple[int, int] | None, offset: int, q_len: int, kv_len: int
) -> MaskSpec:
    """The static mask of a causal and / or windowed call (`offset`: see `MaskSpec`)."""
    if window is not None:
        left, right = window
        return MaskSpec("local", q_len, kv_len, offset, (left, min(right, 0) if is_causal else right))
    if is_causal:
        return MaskSpec("causal", q_len, kv_len, offset)
    return MaskSpec("full", q_len, kv_len)


def kernel(spec: Kernel, save_residuals: bool = True) -> Any:
    """The splash kernel of `spec` (its forward saving the log-sum-exp unless `save_residuals` is False; its
    `MaskInfo`s for the backward), built on the first call with these arguments and reused afterwards (whatever
    `spec.returns_lse` and `spec.empty_rows` say: they choose around the kernels, they do not shape them)."""
    return _kernel(dataclasses.replace(spec, returns_lse=True, empty_rows=True), save_residuals)


@functools.lru_cache(maxsize=128)
def _kernel(spec: Kernel, save_residuals: bool) -> Any:
    import jax

    from .. import kernel_settings, placement
    from . import mask_info

    def build() -> Any:
        # Concrete tables even when first built inside a trace, and the same whatever the settings of the first call.
        # The tables are what `splash.make_splash_mha(splash_mask(spec.mask), head_shards=1, q_seq_shards=1, ...)`
        # builds, from the band's structure instead of block by block in Python (`mask_info.py`).
        with jax.ensure_compile_time_eval(), kernel_settings.as_written():
            return mask_info.splash_kernel(
                spec.mask,
                spec.block_sizes,
                save_residuals=save_residuals,
                attn_logits_soft_cap=spec.soft_cap,
                interpret=spec.interpret,
            )

    return placement.built_on_host(build)
