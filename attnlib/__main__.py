"""`python -m attnlib`: a self-check on this machine.

Prints the platform, the native extension's build versions, which implementations can run, and for each one that
can: one causal attention call (forward and gradient) with its maximum error against a float64 NumPy reference and
its time. Fails (exit status 1) when a result is wrong, and when this machine has an NVIDIA GPU but the cuDNN path
cannot run, with the reason and the command that fixes it.
"""

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnlib
from attnlib._src.backends.cudnn import ffi, support
from attnlib._src.config import IMPLEMENTATIONS


def _reference(q, k, v, scale):
    """float64 causal attention from the definition, `[B, T, N, H]` layout with GQA."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    T, S = s.shape[-2:]
    s = np.where(np.tril(np.ones((T, S), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, v)


def _extension_line() -> str:
    info = ffi.build_info()
    if info is None:
        return "native cuDNN extension: not built"
    major, minor = info["xla_ffi_api"]
    jaxlib = f" of jaxlib {info['jaxlib']}" if info["jaxlib"] else ""
    frontend, cudnn = support.version_string(info["cudnn_frontend"]), support.version_string(info["cudnn"])
    cuda = f"{info['cuda'] // 1000}.{info['cuda'] % 1000 // 10}"
    return (
        f"native cuDNN extension: built against cudnn-frontend {frontend}, cuDNN headers {cudnn}, CUDA {cuda}, "
        f"XLA FFI API {major}.{minor}{jaxlib}"
    )


def _gpu_problem() -> str | None:
    """Why the cuDNN path cannot run although this machine has an NVIDIA GPU, or None."""
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if not (on_gpu or support.nvidia_driver_present()):
        return None
    try:
        device = support.device()
    except NotImplementedError as e:
        return str(e).removeprefix("cudnn: ")
    print(f"GPU: {device.name} (sm_{device.compute_capability[0]}{device.compute_capability[1]}), cuDNN "
          f"{support.version_string(device.cudnn_version)} loaded")
    return None


def _time(fn, *args, repeats=5):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    """Runs the self-check; returns the exit status. A failure of JAX itself (e.g. no `ptxas` to compile with) is
    reported in one line, not a traceback."""
    try:
        return _check(argv)
    except jax.errors.JaxRuntimeError as e:
        first = str(e).strip().splitlines()[0]
        print(f"self-check FAILED: JAX cannot run on this machine: {first}")
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m attnlib", description=__doc__.split("\n\n")[1])
    parser.add_argument("--version", action="version", version=f"attnlib {attnlib.__version__}")
    parser.add_argument("--batch", type=int, default=2, help="batch size B (default: %(default)s)")
    parser.add_argument("--length", type=int, default=512, help="query and key length T = S (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads N (default: %(default)s)")
    parser.add_argument(
        "--kv-heads", type=int, default=2, help="key/value heads K, a divisor of N (GQA; default: %(default)s)"
    )
    parser.add_argument("--head-dim", type=int, default=64, help="head dim H (default: %(default)s)")
    return parser


def problem_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the requested problem's sizes, in one line, or None."""
    for name in ("batch", "length", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1. Got {getattr(args, name)}."
    if args.heads % args.kv_heads:
        return f"--heads must be a multiple of --kv-heads. Got --heads {args.heads}, --kv-heads {args.kv_heads}."
    return None


def _check(argv) -> int:
    args = _parser().parse_args(argv)
    if (error := problem_error(args)) is not None:
        print(f"python -m attnlib: error: {error}", file=sys.stderr)
        return 2

    location = pathlib.Path(attnlib.__file__).resolve().parent
    installed = "" if attnlib.__version__ != "0+unknown" else " — a source tree that is not installed"
    print(f"attnlib {attnlib.__version__} from {location}{installed}; jax {jax.__version__}, devices: {jax.devices()}")
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    keys = jax.random.split(jax.random.key(0), 4)
    B, T, N, K, H = args.batch, args.length, args.heads, args.kv_heads, args.head_dim
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, T, K, H), dtype)
    v = jax.random.normal(keys[2], (B, T, K, H), dtype)
    print(_extension_line())
    if (problem := _gpu_problem()) is not None:
        print(f"self-check FAILED: this machine has an NVIDIA GPU but attnlib's cuDNN path cannot run: {problem}")
        return 1
    print(f"problem: B={B} T=S={T} N={N} K={K} H={H} {jnp.dtype(dtype).name}, causal")

    explanation = attnlib.explain(q, k, v, is_causal=True)
    print(f"implementation=None would run: {explanation.implementation}")
    expected = _reference(q, k, v, 1.0 / np.sqrt(H))
    failures = 0
    for name in IMPLEMENTATIONS:
        reason = attnlib.explain(q, k, v, is_causal=True, implementation=name).declined.get(name)
        if reason is not None:
            print(f"  {name:12s} unavailable: {reason}")
            continue
        forward = jax.jit(lambda q, k, v, name=name: attnlib.attention(q, k, v, is_causal=True, implementation=name))
        grad = jax.jit(
            jax.grad(
                lambda q, k, v, name=name: attnlib.attention(q, k, v, is_causal=True, implementation=name)
                .astype(jnp.float32)
                .sum(),
                argnums=(0, 1, 2),
            )
        )
        out = np.asarray(forward(q, k, v), np.float64)
        error = float(np.max(np.abs(out - expected)))
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v))
        tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        ok = error <= tolerance and finite
        failures += not ok
        print(
            f"  {name:12s} max|out - float64 ref| = {error:.2e} (tol {tolerance:.0e}), gradients finite: {finite}; "
            f"forward {_time(forward, q, k, v) * 1e3:8.2f} ms, forward+backward {_time(grad, q, k, v) * 1e3:8.2f} ms"
            f"  {'OK' if ok else 'FAIL'}"
        )
    print("self-check passed" if failures == 0 else f"self-check FAILED for {failures} implementation(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
