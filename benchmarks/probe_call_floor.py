"""Probe (issue 17): the host's floor for one short jitted call, and where attnlib's small forward stands on it.

The small forwards (b2 · s1024 · d64: a 21.6 µs kernel) are host-bound: the wall clock per call, calls back to back,
is the host's time per call. This probe times, in one process, round-robin, best of `--rounds`:

  xla_tiny          `x * 2` on 16 floats: JAX's dispatch and one XLA kernel
  ffi_tiny          a trivial FFI call (`probe_ffi_command_buffer.py`'s copy of 16 bf16, one kernel launch)
  ffi_graph_tiny    the same copy captured once into a one-kernel CUDA graph and launched with cudaGraphLaunch
                    (as attnlib's replay of short calls); `_memset`: a 256-byte memset node before the kernel (as in
                    cuDNN's graphs), `_big_params`: the kernel with a 4000-byte parameter block, `_memset_big_params`
                    both (each handler's own host time per call is printed at exit)
  attnlib_cudnn     attnlib's small forward (replayed from a CUDA graph, the default for short calls)
  attnlib_cudnn_direct   the same with replay off (cuDNN's execute every call)
  tokamax_mosaic, tokamax_triton, jax_nn_cudnn   the peers on the same forward

Usage: python benchmarks/probe_call_floor.py [--rounds 3] [--case small_b2_s1024_h16_d64] [--tiny-only]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from bench_peers import _kwargs, _peer_kwargs, CASES, compile_variant, variants
from probe_call_gaps import inputs
from probe_ffi_command_buffer import _register


def tiny_calls() -> dict:
    """name -> (compiled fn, args) of the floor's calls."""
    x16 = jnp.arange(16, dtype=jnp.float32)
    b16 = x16.astype(jnp.bfloat16)
    copy = lambda target: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(b16.shape, b16.dtype))  # noqa: E731
    plain = lambda x: copy("probe_plain")(x, spin_ns=np.int64(0), blob=np.zeros(1, np.uint8))  # noqa: E731
    return {
        "xla_tiny": (jax.jit(lambda x: x * 2).lower(x16).compile(), (x16,)),
        "ffi_tiny": (jax.jit(plain).lower(b16).compile(), (b16,)),
        **{
            f"ffi_graph{suffix}_tiny": (
                jax.jit(lambda x, nodes=nodes: copy("probe_graph_launched")(x, nodes=np.int64(nodes)))
                .lower(b16)
                .compile(),
                (b16,),
            )
            for nodes, suffix in enumerate(("", "_memset", "_big_params", "_memset_big_params"))
        },
    }


def attention_calls(name: str) -> dict:
    case = CASES[name]
    q, k, v = inputs(case)
    kw = _kwargs(case)
    calls = {}
    for label, fn in variants(case, direct=True).items():
        if label.endswith("_always"):
            continue
        call_kw = kw if label.startswith("attnlib") else _peer_kwargs(case, kw)
        calls[label] = (
            compile_variant(label, lambda q, k, v, fn=fn, kw=call_kw: fn(q, k, v, **kw), (q, k, v)),
            (q, k, v),
        )
    return calls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--case", default="small_b2_s1024_h16_d64")
    parser.add_argument("--tiny-only", action="store_true", help="the floor's calls only (no attention)")
    args = parser.parse_args()
    _register()
    calls = {**tiny_calls(), **({} if args.tiny_only else attention_calls(args.case))}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.rounds):
        for name, (fn, fn_args) in calls.items():
            best[name] = min(best[name], best_per_call(fn, fn_args, loop=50, reps=10) * 1e6)
    print(f"jax {jax.__version__}, {jax.devices()[0]}; µs per call, calls back to back, best of {args.rounds} rounds")
    for name, us in best.items():
        print(f"{name:24s} {us:7.1f}")
    for name in ("attnlib_cudnn", "tokamax_mosaic", "jax_nn_cudnn"):
        if name in calls:  # the operations each call's executable runs (thunks: kernels, custom calls, copies)
            entry = calls[name][0].as_text().split("ENTRY")[-1].splitlines()
            ops = [line.strip()[:150] for line in entry if " = " in line and "parameter(" not in line]
            print(f"{name}: {len(ops)} operations in the entry computation", *ops, sep="\n    ")


if __name__ == "__main__":
    main()
