"""H200 benchmark of attnlib's cuDNN path against jax.nn (cudnn and xla) and the raw cuDNN graph.

Usage: python benchmarks/bench_cudnn.py [--json out.json] [--quick]

Timing: `harness.best_per_call`, 10 repetitions of a loop of 20 (forward) or 10 (forward + backward) calls, attnlib
and jax.nn's cuDNN twice each (each keeps its best). The raw graph is the very blob attnlib embeds, deserialized by the
cuDNN frontend's Python API and executed on the same device buffers. TFLOP/s over the visible pairs
(`harness.flops`). Also: graph set-up times in fresh processes (cold and warm disk cache) and each graph's plan.
"""

import contextlib
import dataclasses
import json
import time
from unittest import mock

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    t: int
    n: int
    k: int
    h: int
    hv: int
    causal: bool
    window: int | None = None  # left window (keys i-window..i), causal
    lengths: tuple[int, ...] = ()  # padding: each batch row's query and key length (empty = no padding)


CASES = [
    Case("MHA causal", 4, 4096, 32, 32, 128, 128, True),
    Case("MHA full", 4, 4096, 32, 32, 128, 128, False),
    Case("GQA 32/8 window 1024", 2, 8192, 32, 8, 128, 128, True, 1024),
    Case("MLA 192/128 causal", 2, 4096, 32, 32, 192, 128, True),
    Case("long causal", 1, 16384, 16, 16, 128, 128, True),
    Case("d64 causal", 4, 4096, 32, 32, 64, 64, True),
    Case("d256 causal", 4, 4096, 16, 16, 256, 256, True),
    # Padding lengths (rows past each length are zeros in attnlib's output and gradients).
    Case("padded causal b8", 8, 4096, 32, 8, 128, 128, True, lengths=(4096, 3517, 2900, 2048, 1536, 1024, 700, 333)),
    Case("padded full b8", 8, 2048, 16, 16, 128, 128, False, lengths=(2048, 1999, 1500, 1024, 1000, 640, 512, 77)),
    # Small shapes: launch- and host-overhead-bound (compare milliseconds, not TFLOP/s).
    Case("small b2 s1024 d64", 2, 1024, 16, 16, 64, 64, True),
    Case("small b8 s512 d128", 8, 512, 16, 16, 128, 128, True),
]


def flops(case: Case) -> tuple[float, float]:
    """`harness.flops` of the exact visible (query, key) pairs, summed over the batch and heads."""
    pairs = sum(harness.visible_pairs(s, case.causal, case.window) for s in case.lengths or (case.t,) * case.b)
    return harness.flops(pairs * case.n, case.h, case.hv)


def memset_rows(on: bool):
    """Trace attnlib with (`on`) or without the memset of padded results: as on a cuDNN not known to write zeros in
    padded rows (`support.writes_padding_zeros`)."""
    from attnlib._src.backends.cudnn import support

    return mock.patch.multiple(support, writes_padding_zeros=lambda version: False) if on else contextlib.nullcontext()


def call_kwargs(case: Case) -> dict:
    """The case's keyword arguments, the same for attnlib and jax.nn."""
    kw = dict(is_causal=case.causal, local_window_size=None if case.window is None else (case.window, 0))
    if case.lengths:
        kw |= dict(query_seq_lengths=jnp.asarray(case.lengths, jnp.int32),
                   key_value_seq_lengths=jnp.asarray(case.lengths, jnp.int32))  # fmt: skip
    return kw


def make_fns(case: Case, impl: str):
    import attnlib

    if impl.startswith("attnlib"):
        attend = lambda q, k, v: attnlib.attention(q, k, v, implementation="cudnn", **call_kwargs(case))
    else:
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl, **call_kwargs(case))
    return jax.jit(attend), jax.jit(harness.grad_fn(attend))


def inputs(case: Case):
    shapes = (case.b, case.t, case.n, case.h), (case.b, case.t, case.k, case.h), (case.b, case.t, case.k, case.hv)
    return harness.normal(*shapes, via_float32=True)


def deserialized(entry):
    """`(graph, handle)`: the blob of a built graph entry deserialized by the cuDNN frontend's Python API, to run it
    without XLA (`graph.execute(pack, workspace_pointer, handle=handle)`)."""
    import cudnn

    handle = cudnn.create_handle()
    graph = cudnn.pygraph(handle=handle)
    graph.deserialize(handle, entry.blob)
    return graph, handle


def raw_graph_ms(case: Case, q, k, v) -> float | None:
    """Forward graph blob executed directly by the frontend's Python API (no XLA)."""
    from cuda.bindings import runtime as cudart

    from attnlib._src import attention as api
    from attnlib._src.backends.cudnn import attention as cudnn_attention, executor as cudnn_executor
    from attnlib._src.backends.cudnn.graphs import Uid

    # The static configuration attnlib's own validation gives this call.
    arguments = {**api.ARGUMENT_DEFAULTS, "query": q, "key": k, "value": v, "bias": None, "mask": None}
    config, _ = api._validate(arguments | call_kwargs(case), jnp.asarray)
    plan = cudnn_attention.make_plan(config, case.b, case.t, None)
    spec = plan.inference or plan.fwd  # the forward graph attnlib runs for this call
    entry = cudnn_executor.get_entry(spec)
    graph, handle = deserialized(entry)
    o = jnp.zeros((case.b, case.t, case.n, case.hv), jnp.bfloat16)
    stats = jnp.zeros((case.b, case.n, case.t), jnp.float32)
    ws = jnp.zeros((max(entry.workspace_bytes, 1),), jnp.uint8)
    jax.block_until_ready((o, stats, ws))
    ptr = lambda x: x.unsafe_buffer_pointer()
    pack = {int(Uid.Q): ptr(q), int(Uid.K): ptr(k), int(Uid.V): ptr(v), int(Uid.O): ptr(o)}
    if case.lengths:  # every sequence sees keys: the trimmed query lengths equal the lengths
        seq = jnp.asarray(case.lengths, jnp.int32)
        pack[int(Uid.SEQ_Q)] = pack[int(Uid.SEQ_KV)] = ptr(jax.block_until_ready(seq))
    if spec.stats:
        pack[int(Uid.STATS)] = ptr(stats)
    for _ in range(2):
        graph.execute(pack, ptr(ws), handle=handle)
    cudart.cudaDeviceSynchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            graph.execute(pack, ptr(ws), handle=handle)
        cudart.cudaDeviceSynchronize()
        best = min(best, (time.perf_counter() - start) / 20)
    out_ref = make_fns(case, "attnlib")[0](q, k, v)
    max_diff = float(jnp.max(jnp.abs(out_ref.astype(jnp.float32) - o.astype(jnp.float32))))
    assert max_diff == 0.0, f"raw graph output differs from attnlib's by {max_diff}"
    return best * 1e3


SETUP_SNIPPET = r"""
import time, json, sys
import jax, jax.numpy as jnp, attnlib
jax.devices()
from attnlib._src.backends.cudnn import executor as A
q = jnp.zeros((2, 1024, 8, 128), jnp.bfloat16)
loss = lambda q: jnp.sum(attnlib.attention(q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32))
f = jax.jit(jax.grad(loss))
t1 = time.perf_counter()
lowered = f.lower(q)
t2 = time.perf_counter()
compiled = lowered.compile()
t3 = time.perf_counter()
jax.block_until_ready(compiled(q))
t4 = time.perf_counter()
print(json.dumps({"trace_and_graphs_s": t2 - t1, "xla_compile_s": t3 - t2, "first_run_s": t4 - t3,
                  "builds": A.CACHE.stats["builds"], "disk_hits": A.CACHE.stats["disk_hits"],
                  "graph_get_s": list(A.CACHE.lookup_seconds)}))
"""


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="skip the xla baseline")
    args = parser.parse_args()

    import cudnn

    device = jax.devices()[0]
    meta = {
        "device": device.device_kind, "jax": jax.__version__, "cudnn_frontend": cudnn.__version__,
        "cudnn_backend": cudnn.backend_version(),
    }
    rows = []
    for case in CASES:
        q, k, v = inputs(case)
        fwd_flops, fb_flops = flops(case)
        row = {"case": case.name, "shape": dataclasses.asdict(case), "fwd_flops": fwd_flops, "fwd_bwd_flops": fb_flops}
        # A second round of attnlib and jax.nn cuDNN (each keeps its best of both) evens out clock drift between them.
        impls = ["attnlib", "cudnn"] + ([] if args.quick else ["xla"]) + ["attnlib", "cudnn"]
        if case.lengths:  # padded: also with a memset of the padded rows (the `memset` column)
            impls.append("attnlib_memset")
        for impl in impls:
            try:
                fwd, fwd_bwd = make_fns(case, impl)
                loop_f, loop_b = (20, 10) if impl != "xla" else (3, 2)
                args_qkv = (q, k, v)
                with memset_rows(impl == "attnlib_memset"):
                    for key, fn, loop in ((f"{impl}_fwd_ms", fwd, loop_f), (f"{impl}_fwd_bwd_ms", fwd_bwd, loop_b)):
                        row[key] = min(row.get(key, float("inf")), harness.best_per_call(fn, args_qkv, loop) * 1e3)
            except Exception as e:  # jax.nn cannot run MLA; xla may run out of memory
                row[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        try:
            row["raw_fwd_ms"] = raw_graph_ms(case, q, k, v)
        except Exception as e:
            row["raw_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v

    from attnlib._src.backends.cudnn import executor as cudnn_executor

    # Which cuDNN plan each graph runs: the heuristics' first, or the autotuned one with every candidate's time.
    plans = {entry.label: entry.plan for entry in cudnn_executor.CACHE._memory.values()}
    # Graph set-up: a fresh process with an empty disk cache, then a fresh process with a warm one.
    setup = dict(zip(("cold", "warm"), harness.fresh_processes(SETUP_SNIPPET, JAX_COMPILATION_CACHE_DIR="")))
    harness.write_json(args.json, {"meta": meta, "rows": rows, "setup": setup, "plans": plans})

    tf = lambda fl, ms: f"{fl / (ms * 1e-3) / 1e12:6.0f}" if ms else "     -"
    ms = lambda x: f"{x:8.3f}" if x is not None else "       -"
    print(f"\n{meta}")
    print(f"{'case':22s} {'pass':7s} {'attnlib ms':>10s} {'TF/s':>6s} {'jax.nn ms':>10s} {'TF/s':>6s} {'ratio':>6s} "
          f"{'xla ms':>9s} {'raw ms':>8s} {'vs raw':>7s} {'memset':>8s}")
    for row in rows:
        for kind, fl in (("fwd", row["fwd_flops"]), ("fwd_bwd", row["fwd_bwd_flops"])):
            a = row.get(f"attnlib_{kind}_ms")
            c = row.get(f"cudnn_{kind}_ms")
            x = row.get(f"xla_{kind}_ms")
            raw = row.get("raw_fwd_ms") if kind == "fwd" else None
            ratio = f"{c / a:6.3f}" if a and c else "     -"
            vs_raw = f"{raw / a:7.3f}" if a and raw else "      -"
            print(f"{row['case']:22s} {kind:7s} {ms(a)}   {tf(fl, a)} {ms(c)}   {tf(fl, c)} {ratio} {ms(x)} "
                  f"{ms(raw)} {vs_raw} {ms(row.get(f'attnlib_memset_{kind}_ms'))}")
    print("ratio = jax.nn cudnn time / attnlib time (>= 1 means attnlib is at least as fast); "
          "vs raw = raw graph time / attnlib time; memset = attnlib with the memset of padded results (before).")
    print(f"setup: {json.dumps(setup)}")
    print("plans:")
    for label, plan in sorted(plans.items()):
        print(f"  {label}: {plan}")


if __name__ == "__main__":
    main()
