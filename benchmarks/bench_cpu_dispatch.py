"""CPU: attnlib's automatic choice (`implementation=None`) against jax.nn's `xla` and tokamax's `xla_chunked`.

Forward and forward+backward wall-clock time under `jax.jit` (best of `--repeats` after a warm-up call), float32, for
the shapes of issue 16 (causal and full, MHA and GQA, sequence lengths 256–8192), all variants of a shape timed in
one process. tokamax is optional (it needs Python 3.12; its row is reported as missing otherwise).

Usage: python benchmarks/bench_cpu_dispatch.py [--json out.json] [--repeats 3] [--quick]
"""

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path

import attnlib


SHAPES = {  # name: (b, s, n, k, h, causal)
    "b4_s256_h8_d64_full": (4, 256, 8, 8, 64, False),
    "b2_s512_h8_d64_causal": (2, 512, 8, 8, 64, True),
    "b2_s1024_h8_d128_full": (2, 1024, 8, 8, 128, False),
    "b1_s2048_h8_d64_causal": (1, 2048, 8, 8, 64, True),
    "b1_s2048_h8_2_d64_full": (1, 2048, 8, 2, 64, False),
    "b1_s4096_h8_2_d64_causal": (1, 4096, 8, 2, 64, True),
    "b1_s4096_h4_d64_full": (1, 4096, 4, 4, 64, False),
    "b1_s8192_h2_1_d64_causal": (1, 8192, 2, 1, 64, True),
}


def variants(causal: bool) -> dict:
    attend = lambda impl: lambda q, k, v: attnlib.attention(q, k, v, is_causal=causal, implementation=impl)  # noqa: E731
    table = {
        "attnlib_auto": attend(None),
        "attnlib_xla": attend("xla"),
        "attnlib_xla_chunked": attend("xla_chunked"),
        "jax_nn_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }
    try:
        import tokamax

        table["tokamax_xla_chunked"] = lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla_chunked"
        )
    except ImportError:
        pass
    return table


def best_seconds(fn, args, repeats: int) -> float:
    """Seconds of one call: the best of `repeats` (`bench_cudnn.best_per_call`, one call per repetition)."""
    return best_per_call(fn, args, loop=1, reps=repeats)


def run_shape(b, s, n, k, h, causal, repeats) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, s, n, h), jnp.float32)
    kk = jax.random.normal(keys[1], (b, s, k, h), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, k, h), jnp.float32)
    rows = {}
    for name, fn in variants(causal).items():
        fwd = jax.jit(fn)
        fwd_bwd = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
        try:
            rows[name] = {"fwd_ms": 1e3 * best_seconds(fwd, (q, kk, v), repeats),
                          "fwd_bwd_ms": 1e3 * best_seconds(fwd_bwd, (q, kk, v), repeats)}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    auto = rows["attnlib_auto"]
    rows["attnlib_auto"]["chosen"] = attnlib.explain(q, kk, v, is_causal=causal).implementation
    for peer in ("jax_nn_xla", "tokamax_xla_chunked"):
        if peer in rows and "fwd_ms" in rows[peer]:
            auto[f"fwd_speedup_vs_{peer}"] = rows[peer]["fwd_ms"] / auto["fwd_ms"]
            auto[f"fwd_bwd_speedup_vs_{peer}"] = rows[peer]["fwd_bwd_ms"] / auto["fwd_bwd_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="shape names")
    args = parser.parse_args()
    shapes = {n: s for n, s in SHAPES.items() if args.only is None or n in args.only}
    if args.quick:
        shapes = {"quick": (1, 256, 4, 2, 32, True)}
    results = {"machine": platform.platform(), "cpus": jax.local_device_count(), "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"), "shapes": {}}  # fmt: skip
    for name, shape in shapes.items():
        results["shapes"][name] = run_shape(*shape, repeats=args.repeats)
        rows = results["shapes"][name]
        line = " ".join(f"{v}={r.get('fwd_ms', float('nan')):.0f}/{r.get('fwd_bwd_ms', float('nan')):.0f}"
                        for v, r in rows.items())  # fmt: skip
        print(f"{name} (auto -> {rows['attnlib_auto']['chosen']}): {line}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
