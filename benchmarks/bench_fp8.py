"""H200 benchmark of FP8 attention on cuDNN (`fp8="current"` and pre-quantized `Fp8Scales` inputs) against attnlib's
bfloat16 cuDNN call and `jax.nn.dot_product_attention(implementation="cudnn")`, all in one process.

Usage: python benchmarks/bench_fp8.py [--json out.json] [--quick] [--gradients [--no-timing]]

Timing: `harness.best_per_call`, the variants of a shape round-robin, best of 3 rounds. `fp8="current"` includes its
amax reductions, quantization and output dequantization; the pre-quantized variants start from E4M3 arrays (one with
the heuristics' first plan instead of the autotuned one). Forward TFLOP/s count `4 · b · n · t · s · d` (halved when
causal). Accuracy: rms / max error of each forward against float64 attention on the last 256 query rows of batch 0,
on the unquantized and on the FP8-dequantized inputs; `--gradients`: that of dq, dk, dv (`gradient_accuracy`).
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


def run_shape(b: int, t: int, n: int, kh: int, d: int, causal: bool, quick: bool) -> dict:
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
    for name, times in harness.round_robin(calls, 1 if quick else 3, reps=3).items():
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


def table(results: dict) -> str:
    lines = ["| shape | variant | fwd ms | TF/s | fwd × bf16 | fwd+bwd ms | fwd+bwd × bf16 | rms err (deq.) "
             "| max err |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results["shapes"].values():
        for name, row in res["variants"].items():
            if "error" in row or "fwd_ms" not in row:
                lines.append(f"| {res['shape']} | {name} | {row.get('error', '')[:80]} |")
                continue
            fb = f"{row['fwd_bwd_ms']:.3f}" if "fwd_bwd_ms" in row else "—"
            fbx = f"{row['fwd_bwd_speedup_vs_attnlib_bf16']:.2f}" if "fwd_bwd_ms" in row else "—"
            e = row["err_vs_f64_on_dequantized_inputs"]
            lines.append(f"| {res['shape']} | {name} | {row['fwd_ms']:.3f} | {row['fwd_tflops']:.0f} | "
                         f"{row['fwd_speedup_vs_attnlib_bf16']:.2f} | {fb} | {fbx} | {e['rms']:.2g} | {e['max']:.2g} |")
    return "\n".join(lines)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gradients", action="store_true", help="gradient accuracy against float64")
    parser.add_argument("--no-timing", action="store_true", help="skip the timed shapes (with --gradients)")
    args = parser.parse_args()
    shapes = {
        "llama_b1_s8192_64_8_causal": (1, 8192, 64, 8, 128, True),
        "b4_s4096_32_8_causal": (4, 4096, 32, 8, 128, True),
        "b4_s4096_32_32_full": (4, 4096, 32, 32, 128, False),
        "b2_s2048_16_16_full": (2, 2048, 16, 16, 128, False),
    }
    if args.quick:
        shapes = {"quick": (1, 512, 8, 2, 128, True)}
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "attnlib": attnlib.__version__, "shapes": {}}
    for name, shape in shapes.items():
        if args.no_timing:
            break
        results["shapes"][name] = run_shape(*shape, quick=args.quick)
        print(name, json.dumps(results["shapes"][name]), flush=True)
    print(table(results))
    if args.gradients:
        results["gradient_accuracy"] = gradient_accuracy(**(dict(t=256) if args.quick else {}))
        print("gradient_accuracy", json.dumps(results["gradient_accuracy"]), flush=True)
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
