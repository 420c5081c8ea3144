"""H200 benchmarks of attnlib's cuDNN path, one suite a run (`--suite`), in one process.

Usage: python benchmarks/bench_cudnn.py [--suite dense|ragged] [--json out.json] [--quick] [--profile]

`dense` (default): attnlib against jax.nn (cudnn and xla; `--quick`: no xla) and the raw cuDNN graph (the blob
attnlib embeds, deserialized by the cuDNN frontend's Python API and run on the same buffers), `harness.best_per_call`
with loops of 20 forward or 10 forward + backward calls, attnlib and jax.nn's cuDNN twice each (each keeps its best);
TFLOP/s over the visible pairs (`harness.flops`); graph set-up times in fresh processes (cold and warm disk cache)
and each graph's plan.

`ragged` (docs/performance.md's packed sequences and paged decoding): a packed training batch's THD variants against
the same data padded and a dense batch of as many tokens, TFLOP/s over the real sequences' visible pairs, round-robin
over 3 rounds (`--profile`: the THD calls' kernels); paged decoding's bandwidth against the card's 4.3 TB/s copy; the
cuDNN graphs that 200 training steps of fresh random lengths build.
"""

import contextlib
import dataclasses
import importlib
import json
import time
from unittest import mock

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np


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
    # `attnlib_memset`: traced as on a cuDNN not known to write zeros in padded rows (a memset of the padded results).
    switches = {"support": {"writes_padding_zeros": lambda version: False}} if impl == "attnlib_memset" else {}
    return jax.jit(traced_with(attend, switches)), jax.jit(traced_with(harness.grad_fn(attend), switches))


def raw_graph_ms(case: Case, q, k, v) -> float | None:
    """Forward graph blob executed directly by the frontend's Python API (no XLA)."""
    import cudnn
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
    handle = cudnn.create_handle()  # the blob deserialized by the cuDNN frontend, run without XLA
    graph = cudnn.pygraph(handle=handle)
    graph.deserialize(handle, entry.blob)
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


def dense(args) -> dict:
    import cudnn

    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "cudnn_frontend": cudnn.__version__,
            "cudnn_backend": cudnn.backend_version()}  # fmt: skip
    rows = []
    for case in CASES:
        shapes = (case.b, case.t, case.n, case.h), (case.b, case.t, case.k, case.h), (case.b, case.t, case.k, case.hv)
        q, k, v = harness.normal(*shapes, via_float32=True)
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
                for key, fn, loop in ((f"{impl}_fwd_ms", fwd, loop_f), (f"{impl}_fwd_bwd_ms", fwd_bwd, loop_b)):
                    row[key] = min(row.get(key, float("inf")), harness.best_per_call(fn, (q, k, v), loop) * 1e3)
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
    results = {"meta": meta, "rows": rows, "setup": setup, "plans": plans}
    harness.write_json(args.json, results)

    cell = lambda x, spec=".3f": format(x, spec) if x else "—"  # noqa: E731
    lines = []
    for row in rows:
        for kind, fl in (("fwd", row["fwd_flops"]), ("fwd_bwd", row["fwd_bwd_flops"])):
            a, c, x = (row.get(f"{impl}_{kind}_ms") for impl in ("attnlib", "cudnn", "xla"))
            raw = row.get("raw_fwd_ms") if kind == "fwd" else None
            lines.append([row["case"], kind, cell(a), cell(a and fl / a / 1e9, ".0f"), cell(c),
                          cell(c and fl / c / 1e9, ".0f"), cell(a and c and c / a), cell(x), cell(raw),
                          cell(a and raw and raw / a), cell(row.get(f"attnlib_memset_{kind}_ms"))])  # fmt: skip
    header = ["case", "pass", "attnlib ms", "TF/s", "jax.nn ms", "TF/s", "ratio", "xla ms", "raw ms", "vs raw"]
    print(f"\n{meta}\n" + harness.markdown([*header, "memset"], lines))
    print("ratio = jax.nn cudnn time / attnlib time (>= 1 means attnlib is at least as fast); "
          "vs raw = raw graph time / attnlib time; memset = attnlib with the memset of padded results (before).")
    print(f"setup: {json.dumps(setup)}")
    print("plans:")
    for label, plan in sorted(plans.items()):
        print(f"  {label}: {plan}")
    return results


N, K, H, HV = 32, 8, 128, 128
TOKENS, MAX_LEN = 32768, 4096
COPY_BW = 4.3e12


def draw_lengths(rng: np.random.Generator) -> list[int]:
    lengths, total = [], 0
    while total < TOKENS:
        n = int(min(rng.integers(64, MAX_LEN + 1), TOKENS - total))
        lengths.append(n)
        total += n
    return lengths


def packed_flops(lengths) -> tuple[float, float]:
    return harness.flops(sum(harness.visible_pairs(n) for n in lengths) * N, H, HV)


def causal_tile_efficiency(lengths, tile: int = 128) -> float:
    """Useful (query, key) pairs over the pairs of the 128 x 128 tiles a causal flash-attention kernel computes for
    these sequences: an upper bound, from the lengths alone, of the fraction of peak that any such kernel reaches."""
    useful = sum(harness.visible_pairs(n) for n in lengths)
    tiles = sum(-(-min(n, (m + 1) * tile) // tile) for n in lengths for m in range(-(-n // tile)))
    return useful / (tiles * tile * tile)


def raw_thd_graphs(lengths: list[int], cu: jax.Array, longest_first: bool = False):
    """`(forward(q, k, v), forward_backward(q, k, v))` running only the THD graphs attnlib builds for the packed
    batch (`max_seqlen_q = max_seqlen_kv = MAX_LEN`), their sequence metadata computed once outside: what cuDNN
    alone costs, against which attnlib's THD overhead is measured. `forward_backward` runs the forward graph with
    stats, then the backward graph with `dO = 1` (the cotangent of the benchmark's `sum`).

    `longest_first`: give cuDNN the sequences longest first (their data stays where it is; only the order of the
    lengths and offsets changes), to see whether the kernel's scheduling gains from it.
    No memset of the packed results: the kernels alone."""
    from attnlib._src.backends.cudnn import executor as cudnn_attention, ragged
    from attnlib._src.backends.cudnn.graphs import GraphSpec

    b = ragged.bucket_sequences(len(lengths))
    spec = GraphSpec(direction="fwd", dtype="bfloat16", b=b, t=ragged.bucket_length(MAX_LEN),
                     s=ragged.bucket_length(MAX_LEN), n=N, k=K, h=H, hv=HV, scale=1.0 / float(np.sqrt(H)),
                     right_bound=0, padding=True, ragged=True)  # fmt: skip
    entry = cudnn_attention.get_entry(spec)
    order = np.argsort(-np.asarray(lengths), kind="stable") if longest_first else np.arange(len(lengths))
    cu = np.asarray(cu, np.int32)
    seq = jnp.asarray(np.pad(np.asarray(lengths, np.int32)[order], (0, b - len(lengths))))
    starts = jnp.asarray(np.concatenate([cu[:-1][order], np.full(b + 1 - len(lengths), cu[-1], np.int32)]))
    offsets = [ragged.element_offsets(starts, heads, dim) for heads, dim in ((N, H), (K, H), (K, HV), (N, HV))]

    def forward(q, k, v):
        out, _ = cudnn_attention.ffi_graph_call(spec, entry, q, k, v, *offsets, seq, seq, tokens=(TOKENS, TOKENS))
        return out

    tokens = ragged.bucket_tokens(TOKENS)
    bwd_spec = dataclasses.replace(spec, direction="bwd", t_total=tokens, s_total=tokens)
    bwd_entry = cudnn_attention.get_entry(bwd_spec)

    def forward_backward(q, k, v):
        out, stats = cudnn_attention.ffi_graph_call(spec, entry, q, k, v, *offsets, seq, seq, tokens=(TOKENS, TOKENS))
        d_out = jnp.ones_like(out)
        return cudnn_attention.ffi_graph_call(bwd_spec, bwd_entry, q, k, v, out, d_out, stats, *offsets, seq, seq,
                                              tokens=(TOKENS, TOKENS))  # fmt: skip

    return forward, forward_backward


def traced_with(f, switches: dict):
    """`f` traced with attributes of attnlib modules set, e.g. `{"row_fill": {"set_rows": ...}}`, to compare the
    experimental modes with the defaults in one run. Wrap the whole jitted function (a gradient's backward rule is
    traced after the forward returns)."""
    if not switches:
        return f

    def traced(*args):
        with contextlib.ExitStack() as stack:
            for module, values in switches.items():
                target = importlib.import_module(f"attnlib._src.backends.cudnn.{module}")
                stack.enter_context(mock.patch.multiple(target, **values))
            return f(*args)

    return traced


def packed_batch(results: dict, rows: list, profile: bool = False) -> None:
    import attnlib

    lengths = draw_lengths(np.random.default_rng(0))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q, k, v = harness.normal((TOKENS, N, H), (TOKENS, K, H), (TOKENS, K, HV), via_float32=True)
    fwd_flops, fwd_bwd_flops = packed_flops(lengths)

    # `cu` is an argument, as in a training step: the sequence metadata is computed on device in every call.
    thd = lambda q, k, v, cu: attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True, max_seqlen_q=MAX_LEN,
                                                max_seqlen_kv=MAX_LEN, implementation="cudnn")  # fmt: skip
    thd_unbounded = lambda q, k, v, cu: attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True,
                                                          implementation="cudnn")
    raw_thd, raw_thd_fwd_bwd = raw_thd_graphs(lengths, cu)
    raw_sorted, _ = raw_thd_graphs(lengths, cu, longest_first=True)
    # The order of the sequences given to cuDNN must not change a single output element.
    order_diff = float(jnp.max(jnp.abs(jax.jit(raw_thd)(q, k, v).astype(jnp.float32)
                                       - jax.jit(raw_sorted)(q, k, v).astype(jnp.float32))))  # fmt: skip
    # The same data padded to [B, max_len].
    B, T = len(lengths), max(lengths)
    index = np.full((B, T), TOKENS, np.int64)
    for b, (start, n) in enumerate(zip(np.asarray(cu[:-1]), lengths)):
        index[b, :n] = start + np.arange(n)
    pad = lambda x: jnp.take(jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)]), jnp.asarray(index), 0)
    qp, kp, vp = pad(q), pad(k), pad(v)
    seq = jnp.asarray(lengths, jnp.int32)
    padded_attnlib = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, query_seq_lengths=seq,
                                                       key_value_seq_lengths=seq, implementation="cudnn")
    padded_jax = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=seq,
                                                              key_value_seq_lengths=seq, implementation="cudnn")
    # Dense reference with the same token count.
    qd, kd, vd = (jnp.reshape(x, (8, MAX_LEN) + x.shape[1:]) for x in (q, k, v))
    dense = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn")
    dense_fwd, dense_fwd_bwd = packed_flops([MAX_LEN] * 8)

    from attnlib._src.backends.cudnn import row_fill

    def attnlib_variant(name, f, args, switches=None, work=(fwd_flops, fwd_bwd_flops)):
        return (name, jax.jit(traced_with(f, switches or {})), jax.jit(traced_with(harness.grad_fn(f), switches or {})),
                args, *work)  # fmt: skip

    def raw_variant(name, forward, forward_backward):
        return name, jax.jit(forward), jax.jit(forward_backward), (q, k, v), fwd_flops, fwd_bwd_flops

    variants = [
        attnlib_variant("THD attnlib cudnn", thd, (q, k, v, cu)),
        # Cost breakdown only (its padding rows are left as cuDNN wrote them): the call without the row fill.
        attnlib_variant("THD attnlib cudnn, no row fill (breakdown)", thd, (q, k, v, cu),
                        {"row_fill": {"set_rows": lambda x, zero, nan: x}}),
        attnlib_variant("THD attnlib cudnn, XLA scatter row fill (before)", thd, (q, k, v, cu),
                        {"row_fill": {"set_rows": row_fill.set_rows_scatter}}),
        attnlib_variant("THD attnlib cudnn, stats per token", thd, (q, k, v, cu),
                        {"varlen": {"_ragged_stats": lambda *_: True}}),
        # The default again, compiled separately: the spread between the two is the noise of this measurement.
        attnlib_variant("THD attnlib cudnn, timed again (noise)", thd, (q, k, v, cu), {}),
        attnlib_variant("THD cudnn, no max_seqlen, stats per token", thd_unbounded, (q, k, v, cu),
                        {"varlen": {"_ragged_stats": lambda *_: True}}),
        attnlib_variant("THD cudnn, no max_seqlen, stats automatic", thd_unbounded, (q, k, v, cu), {}),
        attnlib_variant("THD attnlib cudnn, no max_seqlen", thd_unbounded, (q, k, v, cu)),
        raw_variant("THD raw graphs (metadata given, no memset)", raw_thd, raw_thd_fwd_bwd),
        attnlib_variant(f"padded B={B} T={T} attnlib cudnn", padded_attnlib, (qp, kp, vp)),
        attnlib_variant(f"padded B={B} T={T} jax.nn cudnn", padded_jax, (qp, kp, vp)),
        attnlib_variant("dense b8 t4096 attnlib cudnn (reference)", dense, (qd, kd, vd),
                        work=(dense_fwd, dense_fwd_bwd)),
    ]  # fmt: skip
    # Round robin: every variant is timed once per round and keeps its best round, so that the GPU's state when a
    # variant's turn comes (clocks after the compiles, what ran before) does not favour one variant.
    measured = {name: {} for name, *_ in variants}
    for _ in range(3):  # rounds
        for name, fwd, fwd_bwd, args, ff, fbf in variants:
            for mode, fn, loop, work in (("fwd", fwd, 20, ff), ("fwd_bwd", fwd_bwd, 10, fbf)):
                if "error" in measured[name].get(mode, {}):
                    continue
                try:
                    ms = harness.best_per_call(fn, args, loop, reps=3) * 1e3
                except Exception as e:  # reported, never hidden
                    measured[name][mode] = {"error": harness.error(e)}
                    continue
                entry = measured[name].setdefault(mode, {"rounds_ms": []})
                entry["rounds_ms"].append(ms)
                entry["ms"] = min(entry["rounds_ms"])
                entry["tflops"] = work / entry["ms"] / 1e9
    results["packed"] = {"lengths": lengths, "num_sequences": B, "max_len": T, "real_tokens": int(sum(lengths)),
                         "fwd_flops": fwd_flops, "fwd_bwd_flops": fwd_bwd_flops, "variants": measured,
                         "longest_first_max_output_diff": order_diff,
                         "causal_tile_efficiency": causal_tile_efficiency(lengths),
                         "dense_reference_tile_efficiency": causal_tile_efficiency([MAX_LEN] * 8)}  # fmt: skip
    thd_entry = measured["THD attnlib cudnn"]
    for name, entry in measured.items():
        for mode in ("fwd", "fwd_bwd"):
            m = entry[mode]
            if "error" in m:
                rows.append(f"{name:<48} {mode:<8} ERROR {m['error']}")
                continue
            speedup = m["ms"] / thd_entry[mode]["ms"] if "ms" in thd_entry[mode] else float("nan")
            rows.append(f"{name:<48} {mode:<8} {m['ms']:9.3f} {m['tflops']:8.1f} {speedup:10.2f}")
    dense_entry = measured["dense b8 t4096 attnlib cudnn (reference)"]
    padded_entry = measured[f"padded B={B} T={T} attnlib cudnn"]
    targets = {}
    for mode in ("fwd", "fwd_bwd"):
        if all("ms" in e[mode] for e in (thd_entry, dense_entry, padded_entry)):
            of_dense = thd_entry[mode]["tflops"] / dense_entry[mode]["tflops"]
            vs_padded = padded_entry[mode]["ms"] / thd_entry[mode]["ms"]
            targets[mode] = {"fraction_of_dense_tflops": of_dense, "speedup_vs_padded": vs_padded}
            rows.append(f"THD {mode}: {100 * of_dense:.1f} % of dense TFLOP/s (target 85 %), {vs_padded:.2f}x the "
                        f"padded batch (target 2x)")  # fmt: skip
    results["packed"]["targets"] = targets
    if profile:  # where the THD call's time goes, kernel by kernel (JAX's profiler)
        from hlo_and_traces import kernel_profile, kernel_table

        profiles = {}
        for name, fwd, fwd_bwd, args, _, _ in variants:
            if name not in ("THD attnlib cudnn", "THD attnlib cudnn, XLA scatter row fill (before)",
                            "THD raw graphs (metadata given, no memset)"):  # fmt: skip
                continue
            for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                try:
                    profiles[f"{name} [{mode}]"] = kernel_profile(fn, args, calls=10)
                    rows.extend(kernel_table(f"{name} [{mode}]", profiles[f"{name} [{mode}]"]))
                except Exception as e:  # reported, never hidden
                    rows.append(f"profile {name} [{mode}]: ERROR {harness.error(e)}")
        results["packed"]["kernel_profile"] = profiles
    rows.append(f"longest-first order vs given order: max |output difference| = {order_diff}")
    rows.append(f"causal 128x128 tile efficiency: THD lengths {causal_tile_efficiency(lengths):.3f}, dense b8 t4096 "
                f"{causal_tile_efficiency([MAX_LEN] * 8):.3f}")


def paged_decode(results: dict, rows: list) -> None:
    import attnlib

    B, ctx, page, n, kh = 64, 8192, 64, 64, 8
    pps = ctx // page
    P = B * pps
    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.permutation(P).reshape(B, pps).astype(np.int32))
    kpool, vpool, q = harness.normal((P, page, kh, H), (P, page, kh, HV), (B, 1, n, H), seed=1, via_float32=True)
    lengths = jnp.full((B,), ctx, jnp.int32)
    f = jax.jit(lambda q, kp, vp: attnlib.attention(q, kp, vp, page_table=table, key_value_seq_lengths=lengths,
                                                    is_causal=True, diagonal_alignment="bottom_right",
                                                    implementation="cudnn"))  # fmt: skip
    ms = harness.best_per_call(f, (q, kpool, vpool), 20) * 1e3
    kv_bytes = B * ctx * kh * (H + HV) * 2
    bw = kv_bytes / (ms * 1e-3)
    results["paged_decode"] = {"B": B, "context": ctx, "page": page, "N": n, "K": kh, "ms": ms,
                               "kv_bytes": kv_bytes, "bytes_per_s": bw, "fraction_of_copy_bw": bw / COPY_BW}
    rows.append(f"paged decode B64 ctx8192 page64 GQA64/8: {ms:.3f} ms, KV {kv_bytes / 1e9:.2f} GB, "
                f"{bw / 1e12:.2f} TB/s = {100 * bw / COPY_BW:.0f} % of the 4.3 TB/s copy bandwidth")


def graph_builds(results: dict, rows: list) -> None:
    import attnlib
    from attnlib._src.backends.cudnn import executor as cudnn_attention

    rng = np.random.default_rng(2)
    q = jax.ShapeDtypeStruct((TOKENS, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((TOKENS, K, H), jnp.bfloat16)

    def loss(q, k, v, cu):
        return jnp.sum(attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True, max_seqlen_q=MAX_LEN,
                                         max_seqlen_kv=MAX_LEN, implementation="cudnn").astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    cudnn_attention.CACHE.clear_memory()  # count every graph this loop needs: built now or read from disk
    builds0 = cudnn_attention.CACHE.stats["builds"]
    disk0 = cudnn_attention.CACHE.stats["disk_hits"]
    shapes, start = set(), time.perf_counter()
    counts = []
    for _ in range(200):
        n = len(draw_lengths(rng))
        counts.append(n)
        if n not in shapes:  # jax.jit traces once per input shape
            shapes.add(n)
            jax.jit(step).lower(q, kv, kv, jax.ShapeDtypeStruct((n + 1,), jnp.int32))
    seconds = time.perf_counter() - start
    built = cudnn_attention.CACHE.stats["builds"] - builds0
    disk = cudnn_attention.CACHE.stats["disk_hits"] - disk0
    results["graph_builds"] = {"steps": 200, "sequence_counts": sorted(set(counts)), "traced_shapes": len(shapes),
                               "graphs_built": built, "graphs_from_disk": disk, "seconds": seconds}  # fmt: skip
    rows.append(f"200 steps, sequence counts {min(counts)}..{max(counts)} ({len(shapes)} distinct shapes traced): "
                f"{built} cuDNN graphs built, {disk} read from the disk cache (fwd+bwd), {seconds:.1f} s")


def ragged(args) -> dict:
    from attnlib._src.backends.cudnn import support

    dev = support.device()
    results = {"device": dev.name, "jax": jax.__version__, "cudnn_backend": dev.cudnn_version}
    rows = [f"{results}", f"{'variant':<48} {'pass':<8} {'ms':>9} {'TF/s':>8} {'THD spd':>10}"]
    for part in (packed_batch, paged_decode, graph_builds):
        try:
            part(results, rows, **({"profile": args.profile} if part is packed_batch else {}))
        except Exception as e:  # one failing part must not hide the others
            rows.append(f"{part.__name__}: ERROR {harness.error(e, 400)}")
            results[part.__name__] = {"error": f"{type(e).__name__}: {e}"}
        print("\n".join(rows), flush=True)
        print("-" * 40, flush=True)
    rows.append("TF/s on real tokens only; THD spd = variant time / THD time (> 1: THD is faster).")
    print("\n".join(rows))
    return results


def main(argv=None) -> dict:
    parser = harness.parser(__doc__)
    parser.add_argument("--suite", choices=("dense", "ragged"), default="dense")
    parser.add_argument("--quick", action="store_true", help="dense: skip the xla baseline")
    parser.add_argument("--profile", action="store_true", help="ragged: per-kernel device time of the THD calls")
    args = parser.parse_args(argv)
    results = {"dense": dense, "ragged": ragged}[args.suite](args)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
