"""Probe (H200): how fast can the FP8 conversions around the cuDNN FP8 graph run? At the Llama shape (q
`[1, 8192, 64, 128]` bfloat16, 128 MiB) times, in microseconds per call and TB/s of memory traffic:
- torch (CUDA events): a bfloat16 copy, `x.to(float8_e4m3fn)` and back — what a tuned elementwise kernel reaches;
- XLA (wall clock, loops of 20 under jit): a bfloat16 scale, attnlib's quantization and dequantization, the same
  packing four E4M3 values into a uint32, and a Pallas (Triton) kernel of each.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from jax.experimental import pallas as pl


SHAPE = (1, 8192, 64, 128)
BYTES = int(np.prod(SHAPE))  # one byte per element of the E4M3 side


def wall_us(fn, *args, loop=20, reps=5):
    """Microseconds per call: best of `reps` loops of `loop` (`bench_cudnn.best_per_call`)."""
    return best_per_call(fn, args, loop=loop, reps=reps) * 1e6


def torch_us(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(5):
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        torch.cuda.synchronize()
        best = min(best, e0.elapsed_time(e1) / n * 1e3)
    return best


def report(name, us, traffic_bytes, extra=""):
    print(f"{name:44s} {us:8.1f} us  {traffic_bytes / us / 1e6:5.2f} TB/s  {extra}", flush=True)


def quant_xla(x, s):
    return jnp.clip(x.astype(jnp.float32) / s, -448, 448).astype(jnp.float8_e4m3fn)


def quant_packed(x, s):
    y = quant_xla(x, s)
    words = jax.lax.bitcast_convert_type(jnp.reshape(y, y.shape[:-1] + (y.shape[-1] // 4, 4)), jnp.uint32)
    return words


def dequant_xla(x8, c):
    return (x8.astype(jnp.float32) / c).astype(jnp.bfloat16)


def dequant_packed(words, c):
    x8 = jax.lax.bitcast_convert_type(words, jnp.float8_e4m3fn)
    return dequant_xla(jnp.reshape(x8, x8.shape[:-2] + (-1,)), c)


ROWS = 64  # rows of 1024 elements per Pallas program


def _quant_kernel(s_ref, x_ref, o_ref):
    o_ref[...] = jnp.clip(x_ref[...].astype(jnp.float32) / s_ref[0], -448.0, 448.0).astype(jnp.float8_e4m3fn)


def _dequant_kernel(c_ref, x_ref, o_ref):
    o_ref[...] = (x_ref[...].astype(jnp.float32) / c_ref[0]).astype(jnp.bfloat16)


def pallas_map(kernel, out_dtype, x, s, rows=ROWS):
    flat = jnp.reshape(x, (-1, 1024))
    m = flat.shape[0]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(flat.shape, out_dtype),
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((rows, 1024), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, 1024), lambda i: (i, 0)),
    )(jnp.reshape(s, (1,)), flat)
    return jnp.reshape(out, x.shape)


def main():
    xt = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    report("torch bf16 clone", torch_us(lambda: xt.clone()), 4 * BYTES)
    report("torch bf16 -> e4m3 (.to)", torch_us(lambda: xt.to(torch.float8_e4m3fn)), 3 * BYTES)
    x8t = xt.to(torch.float8_e4m3fn)
    report("torch e4m3 -> bf16 (.to)", torch_us(lambda: x8t.to(torch.bfloat16)), 3 * BYTES)

    x = jax.random.normal(jax.random.key(0), SHAPE, jnp.float32).astype(jnp.bfloat16)
    s = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
    c = jnp.float32(37.0)
    report("xla bf16 x*2", wall_us(jax.jit(lambda a: a * 2), x), 4 * BYTES)
    report("xla amax", wall_us(jax.jit(lambda a: jnp.max(jnp.abs(a.astype(jnp.float32)))), x), 2 * BYTES)
    ref = jax.jit(quant_xla)(x, s)
    report("xla quant (attnlib form)", wall_us(jax.jit(quant_xla), x, s), 3 * BYTES)
    packed = jax.jit(quant_packed)(x, s)
    same = np.array_equal(np.asarray(jax.lax.bitcast_convert_type(packed, jnp.uint8)).reshape(-1),
                          np.asarray(jax.lax.bitcast_convert_type(ref, jnp.uint8)).reshape(-1))
    report("xla quant packed u32", wall_us(jax.jit(quant_packed), x, s), 3 * BYTES, f"equal={same}")
    deq = jax.jit(dequant_xla)(ref, c)
    report("xla dequant (attnlib form)", wall_us(jax.jit(dequant_xla), ref, c), 3 * BYTES)
    report("xla dequant packed u32", wall_us(jax.jit(dequant_packed), packed, c), 3 * BYTES,
           f"equal={np.array_equal(np.asarray(jax.jit(dequant_packed)(packed, c)), np.asarray(deq))}")
    for rows in (16, 64, 256):
        try:
            fq = jax.jit(functools.partial(pallas_map, _quant_kernel, jnp.float8_e4m3fn, rows=rows))
            eq = np.array_equal(np.asarray(fq(x, s).astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))
            report(f"pallas quant rows={rows}", wall_us(fq, x, s), 3 * BYTES, f"equal={eq}")
            fd = jax.jit(functools.partial(pallas_map, _dequant_kernel, jnp.bfloat16, rows=rows))
            eq = np.array_equal(np.asarray(fd(ref, c)), np.asarray(deq))
            report(f"pallas dequant rows={rows}", wall_us(fd, ref, c), 3 * BYTES, f"equal={eq}")
        except Exception as e:  # noqa: BLE001
            print(f"pallas rows={rows}: {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
