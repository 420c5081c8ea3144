"""Probe (H200): where `return_max_logit=True` spends its time on small shapes — the device kernels of attnlib's
cuDNN forward with and without it (JAX's profiler, `kernel_profile.py`), next to wall-clock time per call.

Usage: python benchmarks/probe_max_logit_kernels.py
"""

import jax
import jax.numpy as jnp
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from kernel_profile import kernel_profile, table

import attnlib


SHAPES = {"b2_s1024_16_16_d64_causal": (2, 1024, 16, 64), "b8_s512_16_16_d128_causal": (8, 512, 16, 128)}


def main() -> None:
    for name, (b, s, n, d) in SHAPES.items():
        q, k, v = (jax.random.normal(key, (b, s, n, d), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
        for max_logit in (False, True):
            fn = jax.jit(lambda q, k, v, m=max_logit: attnlib.attention(
                q, k, v, is_causal=True, implementation="cudnn", return_max_logit=m))  # fmt: skip
            wall = best_per_call(fn, (q, k, v), loop=20, reps=5) * 1e6
            label = f"{name} max_logit={max_logit} wall {wall:.1f} us"
            print("\n".join(table(label, kernel_profile(fn, (q, k, v), calls=20))), flush=True)


if __name__ == "__main__":
    main()
