"""Probe (H200): device time of the FP8 conversions around attnlib's cuDNN FP8 graph at the Llama shape (q
`[1, 8192, 64, 128]`): the output dequantization (E4M3 -> bfloat16 with a scale), the input quantization (bfloat16 ->
E4M3) and the amax reduction, each written several ways, to choose the fastest exact form. Prints one line per form
(microseconds per call, best of 5 loops of 20 under jit) and whether it equals the current form bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path


SHAPE = (1, 8192, 64, 128)


def timed(fn, *args):
    """Microseconds per call: best of 5 loops of 20 (`bench_cudnn.best_per_call`)."""
    return best_per_call(fn, args, loop=20, reps=5) * 1e6


def e4m3_bits_to_f32(x8):
    """E4M3 values as float32 by integer arithmetic on their bits (sign, 4-bit exponent with bias 7, 3-bit mantissa;
    no NaN: the values are clipped to ±448)."""
    b = jax.lax.bitcast_convert_type(x8, jnp.uint8).astype(jnp.uint32)
    sign, exp, man = (b >> 7) << 31, (b >> 3) & 0xF, b & 7
    normal = jax.lax.bitcast_convert_type(sign | ((exp + 120) << 23) | (man << 20), jnp.float32)
    tiny = man.astype(jnp.float32) * 2.0**-9 * jnp.where(sign > 0, -1.0, 1.0)
    return jnp.where(exp == 0, tiny, normal)


def main():
    key = jax.random.key(0)
    q = jax.random.normal(key, SHAPE, jnp.float32).astype(jnp.bfloat16)
    scale = jnp.max(jnp.abs(q.astype(jnp.float32))) / 448.0
    q8 = jnp.clip(q.astype(jnp.float32) / scale, -448, 448).astype(jnp.float8_e4m3fn)
    c = jnp.float32(37.0)
    dequant = {
        "f32_div (attnlib)": lambda x, c: (x.astype(jnp.float32) / c).astype(jnp.bfloat16),
        "f32_mul_reciprocal": lambda x, c: (x.astype(jnp.float32) * (1 / c)).astype(jnp.bfloat16),
        "via_bf16_div": lambda x, c: (x.astype(jnp.bfloat16).astype(jnp.float32) / c).astype(jnp.bfloat16),
        "via_f16_div": lambda x, c: (x.astype(jnp.float16).astype(jnp.float32) / c).astype(jnp.bfloat16),
        "bits_div": lambda x, c: (e4m3_bits_to_f32(x) / c).astype(jnp.bfloat16),
    }
    reference = None
    for name, fn in dequant.items():
        f = jax.jit(fn)
        out = np.asarray(f(q8, c).astype(jnp.float32))
        reference = out if reference is None else reference
        print(f"dequant {name:28s} {timed(f, q8, c):8.1f} us  bit-equal={np.array_equal(out, reference)}", flush=True)
    quant = {
        "f32_div_clip (attnlib)": lambda x, s: jnp.clip(x.astype(jnp.float32) / s, -448, 448).astype(jnp.float8_e4m3fn),
        "f32_mul_reciprocal_clip": lambda x, s: jnp.clip(x.astype(jnp.float32) * (1 / s), -448, 448).astype(
            jnp.float8_e4m3fn),
        "f32_div_no_clip": lambda x, s: (x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn),
    }
    reference = None
    for name, fn in quant.items():
        f = jax.jit(fn)
        out = np.asarray(f(q, scale).astype(jnp.float32))
        reference = out if reference is None else reference
        equal = np.array_equal(out, reference)
        print(f"quant   {name:28s} {timed(f, q, scale):8.1f} us  bit-equal={equal}", flush=True)
    amax = {
        "abs_max_f32 (attnlib)": lambda x: jnp.max(jnp.abs(x.astype(jnp.float32))),
        "abs_max_bf16": lambda x: jnp.max(jnp.abs(x)).astype(jnp.float32),
        "max_minus_min_bf16": lambda x: jnp.maximum(jnp.max(x), -jnp.min(x)).astype(jnp.float32),
    }
    for name, fn in amax.items():
        f = jax.jit(fn)
        print(f"amax    {name:28s} {timed(f, q):8.1f} us  value={float(f(q))}", flush=True)
    both = jax.jit(lambda x: jnp.clip(x.astype(jnp.float32) / (jnp.max(jnp.abs(x.astype(jnp.float32))) / 448),
                                      -448, 448).astype(jnp.float8_e4m3fn))
    print(f"amax+quant in one jit                 {timed(both, q):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
