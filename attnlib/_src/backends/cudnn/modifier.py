"""The score modifier of a cuDNN graph: `score_mod`, soft cap and every mask of a call as one scalar JAX function.

cuDNN 9.19 refuses its own causal, window and padding masks together with a `score_mod`, and adds its `bias` input
after the modifier. So when a call has a `score_mod`, a `mask_mod` or a `logits_soft_cap`, attnlib composes one
function `(score, batch, head, row, col, *args) -> score` in the order of the API (score_mod, soft cap, then
mask_mod AND causal AND window as a select to -inf), traces it to a jaxpr and lowers that jaxpr into the graph's
`score_mod` / `score_mod_bprop` callbacks (`score_mod_lowering`). `row` and `col` are the graph's query row and key
column; the function adds the static bottom-right offset itself, so `q_idx` is the aligned position. Key padding
lengths and a boolean `mask` array are not part of the function: they reach the graph as an additive bias, which
cuDNN applies after the modifier (masks come last, as the API orders them).

A row that sees no key ends with every score at about -1e30 (a masked score), so its softmax statistic is below
`masked_below(dtype)`: the caller zeroes those rows and reports `lse = -inf` (see `attention.py`).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...config import AttentionConfig


NEG = -1e30
"""What a masked score becomes inside a graph (cuDNN turns a row of -inf into NaN)."""


def masked_below(dtype: Any) -> float:
    """Softmax statistics below this mean the row saw no key. float16 graphs mask with an additive bias of
    float16's lowest value (-65504), bfloat16 ones with -1e30."""
    return -3.0e4 if np.dtype(dtype) == np.dtype("float16") else -1e29


def mask_bias_value(dtype: Any) -> float:
    """The additive bias of a masked key in a graph of `dtype` (its bias input has the io dtype)."""
    return float(np.finfo(np.float16).min) if np.dtype(dtype) == np.dtype("float16") else NEG


def uses_modifier(config: AttentionConfig) -> bool:
    """Whether the call's graphs need a score modifier (a `score_mod`, `mask_mod` or soft cap)."""
    return config.modifiers is not None or config.logits_soft_cap is not None


def visibility_as_bias(config: AttentionConfig) -> bool:
    """Whether the call's visibility (segments, lengths, causal, window: per-sequence positions) must reach a dense
    graph as an additive bias: packed rows with a boolean `mask` or a modifier (cuDNN's ragged graphs take neither),
    or a modifier with padding lengths and a bottom-right diagonal (per-sequence offsets, which cuDNN 9.19 cannot
    compare inside a modifier). The graph then computes every tile."""
    if config.layout != "dense":
        return False
    if config.has_segments:
        return config.has_mask or uses_modifier(config)
    padded = config.has_q_lengths or config.has_kv_lengths
    return uses_modifier(config) and padded and config.diagonal_alignment == "bottom_right"


def without_visibility(config: AttentionConfig) -> AttentionConfig:
    """`config` with its sequence structure and built-in masks removed (they travel in the bias instead)."""
    return dataclasses.replace(
        config, is_causal=False, window=None, has_q_lengths=False, has_kv_lengths=False, has_segments=False,
        max_segments_per_row=None, diagonal_alignment="top_left",
    )


def reads_positions(config: AttentionConfig) -> bool:
    """Whether the caller's `score_mod` / `mask_mod` reads `q_idx` or `kv_idx`."""
    mods = config.modifiers
    if mods is None:
        return False
    reads = []
    for jaxpr, first in ((mods.score_jaxpr, 3), (mods.mask_jaxpr, 2)):
        if jaxpr is None:
            continue
        reads += [reads_input(jaxpr, i) for i in (first, first + 1)]
    return any(reads)


def reads_input(jaxpr: Any, index: int) -> bool:
    """Whether the closed jaxpr uses its input `index` (an equation or the output reads it)."""
    var = jaxpr.jaxpr.invars[index]
    used = [v for eqn in jaxpr.jaxpr.eqns for v in eqn.invars] + list(jaxpr.jaxpr.outvars)
    return any(v is var for v in used)


def folded_scale(config: AttentionConfig, scale: Any = None) -> Any:
    """The graph's `attn_scale`. A soft cap without a `score_mod` folds its `1/c` into it, so the modifier is
    `c * tanh(x)` on scores cuDNN already scaled (one multiply per score fewer). `scale`: the runtime scale array
    when `config.scale` is None (the result is then an array too)."""
    value = config.scale if config.scale is not None else scale
    has_score_mod = config.modifiers is not None and config.modifiers.score_mod is not None
    if config.logits_soft_cap is not None and not has_score_mod:
        return value / config.logits_soft_cap
    return value


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreModifier:
    """The composed modifier of one graph.

    Attributes:
        jaxpr: closed jaxpr of `(score f32, batch i32, head i32, row i32, col i32, *args) -> f32`; `score` is
            cuDNN's scaled score (`folded_scale`).
        function: the composed Python function (for the plain-JAX reference of `lse` gradients).
        arg_dims: rank-4 dims `[1, N|1, t|1, s|1]` of each `score_mod_args` tensor as the graph binds it.
        key: a structural description: equal keys give identical graphs, in every process.
        reads_batch: the function uses its `batch` index (then `vmap` cannot fold a mapped axis into the graph's
            batch: the index would run over every example instead of each one's own rows).
    """

    jaxpr: Any
    function: Callable[..., jax.Array]
    arg_dims: tuple[tuple[int, int, int, int], ...]
    key: str
    reads_batch: bool = True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScoreModifier) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def _compose(config: AttentionConfig, offset: int) -> Callable[..., jax.Array]:
    mods = config.modifiers
    score_mod = None if mods is None else mods.score_mod
    mask_mod = None if mods is None else mods.mask_mod
    cap = config.logits_soft_cap
    left, right = (None, None) if config.window is None else config.window
    if config.is_causal:
        right = 0 if right is None else min(right, 0)
    masked = mask_mod is not None or left is not None or right is not None

    # Index arithmetic is emitted only where it is not zero: a causal mask is then exactly cuDNN's own pattern
    # `row >= col` (the one form whose masked tiles cuDNN 9.19 skips; docs/performance.md, "Limits, and why").
    def modifier(score, batch, head, row, col, *args):
        q_idx = row + offset if offset else row
        kv_idx = col
        s = score
        if score_mod is not None:
            s = jnp.asarray(score_mod(s, batch, head, q_idx, kv_idx, *args)).astype(jnp.float32)
        if cap is not None:
            s = cap * jnp.tanh(s / cap if score_mod is not None else s)  # else 1/cap is in the graph's scale
        if not masked:
            return s
        conditions = []
        if right is not None:
            conditions.append(q_idx >= kv_idx if right == 0 else q_idx + right >= kv_idx)
        if left is not None:
            conditions.append(kv_idx >= q_idx - left)
        if mask_mod is not None:
            conditions.append(jnp.asarray(mask_mod(batch, head, q_idx, kv_idx, *args)))
        keep = conditions[0]
        for condition in conditions[1:]:
            keep = keep & condition
        return jnp.where(keep, s, -jnp.inf)

    return modifier


def arg_dims(config: AttentionConfig, t: int, s: int) -> tuple[tuple[int, int, int, int], ...]:
    """Rank-4 dims of each `score_mod_args` array in a graph with `t` query rows and `s` keys."""
    if config.modifiers is None:
        return ()
    dims = []
    for shape in config.modifiers.arg_shapes:
        full = (1,) * (4 - min(len(shape), 3)) + tuple(shape[-3:])
        n, tt, ss = full[1:]
        dims.append((1, n, t if tt != 1 else 1, s if ss != 1 else 1))
    return tuple(dims)


@functools.lru_cache(maxsize=256)
def _build(config: AttentionConfig, offset: int, t: int, s: int) -> ScoreModifier:
    fn = _compose(config, offset)
    mods = config.modifiers
    arg_dtypes = () if mods is None else mods.arg_dtypes
    scalars = [jax.ShapeDtypeStruct((), jnp.float32)] + [jax.ShapeDtypeStruct((), jnp.int32)] * 4
    scalars += [jax.ShapeDtypeStruct((), jnp.dtype(d)) for d in arg_dtypes]
    jaxpr = jax.make_jaxpr(fn)(*scalars)
    dims = arg_dims(config, t, s)
    window = config.window
    key = repr((
        "modifier/1", None if mods is None else mods.key, config.logits_soft_cap, config.is_causal, window, offset,
        dims, str(jaxpr),
    ))  # fmt: skip
    return ScoreModifier(jaxpr, fn, dims, key, reads_input(jaxpr, 1))


def build(config: AttentionConfig, offset: int, t: int, s: int) -> ScoreModifier:
    """The composed modifier of `config` for a graph of `t` query rows and `s` keys whose query rows sit `offset`
    positions after their aligned diagonal start (bottom-right: `s - t`)."""
    return _build(config, int(offset), int(t), int(s))


def _has_infinite_constant(jaxpr: Any) -> bool:
    """Whether a closed jaxpr (or one nested in it) holds an infinite literal or constant."""
    import jax.extend.core as jex

    def infinite(x: Any) -> bool:
        try:
            return bool(np.any(np.isinf(np.asarray(x))))
        except (TypeError, ValueError):
            return False

    def walk(j: Any) -> bool:
        for eqn in j.eqns:
            if any(isinstance(v, jex.Literal) and infinite(v.val) for v in eqn.invars):
                return True
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns") and walk(inner):
                    return True
        return False

    return any(infinite(c) for c in jaxpr.consts) or walk(jaxpr.jaxpr)


def lowering_reason(config: AttentionConfig, offset: int, t: int, s: int) -> str | None:
    """Why the modifier of `config` cannot become cuDNN graph ops (forward or backward), or None."""
    from . import score_mod_lowering

    mods = config.modifiers
    if mods is not None and mods.score_jaxpr is not None and config.logits_soft_cap is not None:
        if _has_infinite_constant(mods.score_jaxpr):
            return (
                "cudnn: a `score_mod` that can return -inf together with `logits_soft_cap` is not supported (the "
                "soft cap would turn the masked score into -c inside the graph); mask with `mask_mod` instead."
            )
    if mods is not None and mods.has_traced_consts:
        return (
            "cudnn: the score_mod/mask_mod closes over a traced array (a value computed under jit); pass it in "
            "`score_mod_args` so the graph can read it."
        )
    try:
        modifier = build(config, offset, t, s)
    except Exception as e:  # the user's function failed on scalars: validation reports that to the caller
        return f"cudnn: the score modifier could not be traced on scalars ({type(e).__name__}: {e})."
    reason = score_mod_lowering.forward_reason(modifier.jaxpr)
    if reason is None:
        reason = score_mod_lowering.backward_reason(modifier.jaxpr)
    return reason


def reference_scores(modifier: ScoreModifier, scores: jax.Array, args: tuple[jax.Array, ...]) -> jax.Array:
    """The modifier applied element by element to float32 scores `[B, N, t, s]` (masked entries -inf), in JAX.

    Args:
        scores: float32 `[B, N, t, s]`.
        args: each broadcastable to `[1, N|1, t|1, s|1]`.
    """
    B, N, t, s = scores.shape
    batch = jnp.arange(B, dtype=jnp.int32)[:, None, None, None]
    head = jnp.arange(N, dtype=jnp.int32)[None, :, None, None]
    row = jnp.arange(t, dtype=jnp.int32)[None, None, :, None]
    col = jnp.arange(s, dtype=jnp.int32)[None, None, None, :]
    return jnp.vectorize(modifier.function)(scores, batch, head, row, col, *args)
