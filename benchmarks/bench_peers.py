"""GPU benchmark: attnlib `cudnn` against every JAX peer, jax.nn `cudnn` and tokamax `mosaic` (its Hopper Pallas
kernel) and `triton`, one process.

Usage: python benchmarks/bench_peers.py [--json out.json] [--only CASE ... (run in that order)] [--rounds 3] [--direct]

Per case, forward and forward + backward (the gradient of `sum(out * dout)` wrt q, k, v): every variant's output is
first checked against a float32 reference (`harness.checked`; a wrong one is not timed, one that cannot run is
reported with its error), then the variants are timed round-robin (`harness.round_robin`, best of `--rounds`). Where
attnlib trails the best peer, the kernel time per call of both is profiled in the same run (`{kind}_kernel_us`,
`{kind}_kernel_vs_best_peer`). `--direct` adds attnlib's call with the native executor's CUDA-graph replay off
(`attnlib_cudnn_direct`) and on for every call (`attnlib_cudnn_always`), not peers.
"""

import dataclasses
import json

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
from hlo_and_traces import kernel_profile

import attnlib


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    t: int
    s: int
    n: int
    k: int
    h: int
    hv: int
    causal: bool = True
    window: int | None = None  # keys i - window .. i
    lengths: bool = False  # padded rows: key/query lengths 3/4 of the rows on odd batch rows


CASES = {
    "mha_causal_b4_s4096_h32_d128": Case(4, 4096, 4096, 32, 32, 128, 128),
    "mha_full_b4_s4096_h32_d128": Case(4, 4096, 4096, 32, 32, 128, 128, causal=False),
    "gqa_32_8_window1024_b1_s8192": Case(1, 8192, 8192, 32, 8, 128, 128, window=1024),
    "mla_192_128_causal_b4_s4096_h16": Case(4, 4096, 4096, 16, 16, 192, 128),
    "long_b1_s16384_h16_causal": Case(1, 16384, 16384, 16, 16, 128, 128),
    "d64_causal_b4_s4096_h32": Case(4, 4096, 4096, 32, 32, 64, 64),
    "d256_causal_b2_s4096_h16": Case(2, 4096, 4096, 16, 16, 256, 256),
    "small_b2_s1024_h16_d64": Case(2, 1024, 1024, 16, 16, 64, 64),
    "small_b8_s512_h16_d128": Case(8, 512, 512, 16, 16, 128, 128),
    "padded_b8_gqa_32_8_s2048": Case(8, 2048, 2048, 32, 8, 128, 128, lengths=True),
    "decode_t1_s8192_b64_gqa_32_8": Case(64, 1, 8192, 32, 8, 128, 128, lengths=True),
}


def _kwargs(case: Case) -> dict:
    kw = {"is_causal": case.causal}
    if case.window is not None:
        kw["local_window_size"] = (case.window, 0)
    if case.lengths:
        full = lambda n: jnp.where(jnp.arange(case.b) % 2 == 1, n * 3 // 4, n).astype(jnp.int32)  # noqa: E731
        kw["key_value_seq_lengths"] = full(case.s)
        if case.t > 1:
            kw["query_seq_lengths"] = full(case.t)
    return kw


def compile_variant(label: str, fn, args):
    """`jax.jit(fn)` compiled for `args`, with the variant's graph replay mode."""
    with harness.graph_replay(label):
        return jax.jit(fn).lower(*args).compile()


def variants(direct: bool = False) -> dict:
    """name -> fn(q, k, v, **kw) for the peers that exist here (and attnlib's cuDNN call without graph replay and with
    replay on every call if `direct`)."""
    cudnn = lambda q, k, v, **kw: attnlib.attention(q, k, v, implementation="cudnn", **kw)  # noqa: E731
    table = {
        "attnlib_cudnn": cudnn,
        "jax_nn_cudnn": lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw),
    }
    if direct:
        table["attnlib_cudnn_direct"] = table["attnlib_cudnn_always"] = cudnn
    tokamax = harness.tokamax_or_none()
    for impl in ("mosaic", "triton") if tokamax else ():
        table[f"tokamax_{impl}"] = lambda q, k, v, impl=impl, **kw: tokamax.dot_product_attention(
            q, k, v, implementation=impl, **kw
        )
    return table


def run_case(name: str, case: Case, rounds: int, direct: bool = False) -> dict:
    q, k, v, dout = harness.normal((case.b, case.t, case.n, case.h), (case.b, case.s, case.k, case.h),
                                   (case.b, case.s, case.k, case.hv), (case.b, case.t, case.n, case.hv))  # fmt: skip
    kw = _kwargs(case)
    # A decode step: attnlib aligns its query with the last key; jax.nn's causal mask with T=1 would see key 0 only,
    # so the peers run it without `is_causal`.
    ours = dict(kw, is_causal=True, diagonal_alignment="bottom_right") if case.t == 1 else kw
    peers = dict(kw, is_causal=False) if case.t == 1 else kw
    reference = harness.reference(q, k, v, **ours)
    tol = harness.tolerance(reference)
    # Rows past a query length are compared nowhere (peers leave them unspecified).
    rows = np.ones((case.b, case.t), bool)
    if "query_seq_lengths" in kw:
        rows = np.arange(case.t)[None, :] < np.asarray(kw["query_seq_lengths"])[:, None]
    row, timed = {}, {}
    for label, fn in variants(direct).items():
        call_kw = ours if label.startswith("attnlib") else peers
        bound = lambda q, k, v, fn=fn, call_kw=call_kw: fn(q, k, v, **call_kw)  # noqa: E731
        try:
            fwd = compile_variant(label, bound, (q, k, v))
            row[label] = harness.checked(fwd(q, k, v), reference, tol, rows[..., None, None])
            if "wrong" in row[label]:
                continue
        except Exception as e:  # noqa: BLE001
            row[label] = {"error": harness.error(e)}
            continue
        timed[label] = {"fwd": fwd}
        try:
            timed[label]["fwd_bwd"] = compile_variant(label, harness.grad_fn(bound, dout), (q, k, v))
        except Exception as e:  # noqa: BLE001  (e.g. a peer without a backward)
            row[label]["fwd_bwd_error"] = harness.error(e, 200)
    calls = {(label, f"{kind}_ms"): (fn, (q, k, v), 20 if kind == "fwd" else 10)
             for label, fns in timed.items() for kind, fn in fns.items()}  # fmt: skip
    for label, times in harness.round_robin(calls, rounds).items():
        row[label].update(times)
    mine = row.get("attnlib_cudnn", {})
    for kind in ("fwd", "fwd_bwd"):
        peers = {label: r[f"{kind}_ms"] for label, r in row.items()
                 if not label.startswith("attnlib") and isinstance(r, dict) and f"{kind}_ms" in r}  # fmt: skip
        if peers and f"{kind}_ms" in mine:
            best = min(peers, key=peers.get)
            row[f"{kind}_speed_vs_best_peer"] = peers[best] / mine[f"{kind}_ms"]
            if row[f"{kind}_speed_vs_best_peer"] < 1:
                _kernel_times(row, timed, kind, ("attnlib_cudnn", best), (q, k, v))
    return row


def _kernel_times(row: dict, timed: dict, kind: str, labels, args) -> None:
    """Where attnlib trails the best peer: the device's kernel time per call of both (each call waited for,
    `kernel_profile`), in the same process as the wall clocks, and their ratio (`{kind}_kernel_vs_best_peer`)."""
    for label in labels:
        try:
            row[label][f"{kind}_kernel_us"] = kernel_profile(timed[label][kind], args, calls=10)["kernel_us"]
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            row[label][f"{kind}_kernel_error"] = harness.error(e, 200)
    mine, best = (row[label].get(f"{kind}_kernel_us") for label in labels)
    if mine and best:
        row[f"{kind}_kernel_vs_best_peer"] = best / mine


def table(results: dict) -> str:
    labels = ["attnlib_cudnn", "jax_nn_cudnn", "tokamax_mosaic", "tokamax_triton"]
    labels += sorted({label for row in results.values() for label in row if label.startswith("attnlib_")} - {*labels})
    nan = float("nan")
    cell = lambda r: (f"{r['fwd_ms']:.3f} / {r.get('fwd_bwd_ms', nan):.3f}" if "fwd_ms" in r else  # noqa: E731
                      "—" if not r else "wrong" if "wrong" in r else "error")  # fmt: skip
    speed = lambda row: " / ".join(f"{row.get(f'{k}_speed_vs_best_peer', nan):.2f}×" for k in ("fwd", "fwd_bwd"))  # noqa: E731
    lines = [harness.markdown(["case", *labels, "attnlib vs best peer (fwd / fwd+bwd)"],
                              [[name, *(cell(row.get(label, {})) for label in labels), speed(row)]
                               for name, row in results.items()])]  # fmt: skip
    kernels = [_kernel_line(name, row, kind) for name, row in results.items() for kind in ("fwd", "fwd_bwd")
               if f"{kind}_kernel_vs_best_peer" in row]  # fmt: skip
    if kernels:
        lines += ["", "Where attnlib trails, device kernel time per call (same run):", *kernels]
    return "\n".join(lines)


def _kernel_line(name: str, row: dict, kind: str) -> str:
    mine = row["attnlib_cudnn"][f"{kind}_kernel_us"]
    ratio = row[f"{kind}_kernel_vs_best_peer"]
    return f"- {name}, {kind}: attnlib's kernels {mine:.1f} µs a call, best peer's {ratio * mine:.1f} ({ratio:.2f}×)"


def main():
    parser = harness.parser(__doc__, only="cases, run in that order", rounds=3)
    parser.add_argument("--direct", action="store_true", help="also attnlib's cuDNN call without graph replay")
    args = parser.parse_args()
    results = {}
    harness.check_names(parser, args.only, CASES)
    for name in args.only or CASES:  # in the order given
        results[name] = run_case(name, CASES[name], args.rounds, args.direct)
        print(name, json.dumps(results[name]), flush=True)
        harness.write_json(args.json, {**harness.device_and_jax(), "cases": results})
    print(table(results))


if __name__ == "__main__":
    main()
