"""H200 benchmark of score modifiers on cuDNN (`score_mod`, `mask_mod`, `logits_soft_cap`) against the plain causal
cuDNN call, attnlib's `xla_chunked` fallback and tokamax (mosaic), all in one process.

Usage: python benchmarks/bench_score_mod.py [--json out.json] [--quick]

Timing as `bench_cudnn.py` (`harness.best_per_call`: the best of several repetitions of a loop of calls); variants of
one case are timed round-robin (best of 3 rounds).
Every forward output is first checked against attnlib's `xla` implementation on float32 copies of the inputs.
Graph build: the soft-cap graphs are built in a fresh `ATTNLIB_CACHE_DIR` (seconds per graph, forward and backward),
then a second process traces the same call on that directory and reports whether it read them from disk.
"""

import json
import os
import subprocess
import sys
import tempfile

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp


def alibi_slopes(n: int) -> jax.Array:
    return (2.0 ** (-8.0 * (jnp.arange(n, dtype=jnp.float32) + 1) / n)).reshape(n, 1, 1)


def alibi(score, batch, head, q_idx, kv_idx, slope):
    return score - slope * (q_idx - kv_idx).astype(jnp.float32)


def prefix_lm(batch, head, q_idx, kv_idx):
    return (kv_idx < 1024) | (kv_idx <= q_idx)


def variants(case: str, n: int):
    """name -> (implementation, attention kwargs)."""
    if case == "softcap":
        return {
            "attnlib_cudnn_softcap": ("cudnn", dict(is_causal=True, logits_soft_cap=50.0)),
            "attnlib_cudnn_plain_causal": ("cudnn", dict(is_causal=True)),
            "attnlib_xla_chunked_softcap": ("xla_chunked", dict(is_causal=True, logits_soft_cap=50.0)),
            "tokamax_mosaic_softcap": ("tokamax_mosaic", dict(is_causal=True, logits_soft_cap=50.0)),
        }
    if case == "alibi":
        slopes = alibi_slopes(n)
        return {
            "attnlib_cudnn_alibi": ("cudnn", dict(is_causal=True, score_mod=alibi, score_mod_args=(slopes,))),
            "attnlib_cudnn_plain_causal": ("cudnn", dict(is_causal=True)),
            "attnlib_xla_chunked_alibi": (
                "xla_chunked", dict(is_causal=True, score_mod=alibi, score_mod_args=(slopes,))),
        }
    if case == "prefix_lm":
        return {
            "attnlib_cudnn_prefix_lm": ("cudnn", dict(mask_mod=prefix_lm)),
            "attnlib_cudnn_plain_causal": ("cudnn", dict(is_causal=True)),
            "attnlib_xla_chunked_prefix_lm": ("xla_chunked", dict(mask_mod=prefix_lm)),
        }
    raise ValueError(case)


def make_fns(impl: str, kw: dict):
    import attnlib

    if impl == "tokamax_mosaic":
        import tokamax

        attend = lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation="mosaic", **kw)
    else:
        attend = lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, **kw)
    return jax.jit(attend), jax.jit(harness.grad_fn(attend))


def run_case(case: str, b: int, t: int, n: int, kh: int, h: int, quick: bool) -> dict:
    import attnlib

    q, k, v = harness.normal((b, t, n, h), (b, t, kh, h), (b, t, kh, h), via_float32=True)
    result = {"shape": f"b{b} s{t} {n}/{kh} heads d{h} bf16", "variants": {}}
    fns = {}
    for name, (impl, kw) in variants(case, n).items():
        try:
            fwd, fwd_bwd = make_fns(impl, kw)
            out = jax.block_until_ready(fwd(q, k, v))
            up = [x.astype(jnp.float32) for x in (q[:1], k[:1], v[:1])]
            ref = attnlib.attention(*up, implementation="xla", **kw)
            err = float(jnp.max(jnp.abs(out[:1].astype(jnp.float32) - ref)))
            jax.block_until_ready(fwd_bwd(q, k, v))
            fns[name] = (fwd, fwd_bwd)
            result["variants"][name] = {"max_abs_err_vs_f32_row0": err}
        except Exception as e:  # noqa: BLE001  (a peer that cannot run this case is reported, not fatal)
            result["variants"][name] = {"error": harness.error(e)}
    loops = (3, 2) if quick else (20, 10)
    for _ in range(1 if quick else 3):  # round-robin
        for name, (fwd, fwd_bwd) in fns.items():
            row = result["variants"][name]
            for kind, fn, loop in (("fwd", fwd, loops[0]), ("fwd_bwd", fwd_bwd, loops[1])):
                row[f"{kind}_ms"] = min(row.get(f"{kind}_ms", 1e9), 1e3 * harness.best_per_call(fn, (q, k, v), loop, 3))
    return result


BUILD_SNIPPET = r"""
import json, time, jax, jax.numpy as jnp, attnlib
from attnlib._src.backends.cudnn import executor as A
q = jnp.zeros((1, 256, 8, 64), jnp.bfloat16); k = v = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
cap = float(__import__("os").environ["BENCH_CAP"])
f = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, is_causal=True, logits_soft_cap=cap,
                                              implementation="cudnn").astype(jnp.float32))
t0 = time.perf_counter(); jax.block_until_ready(jax.jit(jax.grad(f))(q, k, v)); total = time.perf_counter() - t0
print(json.dumps({"built": list(A.CACHE.build_seconds), "get_seconds": list(A.CACHE.lookup_seconds), "total_s": total}))
"""


def graph_build(cap: float) -> dict:
    """Build times of a new modifier's graphs in a fresh cache, then a second process on the same cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, ATTNLIB_CACHE_DIR=cache, BENCH_CAP=repr(cap))
        runs = []
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", BUILD_SNIPPET], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                return {"error": done.stderr[-800:]}
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    return {
        "first_process_built": first["built"],
        "first_process_build_s_fwd_plus_bwd": sum(s for _, s in first["built"]),
        "second_process_built": second["built"],
        "second_process_disk_hit": not second["built"],
        "second_process_get_entry_s": second["get_seconds"],
    }


def table(results: dict) -> str:
    lines = ["| case | variant | fwd ms | fwd+bwd ms | fwd ratio vs cudnn plain causal | fwd+bwd ratio | err |",
             "|---|---|---|---|---|---|---|"]
    for case, res in results["cases"].items():
        rows = res["variants"]
        base = rows.get("attnlib_cudnn_plain_causal", {})
        for name, row in rows.items():
            if "error" in row:
                lines.append(f"| {case} | {name} | — | — | — | — | {row['error'][:60]} |")
                continue
            rf = row["fwd_ms"] / base["fwd_ms"] if base.get("fwd_ms") else float("nan")
            rb = row["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base.get("fwd_bwd_ms") else float("nan")
            lines.append(f"| {case} | {name} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | {rf:.3f} | {rb:.3f} | "
                         f"{row['max_abs_err_vs_f32_row0']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import attnlib

    shapes = {"softcap": (4, 4096, 32, 8, 128), "alibi": (4, 4096, 32, 8, 128), "prefix_lm": (4, 4096, 32, 8, 128)}
    if args.quick:
        shapes = {name: (1, 512, 8, 2, 64) for name in shapes}
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "attnlib": attnlib.__version__, "cases": {}}
    for case, shape in shapes.items():
        results["cases"][case] = run_case(case, *shape, quick=args.quick)
        print(case, json.dumps(results["cases"][case]), flush=True)
    results["graph_build"] = graph_build(37.5)
    print("graph_build", json.dumps(results["graph_build"]), flush=True)
    print(table(results))
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
