"""Probe (H200, issue 17): the backward of few query rows over many keys — cuDNN's backward graph against
`lse_backward` (plain JAX from the forward's statistics) — to place `attention.SHORT_QUERY_*`.

Per shape, forward + backward (gradient of `sum(out * dout)` for q, k, v) of `attnlib.attention(implementation=
"cudnn")` with bottom-right causal and key lengths, traced once with the backward graph forced (the thresholds set so
no call qualifies) and once with `lse_backward` forced; both checked against each other before timing; best of
3 rounds of `best_per_call`, round-robin.

`--profile`: instead, the kernels of one call of each (and of `implementation="xla"`) at the first shape.
`--forms`: instead, `lse_backward` alone in its two forms (elementwise products / matmuls: `PRODUCT_ROWS`) at
b64 · s8192 and T = 1, 2, 4, 16 (4 to 64 query rows per key head).

Usage: python benchmarks/probe_short_query_backward.py [--profile | --forms]
"""

import argparse
import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from kernel_profile import kernel_profile, table

import attnlib
from attnlib._src.backends import lse_backward
from attnlib._src.backends.cudnn import attention as dense


# (B, T, S, N, K): decode-like steps at growing query rows and key lengths (GQA 32/8, d128).
SHAPES = [(b, t, s, 32, 8) for (b, s) in ((64, 8192), (16, 32768), (64, 1024), (8, 4096)) for t in (1, 4, 16, 64)]


@contextlib.contextmanager
def backward(kind: str):
    saved = (dense.SHORT_QUERY_ROWS, dense.SHORT_QUERY_MIN_KEYS, dense.SHORT_QUERY_SCORE_BYTES)
    if kind == "graph":
        dense.SHORT_QUERY_ROWS = -1
    else:
        dense.SHORT_QUERY_ROWS, dense.SHORT_QUERY_MIN_KEYS, dense.SHORT_QUERY_SCORE_BYTES = 1 << 30, 0, 1 << 40
    try:
        yield
    finally:
        dense.SHORT_QUERY_ROWS, dense.SHORT_QUERY_MIN_KEYS, dense.SHORT_QUERY_SCORE_BYTES = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--forms", action="store_true")
    args = parser.parse_args()
    profile = args.profile
    if args.forms:
        return forms()
    print("B T S N K | graph fwd+bwd ms | lse_backward fwd+bwd ms | graph / lse_backward | max |diff| / max |g|")
    for b, t, s, n, k in SHAPES:
        if 4 * b * n * t * s > 1 << 32:
            continue
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, t, n, 128), jnp.bfloat16)
        kk = jax.random.normal(keys[1], (b, s, k, 128), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, k, 128), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, t, n, 128), jnp.bfloat16)
        lengths = jnp.where(jnp.arange(b) % 2 == 1, s * 3 // 4, s).astype(jnp.int32)
        kw = dict(is_causal=True, diagonal_alignment="bottom_right", key_value_seq_lengths=lengths)

        def loss(q, k, v, implementation="cudnn"):
            out = attnlib.attention(q, k, v, implementation=implementation, **kw)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

        fns, grads = {}, {}
        for kind in ("graph", "lse_backward"):
            with backward(kind):
                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                grads[kind] = [np.asarray(g, np.float32) for g in fn(q, kk, v)]  # traced here, under `kind`
            fns[kind] = fn
        if profile:
            fns["xla"] = jax.jit(jax.grad(lambda *a: loss(*a, implementation="xla"), argnums=(0, 1, 2)))
            for kind, fn in fns.items():
                print("\n".join(table(f"{b} {t} {s} {n} {k} {kind}", kernel_profile(fn, (q, kk, v), calls=5))))
            return
        diff = max(float(np.max(np.abs(a - c)) / max(np.max(np.abs(c)), 1e-30))
                   for a, c in zip(grads["lse_backward"], grads["graph"]))  # fmt: skip
        best = {kind: float("inf") for kind in fns}
        for _, kind in itertools.product(range(3), fns):
            best[kind] = min(best[kind], best_per_call(fns[kind], (q, kk, v), loop=10, reps=3) * 1e3)
        print(f"{b} {t} {s} {n} {k} | {best['graph']:.3f} | {best['lse_backward']:.3f} | "
              f"{best['graph'] / best['lse_backward']:.2f} | {diff:.2e}", flush=True)  # fmt: skip


def forms() -> None:
    print("B T S N K | products fwd+bwd ms | matmuls fwd+bwd ms | matmuls / products | max |diff| / max |g|")
    for t in (1, 2, 4, 16):
        b, s, n, k = 64, 8192, 32, 8
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, t, n, 128), jnp.bfloat16)
        kk = jax.random.normal(keys[1], (b, s, k, 128), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, k, 128), jnp.bfloat16)
        dout = jax.random.normal(keys[3], (b, t, n, 128), jnp.bfloat16)
        lengths = jnp.where(jnp.arange(b) % 2 == 1, s * 3 // 4, s).astype(jnp.int32)
        kw = dict(is_causal=True, diagonal_alignment="bottom_right", key_value_seq_lengths=lengths)

        def loss(q, k, v):
            out = attnlib.attention(q, k, v, implementation="cudnn", **kw)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

        fns, grads = {}, {}
        saved = lse_backward.PRODUCT_ROWS
        for form, rows in (("products", 1 << 30), ("matmuls", 0)):
            lse_backward.PRODUCT_ROWS = rows
            with backward("lse_backward"):
                fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                grads[form] = [np.asarray(g, np.float32) for g in fn(q, kk, v)]
            fns[form] = fn
        lse_backward.PRODUCT_ROWS = saved
        diff = max(float(np.max(np.abs(a - c)) / max(np.max(np.abs(c)), 1e-30))
                   for a, c in zip(grads["products"], grads["matmuls"]))  # fmt: skip
        best = {form: float("inf") for form in fns}
        for _, form in itertools.product(range(3), fns):
            best[form] = min(best[form], best_per_call(fns[form], (q, kk, v), loop=10, reps=3) * 1e3)
        print(f"{b} {t} {s} {n} {k} | {best['products']:.3f} | {best['matmuls']:.3f} | "
              f"{best['matmuls'] / best['products']:.2f} | {diff:.2e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
