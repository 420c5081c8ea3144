"""Probe (H200, issue 17): where a forward call's time goes when calls run back to back, for the cases where a peer
leads — device busy time (the kernels), device idle time (waiting for the host) and the host events that take the
most time, per call, for attnlib's cuDNN call (with and without the native executor's CUDA-graph replay), jax.nn's
and tokamax's, all in one process.

Usage: python benchmarks/probe_call_gaps.py [--calls 30] [--only CASE ...]
"""

import argparse

import jax
import jax.numpy as jnp
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from bench_peers import _kwargs, _peer_kwargs, CASES, compile_variant, variants
from kernel_profile import event_rows, kernel_profile, pipelined_profile


GAP_CASES = ("mla_192_128_causal_b4_s4096_h16", "gqa_32_8_window1024_b1_s8192", "small_b2_s1024_h16_d64",
             "small_b8_s512_h16_d128")  # fmt: skip


def inputs(case):
    """Random bf16 q, k, v of `case` (the same for every probe of one case)."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (case.b, case.t, case.n, case.h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (case.b, case.s, case.k, case.h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (case.b, case.s, case.k, case.hv), jnp.bfloat16)
    return q, k, v


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--grad", action="store_true", help="also forward + backward")
    args = parser.parse_args()
    for name in args.only or GAP_CASES:
        case = CASES[name]
        q, k, v = inputs(case)
        kw = _kwargs(case)
        print(f"\n== {name}", flush=True)
        for label, fn in variants(case, direct=True).items():
            call_kw = kw if label.startswith("attnlib") else _peer_kwargs(case, kw)
            calls = {"fwd": lambda q, k, v, fn=fn, call_kw=call_kw: fn(q, k, v, **call_kw)}
            if args.grad:
                loss = lambda q, k, v, fn=fn, call_kw=call_kw: jnp.sum(fn(q, k, v, **call_kw).astype(jnp.float32))  # noqa: E731
                calls["fwd+bwd"] = jax.grad(loss, argnums=(0, 1, 2))
            for kind, traced in calls.items():
                try:
                    call = compile_variant(label, traced, (q, k, v))
                    wall = min(best_per_call(call, (q, k, v), loop=20, reps=5) for _ in range(2)) * 1e6
                    p = pipelined_profile(call, (q, k, v), calls=args.calls)
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    print(f"{label} {kind}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"{label:16s} {kind:7s} wall {wall:8.1f} us | device busy {p['busy_us']:8.1f} "
                      f"idle {p['idle_us']:7.1f} span {p['span_us']:8.1f} us per call", flush=True)  # fmt: skip
                kernels = kernel_profile(call, (q, k, v), calls=10)
                print("\n".join(event_rows(p, kernels, top_kernels=5)), flush=True)


if __name__ == "__main__":
    main()
