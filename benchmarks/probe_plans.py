"""Probe (H200): every cuDNN backend plan the heuristics offer for the forward graphs where tokamax's forward led
(issue 17: MLA 192/128, b1 · s16384, GQA window, the small shapes), each timed by the native extension as the
autotuner times its candidates — not only the first `MAX_AUTOTUNE_CANDIDATES` (`ATTNLIB_CUDNN_AUTOTUNE=all`).

Usage: ATTNLIB_CACHE_DIR=$(mktemp -d) python benchmarks/probe_plans.py [--only NAME ...] [--layout heads_major]
(one line per graph: label | plan record with every plan's kernel time). `--layout heads_major` describes Q, K, V,
O and their gradients to cuDNN as `[B, N, T, H]` in memory (BHSD) instead of attnlib's `[B, T, N, H]` (BSHD): the
plans' kernel times for a caller whose arrays were already heads-major (the graphs are only built and timed here,
never run on JAX arrays; a fresh ATTNLIB_CACHE_DIR keeps the two layouts' plans apart).
"""

import argparse
import os

import jax
import jax.numpy as jnp

import attnlib
from attnlib._src.backends.cudnn import executor, graphs
from attnlib._src.backends.cudnn.graph_spec import Uid


CALLS = {  # name: (q shape, k shape, v shape, kwargs)
    "mla_192_128_causal": ((4, 4096, 16, 192), (4, 4096, 16, 192), (4, 4096, 16, 128), dict(is_causal=True)),
    "long_b1_s16384_h16": ((1, 16384, 16, 128), (1, 16384, 16, 128), (1, 16384, 16, 128), dict(is_causal=True)),
    "gqa_window_1024": ((1, 8192, 32, 128), (1, 8192, 8, 128), (1, 8192, 8, 128),
                        dict(is_causal=True, local_window_size=(1024, 0))),
    "small_b2_s1024_d64": ((2, 1024, 16, 64), (2, 1024, 16, 64), (2, 1024, 16, 64), dict(is_causal=True)),
    "small_b8_s512_d128": ((8, 512, 16, 128), (8, 512, 16, 128), (8, 512, 16, 128), dict(is_causal=True)),
}  # fmt: skip


DENSE = (Uid.Q, Uid.K, Uid.V, Uid.O, Uid.DQ, Uid.DK, Uid.DV, Uid.DO)


def heads_major(layout):
    """`graphs._layout` with the dense Q, K, V, O (and gradients) strided as `[B, N, T, H]` in memory."""

    def described(uid, spec):
        dims, strides = layout(uid, spec)
        if uid in DENSE and not spec.pages and not spec.ragged:
            _, heads, rows, dim = dims
            return dims, [heads * rows * dim, rows * dim, dim, 1]
        return dims, strides

    return described


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--layout", choices=("bshd", "heads_major"), default="bshd")
    args = parser.parse_args()
    if args.layout == "heads_major":
        graphs._layout = heads_major(graphs._layout)
    os.environ["ATTNLIB_CUDNN_AUTOTUNE"] = "all"  # time every backend plan
    for name, (qs, ks, vs, kw) in CALLS.items():
        if args.only and name not in args.only:
            continue
        q, k, v = (jnp.zeros(s, jnp.bfloat16) for s in (qs, ks, vs))
        loss = lambda q, k, v, kw=kw: jnp.sum(attnlib.attention(q, k, v, implementation="cudnn", **kw))  # noqa: E731
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v)
        jax.jit(lambda q, k, v, kw=kw: attnlib.attention(q, k, v, implementation="cudnn", **kw)).lower(q, k, v)
        print(name, flush=True)
    for entry in list(executor.CACHE._memory.values()):
        print(entry.label, "|", entry.plan, flush=True)


if __name__ == "__main__":
    main()
