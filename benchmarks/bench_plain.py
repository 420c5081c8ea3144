"""Plain-JAX implementations: `xla` vs `xla_chunked` vs `jax.nn.dot_product_attention`.

Forward and forward+backward wall-clock time (jit, best of repeats after one warm-up call, `block_until_ready`:
`harness.best_per_call` with loops of one call) and the
compiled program's memory (arguments + outputs + temporaries, from XLA's memory analysis). A case whose compiled
memory exceeds `--memory-limit-gb` is reported as not run with the memory it would need.

Usage:
    python benchmarks/bench_plain.py [--lengths 512 2048 16384] [--out results.json]
"""

import argparse
import json
import pathlib
import platform
import time

import harness  # run as a script: benchmarks/ is on sys.path
import jax

import attnlib


def _peers(causal: bool):
    def attnlib_impl(name):
        return lambda q, k, v: attnlib.attention(q, k, v, is_causal=causal, implementation=name)

    return {
        "attnlib_xla": attnlib_impl("xla"),
        "attnlib_xla_chunked": attnlib_impl("xla_chunked"),
        "jax_nn_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }


def _compiled_bytes(compiled) -> int | None:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )


def run_case(name, fn, q, k, v, mode, repeats, memory_limit):
    target = jax.jit(fn) if mode == "fwd" else jax.jit(harness.grad_fn(fn))
    compiled = target.lower(q, k, v).compile()
    need = _compiled_bytes(compiled)
    row = {"implementation": name, "mode": mode, "compiled_bytes": need}
    if need is not None and need > memory_limit:
        row.update(status="not run", reason=f"needs {need / 2**30:.1f} GiB > limit {memory_limit / 2**30:.1f} GiB")
        return row
    row.update(status="ok", seconds=harness.best_per_call(compiled, (q, k, v), loop=1, reps=repeats, warmup=1))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-limit-gb", type=float, default=16.0)
    parser.add_argument("--out", default="benchmarks/results/bench_plain_cpu.json")
    args = parser.parse_args()

    rows = []
    for length in args.lengths:
        shape = (args.batch, length, args.heads, args.head_dim)
        q, k, v = harness.normal(shape, shape, shape, dtype=args.dtype)
        for mode in ("fwd", "fwd+bwd"):
            for name, fn in _peers(args.causal).items():
                row = run_case(name, fn, q, k, v, mode, args.repeats, args.memory_limit_gb * 2**30)
                row.update(length=length)
                rows.append(row)
                secs = f"{row['seconds'] * 1e3:10.1f} ms" if row["status"] == "ok" else f"{row['reason']:>10}"
                mem = "?" if row["compiled_bytes"] is None else f"{row['compiled_bytes'] / 2**20:9.0f} MiB"
                print(f"S={length:6d} {mode:8s} {name:22s} {secs}  memory {mem}", flush=True)

    for length in args.lengths:
        for mode in ("fwd", "fwd+bwd"):
            got = {r["implementation"]: r for r in rows if r["length"] == length and r["mode"] == mode}
            xla, chunked = got["attnlib_xla"], got["attnlib_xla_chunked"]
            if xla["status"] == chunked["status"] == "ok":
                print(f"S={length} {mode}: xla_chunked / xla time = {chunked['seconds'] / xla['seconds']:.2f}x")

    result = {
        "benchmark": "plain-JAX attention",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "devices": str(jax.devices())},
        "versions": {"jax": jax.__version__, "attnlib": attnlib.__version__},
        "date": time.strftime("%Y-%m-%d"),
        "config": vars(args),
        "rows": rows,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
