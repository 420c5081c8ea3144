"""H200 benchmarks of cuDNN options against the plain cuDNN call, in one process, one suite a run (`--suite`):

- `score_mod` (default): score modifiers (`logits_soft_cap`, ALiBi as a `score_mod`, prefix-LM as a `mask_mod`)
  against the plain causal call, attnlib's `xla_chunked` fallback and tokamax (mosaic), each checked against `xla`;
  then the soft-cap graphs' build seconds in a fresh `ATTNLIB_CACHE_DIR` and whether a second process reads them.
- `max_logit`: the cost of `return_max_logit=True` forward and forward + backward, also with sinks (the statistic
  then takes `max_logit.py`'s separate pass); and jax.nn's cuDNN forward.
- `fp8`: `fp8="current"` and pre-quantized `Fp8Scales` inputs (autotuned or the heuristics' first plan) against the
  bfloat16 call and jax.nn's ([FP8 attention](../docs/fp8.md)); forward TFLOP/s count `4 b n t s d` (halved when
  causal); rms / max error against float64 (last 256 rows of batch 0), at the unquantized and the dequantized
  inputs; `--gradients`: that of dq, dk, dv.
- `segments_bound`: packed rows (segment ids, a traced argument) with the rows' exact bound (`tight`), without one
  (`default`: cuDNN with `DEFAULT_SEGMENTS_PER_ROW` behind a `lax.cond` whose other branch is `xla_chunked`), with
  `bound_16/32/64`, with the ids closed over (`concrete`: the bound from their values) and `xla_chunked` alone.

Usage: python benchmarks/bench_score_mod.py [--suite score_mod|max_logit|segments_bound|fp8] [--json out.json]
       [--only SHAPE ...] [--rounds N] [--quick] [--variants NAME ...] [--gradients [--no-timing]]

Timing: `harness.round_robin`, best of `--rounds` (default 3; `segments_bound`: 1).
"""


import json
import os
import sys
from unittest import mock

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np

import attnlib


def alibi_slopes(n: int) -> jax.Array:
    return (2.0 ** (-8.0 * (jnp.arange(n, dtype=jnp.float32) + 1) / n)).reshape(n, 1, 1)


def alibi(score, batch, head, q_idx, kv_idx, slope):
    return score - slope * (q_idx - kv_idx).astype(jnp.float32)


def prefix_lm(batch, head, q_idx, kv_idx):
    return (kv_idx < 1024) | (kv_idx <= q_idx)


def variants(case: str, n: int):
    """name -> (implementation, attention kwargs): the modifier on cuDNN, the plain causal call, the modifier on
    `xla_chunked` and, for the soft cap, tokamax's."""
    kw = {"softcap": dict(is_causal=True, logits_soft_cap=50.0), "prefix_lm": dict(mask_mod=prefix_lm),
          "alibi": dict(is_causal=True, score_mod=alibi, score_mod_args=(alibi_slopes(n),))}[case]  # fmt: skip
    table = {f"attnlib_cudnn_{case}": ("cudnn", kw), "attnlib_cudnn_plain_causal": ("cudnn", dict(is_causal=True)),
             f"attnlib_xla_chunked_{case}": ("xla_chunked", kw)}  # fmt: skip
    return table | ({"tokamax_mosaic_softcap": ("tokamax_mosaic", kw)} if case == "softcap" else {})


def make_fns(impl: str, kw: dict):
    if impl == "tokamax_mosaic":
        import tokamax

        attend = lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation="mosaic", **kw)
    else:
        attend = lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, **kw)
    return jax.jit(attend), jax.jit(harness.grad_fn(attend))


def run_case(case: str, b: int, t: int, n: int, kh: int, h: int, quick: bool, rounds: int) -> dict:
    q, k, v = harness.normal((b, t, n, h), (b, t, kh, h), (b, t, kh, h), via_float32=True)
    result = {"shape": f"b{b} s{t} {n}/{kh} heads d{h} bf16", "variants": {}}
    fns = {}
    for name, (impl, kw) in variants(case, n).items():
        try:
            fwd, fwd_bwd = make_fns(impl, kw)
            out = np.asarray(fwd(q, k, v)[:1], np.float32)
            err = float(np.max(np.abs(out - harness.reference(q[:1], k[:1], v[:1], **kw))))
            jax.block_until_ready(fwd_bwd(q, k, v))
            fns[name] = (fwd, fwd_bwd)
            result["variants"][name] = {"max_abs_err_vs_f32_row0": err}
        except Exception as e:  # noqa: BLE001  (a peer that cannot run this case is reported, not fatal)
            result["variants"][name] = {"error": harness.error(e)}
    loops = (3, 2) if quick else (20, 10)
    calls = {(name, f"{kind}_ms"): (fn, (q, k, v), loop) for name, (fwd, fwd_bwd) in fns.items()
             for kind, fn, loop in (("fwd", fwd, loops[0]), ("fwd_bwd", fwd_bwd, loops[1]))}  # fmt: skip
    for name, times in harness.round_robin(calls, rounds, reps=3).items():
        result["variants"][name].update(times)
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
    first, second = harness.fresh_processes(BUILD_SNIPPET, BENCH_CAP=repr(cap))
    if "error" in first or "error" in second:
        return {"error": first.get("error") or second["error"]}
    return {
        "first_process_built": first["built"],
        "first_process_build_s_fwd_plus_bwd": sum(s for _, s in first["built"]),
        "second_process_built": second["built"],
        "second_process_disk_hit": not second["built"],
        "second_process_get_entry_s": second["get_seconds"],
    }


def table(results: dict) -> str:
    lines = []
    for case, res in results["cases"].items():
        base = res["variants"].get("attnlib_cudnn_plain_causal", {})
        for name, row in res["variants"].items():
            if "error" in row:
                lines.append([case, name, "—", "—", "—", "—", row["error"][:60]])
                continue
            ratio = lambda kind: row[kind] / base[kind] if base.get(kind) else float("nan")  # noqa: E731
            lines.append([case, name, f"{row['fwd_ms']:.3f}", f"{row['fwd_bwd_ms']:.3f}", f"{ratio('fwd_ms'):.3f}",
                          f"{ratio('fwd_bwd_ms'):.3f}", f"{row['max_abs_err_vs_f32_row0']:.2g}"])  # fmt: skip
    header = ["case", "variant", "fwd ms", "fwd+bwd ms", "fwd ratio vs cudnn plain causal", "fwd+bwd ratio", "err"]
    return harness.markdown(header, lines)


def score_mod(args) -> dict:
    shape = (1, 512, 8, 2, 64) if args.quick else (4, 4096, 32, 8, 128)
    harness.check_names(args.parser, args.only, ("softcap", "alibi", "prefix_lm"))
    results = {**harness.device_and_jax(), "attnlib": attnlib.__version__, "cases": {}}
    rounds = args.rounds or (1 if args.quick else 3)
    for case in args.only or ("softcap", "alibi", "prefix_lm"):
        results["cases"][case] = run_case(case, *shape, quick=args.quick, rounds=rounds)
        print(case, json.dumps(results["cases"][case]), flush=True)
    results["graph_build"] = graph_build(37.5)
    print("graph_build", json.dumps(results["graph_build"]), flush=True)
    print(table(results))
    return results


MAX_LOGIT_SHAPES = {  # name: (b, s, n, k, d, causal)
    "b4_s4096_32_8_d128_causal": (4, 4096, 32, 8, 128, True),
    "b1_s8192_64_8_d128_causal": (1, 8192, 64, 8, 128, True),
    "b4_s4096_32_32_d128_full": (4, 4096, 32, 32, 128, False),
    "b2_s1024_16_16_d64_causal": (2, 1024, 16, 16, 64, True),
}


def max_logit(args) -> dict:
    harness.check_names(args.parser, args.only, MAX_LOGIT_SHAPES, "shapes")
    results = {**harness.device_and_jax(), "shapes": {}}
    for name in args.only or MAX_LOGIT_SHAPES:
        b, s, n, kh, d, causal = MAX_LOGIT_SHAPES[name]
        q, k, v, do = harness.normal((b, s, n, d), (b, s, kh, d), (b, s, kh, d), (b, s, n, d))
        sinks = jnp.zeros((n,), jnp.float32)

        def attend(q, k, v, max_logit=False, sink=False):
            return attnlib.attention(q, k, v, is_causal=causal, implementation="cudnn", return_max_logit=max_logit,
                                     sinks=sinks if sink else None)

        def grads(max_logit):
            def loss(q, k, v):
                res = attend(q, k, v, max_logit)
                out = res[0] if max_logit else res
                return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), res

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

        variants = {
            "fwd": jax.jit(lambda q, k, v: attend(q, k, v)),
            "fwd_max_logit": jax.jit(lambda q, k, v: attend(q, k, v, True)),
            "fwd_sinks": jax.jit(lambda q, k, v: attend(q, k, v, False, True)),
            "fwd_sinks_max_logit_separate_pass": jax.jit(lambda q, k, v: attend(q, k, v, True, True)),
            "jax_nn_cudnn_fwd": jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn")),
            "fwd_bwd": grads(False),
            "fwd_bwd_max_logit": grads(True),
        }  # fmt: skip
        calls = {(None, label): (f, (q, k, v), 20) for label, f in variants.items()}
        row = dict(harness.round_robin(calls, args.rounds or 3)[None])
        row["fwd_overhead"] = row["fwd_max_logit"] / row["fwd"] - 1
        row["fwd_bwd_overhead"] = row["fwd_bwd_max_logit"] / row["fwd_bwd"] - 1
        row["separate_pass_overhead"] = row["fwd_sinks_max_logit_separate_pass"] / row["fwd_sinks"] - 1
        results["shapes"][name] = row
        print(name, json.dumps({key: round(val, 4) for key, val in row.items()}), flush=True)
        harness.write_json(args.json, results)
    return results


SEGMENT_SHAPES = {  # segments per row: `runs`, equal (`even`) or cut at random
    "b4_s4096_32_8_d128_8_equal_segments": dict(B=4, T=4096, N=32, K=8, runs=[8] * 4, even=True),
    "b8_s2048_16_16_d128_2to12_segments": dict(B=8, T=2048, N=16, K=16, runs=[2, 12, 5, 9, 3, 7, 11, 4], even=False),
}


def segment_ids(B: int, T: int, runs: list[int], even: bool, seed: int = 0) -> jax.Array:
    """`[B, T]` ids `1..runs[r]` of row `r`'s segments: equal, or cut at random positions."""
    if even:
        return jnp.asarray(np.repeat(np.arange(1, runs[0] + 1), T // runs[0])[None].repeat(B, 0))
    rng, ids = np.random.default_rng(seed), np.zeros((B, T), np.int32)
    for r, n in enumerate(runs):
        cuts = np.sort(rng.choice(np.arange(1, T), n - 1, replace=False)) if n > 1 else np.array([], int)
        bounds = np.concatenate([[0], cuts, [T]])
        for m in range(n):
            ids[r, bounds[m] : bounds[m + 1]] = m + 1
    return jnp.asarray(ids)


def segments_bound(args) -> dict:
    harness.check_names(args.parser, args.only, SEGMENT_SHAPES, "shapes")
    results = {**harness.device_and_jax(), "shapes": {}}
    for name in args.only or SEGMENT_SHAPES:
        c = SEGMENT_SHAPES[name]
        B, T, N, K = c["B"], c["T"], c["N"], c["K"]
        ids, tight = segment_ids(B, T, c["runs"], c["even"]), max(c["runs"])
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
            err = float(np.max(np.abs(np.asarray(f(q, k, v, ids), np.float32) - reference)))
            row[label] = {"max_diff_vs_tight": err}
        calls = {(label, f"{kind}_ms"): (fn, (q, k, v, ids), 3 if label == "xla_chunked" else 20)
                 for label, fns in variants.items() for kind, fn in zip(("fwd", "fwd_bwd"), fns)}  # fmt: skip
        for label, times in harness.round_robin(calls, args.rounds or 1).items():
            row[label].update(times)
        for label in variants:
            r = row[label]
            r["fwd_bwd_speed_vs_tight"] = row["tight"]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            r["fwd_speed_vs_tight"] = row["tight"]["fwd_ms"] / r["fwd_ms"]
            print(f"{name} {label:12s} fwd {r['fwd_ms']:8.3f} ms ({r['fwd_speed_vs_tight']:.3f}x) "
                  f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms ({r['fwd_bwd_speed_vs_tight']:.3f}x) "
                  f"max diff {r['max_diff_vs_tight']:.3g}", flush=True)  # fmt: skip
        results["shapes"][name] = row
    return results


FP8_SHAPES = {  # name: (b, s, n, k, d, causal)
    "llama_b1_s8192_64_8_causal": (1, 8192, 64, 8, 128, True),
    "b4_s4096_32_8_causal": (4, 4096, 32, 8, 128, True),
    "b4_s4096_32_32_full": (4, 4096, 32, 32, 128, False),
    "b2_s2048_16_16_full": (2, 2048, 16, 16, 128, False),
}


def prequantize(q, k, v):
    """E4M3 copies of `q`, `k`, `v` scaled by their amax / 448, and the scales."""
    scales = [jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0 for x in (q, k, v)]
    return [(x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn) for x, s in zip((q, k, v), scales)], scales


def _reference_rows(q, k, v, causal: bool, rows: int = 256) -> np.ndarray:
    """float64 attention of the last `rows` queries of batch 0, `[rows, n, d]`."""
    q64, k64, v64 = (np.asarray(x[0].astype(jnp.float32), np.float64) for x in (q, k, v))
    t, n, d = q64.shape
    s, kh = k64.shape[0], k64.shape[1]
    qs = q64[t - rows :]
    kr, vr = np.repeat(k64, n // kh, axis=1), np.repeat(v64, n // kh, axis=1)
    logits = np.einsum("ind,jnd->nij", qs, kr, optimize=True) / np.sqrt(d)
    if causal:
        i = np.arange(t - rows, t)[:, None] + (s - t)
        logits = np.where(np.arange(s)[None, :] <= i, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nij,jnd->ind", p, vr, optimize=True)


def _errors(out, exact) -> dict:
    err = np.abs(np.asarray(out[0, -exact.shape[0] :].astype(jnp.float32), np.float64) - exact)
    rms = lambda x: float(np.sqrt(np.mean(x**2)))  # noqa: E731
    return {"rms": rms(err), "max": float(err.max()), "ref_rms": rms(exact)}


def fp8_shape(b: int, t: int, n: int, kh: int, d: int, causal: bool, quick: bool, rounds: int) -> dict:
    q, k, v = harness.normal((b, t, n, d), (b, t, kh, d), (b, t, kh, d), via_float32=True)
    flops = 4 * b * n * t * t * d * (0.5 if causal else 1.0)
    exact = _reference_rows(q, k, v, causal)
    (q8, k8, v8), scales = prequantize(q, k, v)
    deq = [x.astype(jnp.float32) * s for x, s in zip((q8, k8, v8), scales)]
    exact_fp8_inputs = _reference_rows(*deq, causal)
    given = attnlib.Fp8Scales(q=scales[0], k=scales[1], v=scales[2])
    attend = lambda fp8=None: lambda q, k, v: attnlib.attention(  # noqa: E731
        q, k, v, is_causal=causal, implementation="cudnn", fp8=fp8)  # fmt: skip
    table = {  # name: (fn, inputs, differentiable)
        "attnlib_cudnn_bf16": (attend(), (q, k, v), True),
        "attnlib_cudnn_fp8_current": (attend("current"), (q, k, v), True),
        "attnlib_cudnn_fp8_prequantized": (attend(given), (q8, k8, v8), False),
        "attnlib_cudnn_fp8_prequantized_first_plan": (attend(given), (q8, k8, v8), False),
        "jax_nn_cudnn_bf16": (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"), (q, k, v), True),
    }  # fmt: skip
    result = {"shape": f"b{b} s{t} {n}/{kh} heads d{d} {'causal' if causal else 'full'}", "variants": {}}
    timed = {}
    for name, (fn, args, differentiable) in table.items():
        try:
            fwd = jax.jit(fn)
            if name.endswith("_first_plan"):  # compiled with the heuristics' first plan, not the autotuned one
                with mock.patch.dict(os.environ, {"ATTNLIB_CUDNN_AUTOTUNE": "0"}):
                    jax.block_until_ready(fwd(*args))
            out = jax.block_until_ready(fwd(*args))
            row = {"err_vs_f64": _errors(out, exact),
                   "err_vs_f64_on_dequantized_inputs": _errors(out, exact_fp8_inputs)}  # fmt: skip
            fwd_bwd = None
            if differentiable:
                fwd_bwd = jax.jit(harness.grad_fn(fn))
                jax.block_until_ready(fwd_bwd(q, k, v))
            timed[name] = (fwd, fwd_bwd, args)
            result["variants"][name] = row
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            result["variants"][name] = {"error": harness.error(e)}
    loops = (3, 2) if quick else (20, 10)
    calls = {(name, "fwd_ms"): (fwd, args, loops[0]) for name, (fwd, _, args) in timed.items()}
    calls |= {(name, "fwd_bwd_ms"): (fb, (q, k, v), loops[1]) for name, (_, fb, _) in timed.items() if fb is not None}
    for name, times in harness.round_robin(calls, rounds, reps=3).items():
        result["variants"][name].update(times)
        if "fwd_ms" in times:
            result["variants"][name]["fwd_tflops"] = flops / times["fwd_ms"] / 1e9
    base = result["variants"].get("attnlib_cudnn_bf16", {})
    for row in result["variants"].values():
        if "fwd_ms" in row and "fwd_ms" in base:
            row["fwd_speedup_vs_attnlib_bf16"] = base["fwd_ms"] / row["fwd_ms"]
            if "fwd_bwd_ms" in row:
                row["fwd_bwd_speedup_vs_attnlib_bf16"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return result


def gradient_accuracy(b=1, t=1024, n=8, kh=2, d=128) -> dict:
    """Relative rms / max error of dq, dk, dv (causal, bf16 inputs) against float64 gradients at the unquantized and
    at the FP8-dequantized inputs: attnlib bf16 cuDNN, FP8 cuDNN (16-bit backward) and the `xla` FP8 emulation."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from reference import reference_attention_vjp

    q, k, v, d_out = harness.normal((b, t, n, d), (b, t, kh, d), (b, t, kh, d), (b, t, n, d), seed=1, dtype=jnp.float32)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    (q8, k8, v8), scales = prequantize(q, k, v)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
    exact = reference_attention_vjp(f64(q), f64(k), f64(v), d_out=f64(d_out), is_causal=True)
    deq = [f64(x) * float(s) for x, s in zip((q8, k8, v8), scales)]
    exact_deq = reference_attention_vjp(*deq, d_out=f64(d_out), is_causal=True)
    runs = {"attnlib_cudnn_bf16": ("cudnn", None), "attnlib_cudnn_fp8_current": ("cudnn", "current"),
            "attnlib_xla_fp8_emulation": ("xla", "current")}  # fmt: skip
    result = {}
    for name, (impl, fp8) in runs.items():
        loss = lambda q, k, v, impl=impl, fp8=fp8: jnp.sum(
            attnlib.attention(q, k, v, is_causal=True, implementation=impl, fp8=fp8).astype(jnp.float32) * d_out)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        row = {}
        for label, ref in (("vs_exact", exact), ("vs_exact_at_dequantized", exact_deq)):
            for g, key in zip(grads, ("query", "key", "value")):
                err = f64(g) - ref[key]
                row[f"{label}_d{key}"] = {
                    "rel_rms": float(np.sqrt(np.mean(err**2)) / np.sqrt(np.mean(ref[key] ** 2))),
                    "rel_max": float(np.max(np.abs(err)) / np.max(np.abs(ref[key]))),
                }
        result[name] = row
    return result


def fp8_table(results: dict) -> str:
    lines = []
    for res in results["shapes"].values():
        for name, row in res["variants"].items():
            if "error" in row or "fwd_ms" not in row:
                lines.append([res["shape"], name, row.get("error", "")[:80]] + [""] * 6)
                continue
            fb = ["—"] * 2 if "fwd_bwd_ms" not in row else [f"{row['fwd_bwd_ms']:.3f}",
                                                           f"{row['fwd_bwd_speedup_vs_attnlib_bf16']:.2f}"]  # fmt: skip
            e = row["err_vs_f64_on_dequantized_inputs"]
            lines.append([res["shape"], name, f"{row['fwd_ms']:.3f}", f"{row['fwd_tflops']:.0f}",
                          f"{row['fwd_speedup_vs_attnlib_bf16']:.2f}", *fb, f"{e['rms']:.2g}", f"{e['max']:.2g}"])
    return harness.markdown(["shape", "variant", "fwd ms", "TF/s", "fwd × bf16", "fwd+bwd ms", "fwd+bwd × bf16",
                             "rms err (deq.)", "max err"], lines)  # fmt: skip


def fp8(args) -> dict:
    shapes = {"quick": (1, 512, 8, 2, 128, True)} if args.quick else FP8_SHAPES
    harness.check_names(args.parser, args.only, shapes, "shapes")
    results = {**harness.device_and_jax(), "attnlib": attnlib.__version__, "shapes": {}}
    rounds = args.rounds or (1 if args.quick else 3)
    for name in [] if args.no_timing else args.only or shapes:
        results["shapes"][name] = fp8_shape(*shapes[name], quick=args.quick, rounds=rounds)
        print(name, json.dumps(results["shapes"][name]), flush=True)
    print(fp8_table(results))
    if args.gradients:
        results["gradient_accuracy"] = gradient_accuracy(**(dict(t=256) if args.quick else {}))
        print("gradient_accuracy", json.dumps(results["gradient_accuracy"]), flush=True)
    return results


SUITES = {"score_mod": score_mod, "max_logit": max_logit, "segments_bound": segments_bound, "fp8": fp8}


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, only="shapes (cases) of the suite", rounds=None)
    parser.add_argument("--suite", choices=SUITES, default="score_mod")
    parser.add_argument("--rounds", type=int, default=None, help="round-robin rounds (default 3; segments_bound 1)")
    parser.add_argument("--quick", action="store_true", help="score_mod, fp8: small shapes, one round")
    parser.add_argument("--gradients", action="store_true", help="fp8: also the gradients' accuracy against float64")
    parser.add_argument("--no-timing", action="store_true", help="fp8: skip the timed shapes (with --gradients)")
    parser.add_argument("--variants", nargs="*", default=None, help="segments_bound: these (tight always runs)")
    args = parser.parse_args(argv)
    args.parser = parser
    results = SUITES[args.suite](args)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
