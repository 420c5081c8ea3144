"""FP8 attention semantics (`fp8=`): per-tensor E4M3 quantization of query, key, value, the probabilities and the
output, as the plain-JAX implementations emulate it.

One sequence and head, with per-tensor dequantization scales `d_q`, `d_k`, `d_v` (real = fp8 × d):
- `q̂ = e4m3(q / d_q) · d_q` (likewise `k̂`, `v̂`); with `fp8="current"`, `d_x = amax(|x|) / 448` of the call's own
  inputs (1 where the tensor is all zeros), and `d_x` and `x / d_x` are float32 (E4M3 rounds the float32 quotient);
  with `Fp8Scales` the inputs are already E4M3 and the scales are given.
- scores, bias, modifiers, soft cap and masks as usual, from `q̂`, `k̂`; `m` = the row max (and sink);
- `p̃ = exp(s - m)` (≤ 1), `P8 = e4m3(448 · p̃) / 448`, `l = Σ p̃` (+ `exp(sink - m)`), unquantized;
- `o = (P8 · v̂) / l`, then `out = e4m3(o · c) / c` with the output scale `c = 448 / (OUTPUT_MARGIN · amax(|v̂|))`:
  `|o| ≤ (Σ P8 / Σ p̃) · amax|v̂|`, and E4M3's rounding keeps `Σ P8 / Σ p̃` far below `OUTPUT_MARGIN`, so `o · c`
  cannot overflow 448. (Dropout is not part of FP8 attention.)
- `lse` is computed from the unquantized `p̃`, as with 16-bit inputs.

Gradients (`fp8="current"`) are those of the same computation with every rounding a straight-through estimator:
the gradient of 16-bit attention evaluated at `q̂`, `k̂`, `v̂`, with `P8` in place of `p̃` where the forward used it.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import canonical
from .config import AttentionConfig, AttentionInputs


E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn."""

PROBABILITY_SCALE = 448.0
"""`p̃ ∈ [0, 1]` is quantized as `e4m3(448 · p̃)`: the whole E4M3 range."""

OUTPUT_MARGIN = 1.25
"""Headroom of the output scale over the bound `amax|v̂|` (see the module docstring)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """Dequantization scales of pre-quantized float8_e4m3fn `query`, `key`, `value` (`real = fp8 × scale`).

    Pass as `attnlib.attention(q8, k8, v8, fp8=attnlib.Fp8Scales(q=dq, k=dk, v=dv))` with `q8`, `k8`, `v8` of dtype
    `float8_e4m3fn`. The output is `output_dtype` (bfloat16 unless said); its scale is chosen by attnlib so it cannot
    overflow (see `docs/fp8.md`), so no output amax needs to be tracked. A pytree (the scales are leaves).

    Attributes:
        q, k, v: float32 scalars (shape `()` or `[1]`), the per-tensor dequantization factors.
        output_dtype: dtype of the result: bfloat16, float16 or float32 (static).
    """

    q: Any
    k: Any
    v: Any
    output_dtype: Any = dataclasses.field(default=jnp.bfloat16, metadata=dict(static=True))


def to_e4m3(x: jax.Array) -> jax.Array:
    """float32 -> the nearest float8_e4m3fn value, saturating at ±448.

    The result passes an optimization barrier: XLA's GPU pipeline (`xla_allow_excess_precision`, on by default)
    drops a float32 -> float8 -> float32 round trip as a no-op, which would silently skip the rounding."""
    return jax.lax.optimization_barrier(jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3))


def round_e4m3(x: jax.Array) -> jax.Array:
    """float32 -> the nearest float8_e4m3fn value as float32, saturating at ±448 (`to_e4m3`)."""
    return to_e4m3(x).astype(jnp.float32)


def straight_through(x: jax.Array, rounded: jax.Array) -> jax.Array:
    """`rounded` in the forward, the identity in the backward."""
    return x + jax.lax.stop_gradient(rounded - x)


def current_scale(amax: jax.Array) -> jax.Array:
    """float32 scalar: the dequantization scale `amax / 448` of a tensor with that amax (1 for an all-zero tensor)."""
    return jax.lax.stop_gradient(jnp.where(amax > 0, amax / E4M3_MAX, 1.0))


@dataclasses.dataclass(frozen=True)
class Rounding:
    """What the emulated kernel rounds after the inputs: the probabilities (always) and the output.

    Attributes:
        output_scale: float32 scalar `c` of `out = e4m3(o · c) / c`.
        output_dtype: the dtype of the result.
    """

    output_scale: jax.Array
    output_dtype: Any

    @staticmethod
    def probabilities(p: jax.Array) -> jax.Array:
        """`P8 = e4m3(448 · p̃) / 448`, straight-through."""
        return straight_through(p, round_e4m3(p * PROBABILITY_SCALE) / PROBABILITY_SCALE)

    def output(self, o: jax.Array) -> jax.Array:
        """`e4m3(o · c) / c`, straight-through."""
        c = self.output_scale
        return straight_through(o, round_e4m3(o * c) / c)


def output_scale(value_amax: jax.Array) -> jax.Array:
    """The output scale `c` for dequantized values of largest magnitude `value_amax` (see the module docstring)."""
    bound = value_amax * OUTPUT_MARGIN
    return jax.lax.stop_gradient(jnp.where(bound > 0, E4M3_MAX / bound, 1.0))


@dataclasses.dataclass(frozen=True)
class Dequantizer:
    """Turns the call's query / key / value (any layout, e.g. canonical) into float32 `q̂`, `k̂`, `v̂`.

    Attributes:
        mode: `"current"` (16/32-bit inputs, quantized here, straight-through) or `"scaled"` (E4M3 inputs).
        scales: the dequantization scales of query, key, value (float32 scalars).
    """

    mode: str
    scales: tuple[jax.Array, jax.Array, jax.Array]

    def fp8_values(self, x: jax.Array, which: int) -> jax.Array:
        """The E4M3 values of `x` (query 0, key 1, value 2): `e4m3(x / scale)`, or `x` itself when pre-quantized."""
        if self.mode == "current":
            return to_e4m3(jax.lax.stop_gradient(x).astype(jnp.float32) / self.scales[which])
        return x

    def __call__(self, x: jax.Array, which: int, fp8_values: jax.Array | None = None) -> jax.Array:
        """`x̂ = fp8_values · scale` in float32 (straight-through to `x` with `"current"`); pass `fp8_values` when
        they are already computed, so the quantization runs once."""
        values = self.fp8_values(x, which) if fp8_values is None else fp8_values
        dequantized = values.astype(jnp.float32) * self.scales[which]
        if self.mode == "current":
            return straight_through(x.astype(jnp.float32), dequantized)
        return dequantized


def plan(
    mode: str, query: jax.Array, key: jax.Array, value: jax.Array, scales: Fp8Scales | None
) -> tuple[Dequantizer, Rounding]:
    """The dequantizer and rounding of one call with `fp8=mode` (`"current"`, or `"scaled"` with `scales`), from
    the caller's `query`, `key`, `value` (per-tensor amaxes over the arrays as given)."""
    if mode == "current":
        amaxes = [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in (query, key, value)]
        per_tensor = tuple(current_scale(amax) for amax in amaxes)
        out_dtype = np.dtype(query.dtype)
        # The largest |v| quantizes to exactly 448: amax|v̂| = 448 · d_v, without another pass over the values.
        value_amax = jnp.where(amaxes[2] > 0, E4M3_MAX * per_tensor[2], 0.0)
    else:
        assert scales is not None
        per_tensor = tuple(jnp.reshape(jnp.asarray(s, jnp.float32), ()) for s in (scales.q, scales.k, scales.v))
        out_dtype = np.dtype(scales.output_dtype)
        value_amax = jnp.max(jnp.abs(value.astype(jnp.float32))) * jnp.abs(per_tensor[2])
    dequantize = Dequantizer(mode, per_tensor)  # pyright: ignore[reportArgumentType]
    return dequantize, Rounding(output_scale(value_amax), out_dtype)


def emulate(
    config: AttentionConfig,
    inputs: AttentionInputs,
    attend: Callable[[canonical.Problem], tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` of an FP8 call (`config.fp8` set) on a plain-JAX implementation.

    `attend(problem)` gets the canonical problem with float32 `q̂`, `k̂`, `v̂` and returns the canonical float32
    output `o` (probabilities rounded, output not yet) and `lse`; this rounds the output and restores the layout.
    """
    dequantize, rounding = plan(config.fp8, inputs.query, inputs.key, inputs.value, inputs.fp8_scales)
    problem = canonical.canonicalize(config, inputs)
    problem = problem._replace(
        query=dequantize(problem.query, 0), key=dequantize(problem.key, 1), value=dequantize(problem.value, 2)
    )
    out, lse = attend(problem)
    out, lse = canonical.restore(config, rounding.output(out), lse, problem)
    return out.astype(rounding.output_dtype), lse


def without_fp8(config: AttentionConfig) -> AttentionConfig:
    """`config` as a 16-bit call: no quantization, inputs in the output dtype (`fp8_fallback_inputs`)."""
    return dataclasses.replace(config, fp8=None, fp8_output_dtype=None, dtype=config.output_dtype)


def fp8_fallback_inputs(config: AttentionConfig, inputs: AttentionInputs) -> AttentionInputs:
    """The inputs of `without_fp8(config)`: pre-quantized E4M3 inputs dequantized to the output dtype."""
    if config.fp8 != "scaled":
        return inputs
    dequantize, _ = plan(config.fp8, inputs.query, inputs.key, inputs.value, inputs.fp8_scales)
    query, key, value = (
        dequantize(x, i).astype(config.output_dtype) for i, x in enumerate((inputs.query, inputs.key, inputs.value))
    )
    return dataclasses.replace(inputs, query=query, key=key, value=value, fp8_scales=None)
