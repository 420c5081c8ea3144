"""CPU: attnlib's automatic choice (`implementation=None`) against jax.nn's `xla` and tokamax's `xla_chunked`.

Forward and forward+backward wall-clock time under `jax.jit` (best and median of `--repeats` calls after two warm-up
calls, all variants of a shape timed round-robin in one process), float32, on eight shapes (causal and
full, MHA and GQA, sequence lengths 256–8192). tokamax is optional (it needs Python 3.12; its row is reported as
missing otherwise).

Usage: python benchmarks/bench_cpu_dispatch.py [--json out.json] [--repeats 3] [--quick]
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


def variants(causal: bool) -> dict:
    attend = lambda impl: lambda q, k, v: attnlib.attention(q, k, v, is_causal=causal, implementation=impl)  # noqa: E731
    table = {
        "attnlib_auto": attend(None),
        "attnlib_xla": attend("xla"),
        "attnlib_xla_chunked": attend("xla_chunked"),
        "jax_nn_xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }
    tokamax = harness.tokamax_or_none()
    if tokamax:
        table["tokamax_xla_chunked"] = lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla_chunked"
        )
    return table


def interleaved_seconds(fns: dict, args, repeats: int) -> dict[str, list[float]]:
    """Seconds of one call of each function, `repeats` times, round-robin: one call of every function per round, so
    a slow or fast spell of the machine (this VM's speed drifts by up to 2x for minutes) falls on all of them alike."""
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


def run_shape(b, s, n, k, h, causal, repeats) -> dict:
    q, kk, v = harness.normal((b, s, n, h), (b, s, k, h), (b, s, k, h), dtype="float32")
    fns, rows = {}, {}
    for name, fn in variants(causal).items():
        fns[(name, "fwd")], fns[(name, "fwd_bwd")] = jax.jit(fn), jax.jit(harness.grad_fn(fn))
    for key, fn in list(fns.items()):
        try:
            jax.block_until_ready(fn(q, kk, v))
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            rows[key[0]] = {"error": harness.error(e, 200)}
            del fns[key]
    times = interleaved_seconds(fns, (q, kk, v), repeats)
    for (name, kind), seconds in times.items():
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


def main() -> None:
    parser = harness.parser(__doc__, only="shape names")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shapes = {n: s for n, s in SHAPES.items() if args.only is None or n in args.only}
    if args.quick:
        shapes = {"quick": (1, 256, 4, 2, 32, True)}
    results = {"machine": platform.platform(), "cpus": jax.local_device_count(), "jax": jax.__version__,
               "date": time.strftime("%Y-%m-%d"), "shapes": {}}  # fmt: skip
    nan = float("nan")
    for name, shape in shapes.items():
        results["shapes"][name] = run_shape(*shape, repeats=args.repeats)
        rows = results["shapes"][name]
        line = " ".join(
            f"{v}={r.get('fwd_ms', nan):.0f}/{r.get('fwd_bwd_ms', nan):.0f}"
            f" (median {r.get('fwd_median_ms', nan):.0f}/{r.get('fwd_bwd_median_ms', nan):.0f})"
            for v, r in rows.items()
        )
        print(f"{name} (auto -> {rows['attnlib_auto']['chosen']}): {line}", flush=True)
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
