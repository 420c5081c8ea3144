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


def _problem(b: int, t: int, s: int, n: int, k: int):
    """bf16 `(q, k, v)`, the cotangent and the loss `sum(out * dout)` of one shape (key lengths 3/4 on odd rows)."""
    keys = jax.random.split(jax.random.key(0), 4)
    qkv = (jax.random.normal(keys[0], (b, t, n, 128), jnp.bfloat16),
           jax.random.normal(keys[1], (b, s, k, 128), jnp.bfloat16),
           jax.random.normal(keys[2], (b, s, k, 128), jnp.bfloat16))  # fmt: skip
    dout = jax.random.normal(keys[3], (b, t, n, 128), jnp.bfloat16).astype(jnp.float32)
    lengths = jnp.where(jnp.arange(b) % 2 == 1, s * 3 // 4, s).astype(jnp.int32)
    kw = dict(is_causal=True, diagonal_alignment="bottom_right", key_value_seq_lengths=lengths)

    def loss(q, k, v, implementation="cudnn"):
        return jnp.sum(attnlib.attention(q, k, v, implementation=implementation, **kw).astype(jnp.float32) * dout)

    return qkv, loss


def _traced(loss, qkv, under: dict) -> tuple[dict, dict]:
    """label -> the jitted gradient traced (and run once) inside the context `under[label]`, and its gradients."""
    fns, grads = {}, {}
    for label, context in under.items():
        with context:
            fns[label] = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            grads[label] = [np.asarray(g, np.float32) for g in fns[label](*qkv)]
    return fns, grads


def _row(shape, fns: dict, grads: dict, qkv) -> str:
    """Best of 3 round-robin rounds of each; the first two compared (max |diff| over the largest entry)."""
    (a, fa), (c, fc) = list(fns.items())[:2]
    diff = max(float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)) for x, y in zip(grads[a], grads[c]))
    best = {label: float("inf") for label in fns}
    for _, label in itertools.product(range(3), fns):
        best[label] = min(best[label], best_per_call(fns[label], qkv, loop=10, reps=3) * 1e3)
    return f"{' '.join(map(str, shape))} | {best[a]:.3f} | {best[c]:.3f} | {best[a] / best[c]:.2f} | {diff:.2e}"


@contextlib.contextmanager
def product_rows(rows: int):
    saved = lse_backward.PRODUCT_ROWS
    lse_backward.PRODUCT_ROWS = rows
    try:
        with backward("lse_backward"):
            yield
    finally:
        lse_backward.PRODUCT_ROWS = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--forms", action="store_true")
    args = parser.parse_args()
    if args.forms:
        print("B T S N K | matmuls fwd+bwd ms | products fwd+bwd ms | matmuls / products | max |diff| / max |g|")
        for t in (1, 2, 4, 16):
            qkv, loss = _problem(64, t, 8192, 32, 8)
            fns, grads = _traced(loss, qkv, {"matmuls": product_rows(0), "products": product_rows(1 << 30)})
            print(_row((64, t, 8192, 32, 8), fns, grads, qkv), flush=True)
        return
    print("B T S N K | graph fwd+bwd ms | lse_backward fwd+bwd ms | graph / lse_backward | max |diff| / max |g|")
    for shape in SHAPES:
        b, t, s, n, _ = shape
        if 4 * b * n * t * s > 1 << 32:
            continue
        qkv, loss = _problem(*shape)
        fns, grads = _traced(loss, qkv, {"graph": backward("graph"), "lse_backward": backward("lse_backward")})
        if args.profile:
            fns["xla"] = jax.jit(jax.grad(lambda *a: loss(*a, implementation="xla"), argnums=(0, 1, 2)))
            for label, fn in fns.items():
                name = f"{' '.join(map(str, shape))} {label}"
                print("\n".join(table(name, kernel_profile(fn, qkv, calls=5))))
            return
        print(_row(shape, fns, grads, qkv), flush=True)


if __name__ == "__main__":
    main()
