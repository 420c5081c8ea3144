"""H200 benchmark: packed rows (segment ids) on cuDNN without `max_segments_per_row` (served fused by
default) against the same call with a tight bound, in one process.

Usage: python benchmarks/bench_segments_bound.py [--json out.json] [--variants NAME ...]

Variants per shape, all under `jax.jit` with the segment ids a traced argument unless said: `tight` (the rows' exact
bound given), `default` (no bound: cuDNN with `DEFAULT_SEGMENTS_PER_ROW` behind a `lax.cond` whose other branch is
xla_chunked), `bound_16/32/64` (given), `concrete` (no bound, ids closed over: bound from their values), and
`xla_chunked` (the `cond`'s other branch alone). Timing as `bench_cudnn.py` (`harness.best_per_call`: wall clock, best
of repetitions of a loop).
"""


import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np

import attnlib


def _ids(B, T, runs_per_row, seed):
    rng = np.random.default_rng(seed)
    ids = np.zeros((B, T), np.int32)
    for r in range(B):
        n = int(runs_per_row[r])
        cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)) if n > 1 else np.array([], int)
        bounds = np.concatenate([[0], cuts, [T]])
        for m in range(n):
            ids[r, bounds[m] : bounds[m + 1]] = m + 1
    return jnp.asarray(ids)


SHAPES = {
    "b4_s4096_32_8_d128_8_equal_segments": dict(B=4, T=4096, N=32, K=8, runs=[8] * 4, even=True),
    "b8_s2048_16_16_d128_2to12_segments": dict(B=8, T=2048, N=16, K=16, runs=[2, 12, 5, 9, 3, 7, 11, 4], even=False),
}


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--variants", nargs="*", default=None, help="variant names (default: all; tight always runs)")
    args = parser.parse_args()
    results = {**harness.device_and_jax(), "shapes": {}}
    for name, c in SHAPES.items():
        B, T, N, K = c["B"], c["T"], c["N"], c["K"]
        if c["even"]:
            ids = jnp.asarray(np.repeat(np.arange(1, c["runs"][0] + 1), T // c["runs"][0])[None].repeat(B, 0))
        else:
            ids = _ids(B, T, c["runs"], 0)
        tight = max(c["runs"])
        q, k, v, do = harness.normal((B, T, N, 128), (B, T, K, 128), (B, T, K, 128), (B, T, N, 128))

        def make(impl, bound, traced=True):
            def fwd(q, k, v, ids):
                return attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True, implementation=impl,
                                         max_segments_per_row=bound)

            def fwd_bwd(q, k, v, ids):
                out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, ids), q, k, v)
                return vjp(do)

            if traced:
                return jax.jit(fwd), jax.jit(fwd_bwd)
            return jax.jit(lambda q, k, v, _: fwd(q, k, v, ids)), jax.jit(lambda q, k, v, _: fwd_bwd(q, k, v, ids))

        variants = {
            "tight": make("cudnn", tight), "default": make("cudnn", None), "bound_16": make("cudnn", 16),
            "bound_32": make("cudnn", 32), "bound_64": make("cudnn", 64), "concrete": make("cudnn", None, False),
            "xla_chunked": make("xla_chunked", None),
        }
        if args.variants is not None:
            variants = {label: fns for label, fns in variants.items() if label == "tight" or label in args.variants}
        reference = np.asarray(variants["tight"][0](q, k, v, ids), np.float32)
        row = {"tight_bound": tight}
        for label, (f, fb) in variants.items():
            out = np.asarray(f(q, k, v, ids), np.float32)
            err = float(np.max(np.abs(out - reference)))
            loop = 3 if label == "xla_chunked" else 20
            fwd_ms = harness.best_per_call(f, (q, k, v, ids), loop=loop, reps=5) * 1e3
            fb_ms = harness.best_per_call(fb, (q, k, v, ids), loop=loop, reps=5) * 1e3
            row[label] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms, "max_diff_vs_tight": err}
        for label in variants:
            row[label]["fwd_bwd_speed_vs_tight"] = row["tight"]["fwd_bwd_ms"] / row[label]["fwd_bwd_ms"]
            row[label]["fwd_speed_vs_tight"] = row["tight"]["fwd_ms"] / row[label]["fwd_ms"]
            print(f"{name} {label:12s} fwd {row[label]['fwd_ms']:8.3f} ms ({row[label]['fwd_speed_vs_tight']:.3f}x) "
                  f"fwd+bwd {row[label]['fwd_bwd_ms']:8.3f} ms ({row[label]['fwd_bwd_speed_vs_tight']:.3f}x) "
                  f"max diff {row[label]['max_diff_vs_tight']:.3g}", flush=True)
        results["shapes"][name] = row
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
