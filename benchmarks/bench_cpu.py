"""CPU benchmarks, float32 under `jax.jit`, one suite a run (`--suite`): `plain` times attnlib's `xla` and
`xla_chunked` against jax.nn's `xla` and reads the compiled memory; `dispatch` times attnlib's automatic choice
(`implementation=None`) against them and tokamax's `xla_chunked`.

Usage: python benchmarks/bench_cpu.py --suite plain [--json out.json] [--lengths 512 2048 16384] [--causal]
       python benchmarks/bench_cpu.py --suite dispatch [--json out.json] [--only SHAPE ...] [--repeats 3] [--quick]

`plain`: batch 1, 8 heads, d64, best of `--repeats` single calls (`harness.best_per_call`), and the compiled program's
arguments + outputs + temporaries (XLA's memory analysis); one needing more than `--memory-limit-gb` is not run.
`dispatch`: eight shapes, best and median of `--repeats` calls, round-robin: one call of every variant a round, so
that a slow or fast spell of this VM (its speed drifts by up to 2x for minutes) falls on all alike.
"""

import platform
import statistics
import time

import harness  # run as a script: benchmarks/ is on sys.path
import jax

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
PLAIN = {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32"}


def variants(causal: bool, dispatch: bool = False) -> dict:
    """name -> fn(q, k, v): attnlib's `xla` and `xla_chunked` and jax.nn's `xla`; with `dispatch`, attnlib's
    automatic choice first and tokamax's `xla_chunked` last (where tokamax imports)."""
    attend = lambda impl: lambda q, k, v: attnlib.attention(q, k, v, is_causal=causal, implementation=impl)  # noqa: E731
    table = {"attnlib_auto": attend(None)} if dispatch else {}
    table |= {
        "attnlib_xla": attend("xla"),
        "attnlib_xla_chunked": attend("xla_chunked"),
        "jax_nn_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }
    tokamax = harness.tokamax_or_none() if dispatch else None
    if tokamax:
        table["tokamax_xla_chunked"] = lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla_chunked"
        )
    return table


def plain_case(name, fn, q, k, v, mode, repeats, memory_limit) -> dict:
    target = jax.jit(fn) if mode == "fwd" else jax.jit(harness.grad_fn(fn))
    compiled = target.lower(q, k, v).compile()
    m = harness.compiled_bytes(compiled)
    need = None if m is None else m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"]
    row = {"implementation": name, "mode": mode, "compiled_bytes": need}
    if need is not None and need > memory_limit:
        row.update(status="not run", reason=f"needs {need / 2**30:.1f} GiB > limit {memory_limit / 2**30:.1f} GiB")
        return row
    row.update(status="ok", seconds=harness.best_per_call(compiled, (q, k, v), loop=1, reps=repeats, warmup=1))
    return row


def plain(args) -> dict:
    rows = []
    for length in args.lengths:
        shape = (PLAIN["batch"], length, PLAIN["heads"], PLAIN["head_dim"])
        q, k, v = harness.normal(shape, shape, shape, dtype=PLAIN["dtype"])
        for mode in ("fwd", "fwd+bwd"):
            for name, fn in variants(args.causal).items():
                row = plain_case(name, fn, q, k, v, mode, args.repeats, args.memory_limit_gb * 2**30)
                rows.append({**row, "length": length})
                secs = f"{row['seconds'] * 1e3:10.1f} ms" if row["status"] == "ok" else f"{row['reason']:>10}"
                mem = "?" if row["compiled_bytes"] is None else f"{row['compiled_bytes'] / 2**20:9.0f} MiB"
                print(f"S={length:6d} {mode:8s} {name:22s} {secs}  memory {mem}", flush=True)
        for mode in ("fwd", "fwd+bwd"):
            got = {r["implementation"]: r for r in rows if r["length"] == length and r["mode"] == mode}
            xla, chunked = got["attnlib_xla"], got["attnlib_xla_chunked"]
            if xla["status"] == chunked["status"] == "ok":
                print(f"S={length} {mode}: xla_chunked / xla time = {chunked['seconds'] / xla['seconds']:.2f}x")
    config = {"lengths": args.lengths, **PLAIN, "causal": args.causal, "repeats": args.repeats,
              "memory_limit_gb": args.memory_limit_gb}  # fmt: skip
    machine = {"platform": platform.platform(), "processor": platform.processor(), "devices": str(jax.devices())}
    return {"benchmark": "plain-JAX attention", "machine": machine,
            "versions": {"jax": jax.__version__, "attnlib": attnlib.__version__}, "date": time.strftime("%Y-%m-%d"),
            "config": config, "rows": rows}  # fmt: skip


def interleaved_seconds(fns: dict, args, repeats: int) -> dict[str, list[float]]:
    """Seconds of one call of each function, `repeats` times, round-robin (after two warm-up calls of each)."""
    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def dispatch_shape(b, s, n, k, h, causal, repeats) -> dict:
    q, kk, v = harness.normal((b, s, n, h), (b, s, k, h), (b, s, k, h), dtype="float32")
    fns, rows = {}, {}
    for name, fn in variants(causal, dispatch=True).items():
        fns[(name, "fwd")], fns[(name, "fwd_bwd")] = jax.jit(fn), jax.jit(harness.grad_fn(fn))
    for key, fn in list(fns.items()):
        try:
            jax.block_until_ready(fn(q, kk, v))
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            rows[key[0]] = {"error": harness.error(e, 200)}
            del fns[key]
    for (name, kind), seconds in interleaved_seconds(fns, (q, kk, v), repeats).items():
        row = rows.setdefault(name, {})
        row[f"{kind}_ms"] = 1e3 * min(seconds)
        row[f"{kind}_median_ms"] = 1e3 * statistics.median(seconds)
    auto = rows["attnlib_auto"]
    auto["chosen"] = attnlib.explain(q, kk, v, is_causal=causal).implementation
    for peer in ("jax_nn_xla", "tokamax_xla_chunked"):
        if peer in rows and "fwd_ms" in rows[peer]:
            for kind in ("fwd", "fwd_bwd"):
                auto[f"{kind}_speedup_vs_{peer}"] = rows[peer][f"{kind}_ms"] / auto[f"{kind}_ms"]
                auto[f"{kind}_median_speedup_vs_{peer}"] = rows[peer][f"{kind}_median_ms"] / auto[f"{kind}_median_ms"]
    return rows


def dispatch(args) -> dict:
    shapes = {"quick": (1, 256, 4, 2, 32, True)} if args.quick else SHAPES
    harness.check_names(args.parser, args.only, shapes, "shapes")
    results = {"machine": platform.platform(), "cpus": jax.local_device_count(), "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"), "shapes": {}}  # fmt: skip
    nan = float("nan")
    for name in args.only or shapes:
        rows = results["shapes"][name] = dispatch_shape(*shapes[name], repeats=args.repeats)
        line = " ".join(
            f"{v}={r.get('fwd_ms', nan):.0f}/{r.get('fwd_bwd_ms', nan):.0f}"
            f" (median {r.get('fwd_median_ms', nan):.0f}/{r.get('fwd_bwd_median_ms', nan):.0f})"
            for v, r in rows.items()
        )
        print(f"{name} (auto -> {rows['attnlib_auto']['chosen']}): {line}", flush=True)
    return results


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, only="dispatch: shape names")
    parser.add_argument("--suite", choices=("plain", "dispatch"), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 16384], help="plain: sequence lengths")
    parser.add_argument("--causal", action="store_true", help="plain: causal")
    parser.add_argument("--memory-limit-gb", type=float, default=16.0, help="plain: cases needing more are not run")
    parser.add_argument("--quick", action="store_true", help="dispatch: one tiny shape")
    args = parser.parse_args(argv)
    args.parser = parser
    results = {"plain": plain, "dispatch": dispatch}[args.suite](args)
    harness.write_json(args.json, results, indent=2 if args.suite == "plain" else 1)
    return results


if __name__ == "__main__":
    main()
