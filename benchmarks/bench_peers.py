"""GPU benchmarks of attnlib against every JAX peer (jax.nn `cudnn`, tokamax `mosaic`, its Hopper Pallas kernel, and
`triton`), one suite a run (`--suite`), in one process; the method: docs/performance.md.

Usage: python benchmarks/bench_peers.py [--suite calls|decode] [--json out.json] [--only CASE ... (in that order)]
       [--rounds 3] [--direct] [--layers 32] [--mixed-layers 8] [--smoke]

`calls` (default): attnlib `cudnn` on eleven cases, forward and forward + backward (the gradient of `sum(out * dout)`
wrt q, k, v), `{kind}_speed_vs_best_peer`; `--direct` adds attnlib's call with the native executor's CUDA-graph
replay off (`attnlib_cudnn_direct`) and on for every call (`attnlib_cudnn_always`), not peers.

`decode`: the decode loop of docs/performance.md (one jitted `lax.scan` over `--layers` layers), attnlib's paged and
dense caches: `step_ms` (XLA's default flags), `step_ms_min_graph_1` (`xla_gpu_graph_min_graph_size=1`),
`speed_vs_best_peer`, `speed_vs_paged_peer` (the peers on the page pool), the `_direct` / `_always` variants and
`executor_per_step`. Mixed steps (`MIXED`, JSON key `mixed`): `attnlib` is `cache.attend` on a token-major
`PagedKVCache`, `attnlib_dense` (not a peer) runs on the peers' layout; the peers are jax.nn on the same tokens as one
padded dense call with a bottom-right causal `mask` (`jax_nn_cudnn`, `jax_nn`) or as two cuDNN calls
(`jax_nn_cudnn_two_calls`). `--smoke`: a tiny mixed step on any backend, not a measurement.

Each variant is checked against a float32 reference first (a wrong one is not timed, one that cannot run reports
its error), then timed round-robin (`harness.round_robin`, best of `--rounds`); where attnlib trails the best peer,
the kernel time per call (`kernel_us`) of both is profiled in the same run.
"""

import dataclasses
import functools
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


def tokamax_peers(stdout: bool = False, **fixed) -> dict:
    """`tokamax_mosaic` and `tokamax_triton`: `tokamax.dot_product_attention` with that implementation and `fixed`
    keyword arguments; none where tokamax does not import (`harness.tokamax_or_none`)."""
    tokamax = harness.tokamax_or_none(stdout)
    return {f"tokamax_{impl}": functools.partial(tokamax.dot_product_attention, implementation=impl, **fixed)
            for impl in ("mosaic", "triton")} if tokamax else {}  # fmt: skip


def kernel_times(row: dict, fns: dict, field: str, calls: int) -> None:
    """`row[label][field]`: the kernel time per call of each `{label: (fn, args)}` (`kernel_profile`, each call
    waited for, in the same process as the wall clocks), or its error."""
    for label, (fn, args) in fns.items():
        try:
            row[label][field] = kernel_profile(fn, args, calls=calls)["kernel_us"]
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            row[label][field.replace("_us", "_error")] = harness.error(e, 200)


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
    return table | tokamax_peers()


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
    """Where attnlib trails the best peer: the kernel time per call of both and their ratio."""
    kernel_times(row, {label: (timed[label][kind], args) for label in labels}, f"{kind}_kernel_us", calls=10)
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
    trails = [(name, row, kind) for name, row in results.items() for kind in ("fwd", "fwd_bwd")
              if f"{kind}_kernel_vs_best_peer" in row]  # fmt: skip
    if trails:
        lines += ["", "Where attnlib trails, device kernel time per call (same run):"]
    for name, row, kind in trails:
        mine, ratio = row["attnlib_cudnn"][f"{kind}_kernel_us"], row[f"{kind}_kernel_vs_best_peer"]
        lines.append(f"- {name}, {kind}: attnlib's kernels {mine:.1f} µs a call, best peer's {ratio * mine:.1f} "
                     f"({ratio:.2f}×)")  # fmt: skip
    return "\n".join(lines)


def calls(args) -> dict:
    harness.check_names(args.parser, args.only, CASES)
    results = {}
    for name in args.only or CASES:  # in the order given
        results[name] = run_case(name, CASES[name], args.rounds, args.direct)
        print(name, json.dumps(results[name]), flush=True)
        harness.write_json(args.json, {**harness.device_and_jax(), "cases": results})
    print(table(results))
    return results


N, K, H, PAGE = 32, 8, 128, 64
SHAPES = {  # name: (batch, context)
    "b1_ctx1k": (1, 1024), "b1_ctx32k": (1, 32768), "b8_ctx8k": (8, 8192), "b64_ctx1k": (64, 1024),
    "b64_ctx8k": (64, 8192), "b16_ctx32k": (16, 32768),
}  # fmt: skip


def paged(k, v, page_size: int):
    """`(k_pool, v_pool, page_table)` of dense caches `[B, S, K, H]`: the pages of each sequence in a shuffled pool
    (as a cache that grew by appends would hold them)."""
    b, pages_per_seq = k.shape[0], k.shape[1] // page_size
    order = np.random.default_rng(0).permutation(b * pages_per_seq)
    page_table = jnp.asarray(order.reshape(b, pages_per_seq), jnp.int32)
    pages = lambda x: x.reshape((b * pages_per_seq, page_size) + x.shape[2:])  # noqa: E731
    pool = lambda x: jnp.zeros_like(pages(x)).at[page_table.reshape(-1)].set(pages(x))  # noqa: E731
    return pool(k), pool(v), page_table


def gather_pages(pool, page_table):
    """A sequence's pages as a dense cache, as a jax.nn user gathers them: `[P, page, K, H]` -> `[B, S, K, H]`."""
    pages = jnp.take(pool, page_table, axis=0)  # [B, pages_per_seq, page, K, H]
    return jnp.reshape(pages, (page_table.shape[0], -1) + pool.shape[2:])


def reads_pages(label: str) -> bool:
    """The variant's cache is the page pool (else the dense cache)."""
    return label.startswith("attnlib_paged") or label == "jax_nn_cudnn_paged"


def layer_fns(lengths, page_table):
    """name -> attention(q [B, 1, N, H], k, v) for one layer (k, v dense caches or page pools)."""
    table = {
        "attnlib_paged": lambda q, kp, vp: attnlib.attention(
            q, kp, vp, page_table=page_table, key_value_seq_lengths=lengths, is_causal=True,
            diagonal_alignment="bottom_right", implementation="cudnn"),
        "attnlib_dense": lambda q, k, v: attnlib.attention(
            q, k, v, key_value_seq_lengths=lengths, is_causal=True, diagonal_alignment="bottom_right",
            implementation="cudnn"),
    }  # fmt: skip
    # The same two calls with the native executor's CUDA-graph replay off (`_direct`, compiled with
    # ATTNLIB_CUDNN_GRAPH_REPLAY=0) and on for every call (`_always`): not peers.
    for mode in ("direct", "always"):
        table[f"attnlib_paged_{mode}"] = table["attnlib_paged"]
        table[f"attnlib_dense_{mode}"] = table["attnlib_dense"]
    table |= {
        "jax_nn_cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"),
        # jax.nn has no paged cache: a jax.nn user gathers the sequence's pages into a dense cache first.
        "jax_nn_cudnn_paged": lambda q, kp, vp: jax.nn.dot_product_attention(
            q, gather_pages(kp, page_table), gather_pages(vp, page_table), key_value_seq_lengths=lengths,
            implementation="cudnn"),
    }  # fmt: skip
    return table | tokamax_peers(stdout=True, key_value_seq_lengths=lengths)


CONFIGS = {"": None, "_min_graph_1": {"xla_gpu_graph_min_graph_size": 1}}  # step_ms suffix: jit compiler_options


def decode_step(attend, layers: int, options: dict | None = None):
    def step(x, k, v):
        def layer(x, _):
            return (attend(x, k, v).astype(jnp.float32) * 0.5 + x.astype(jnp.float32)).astype(x.dtype), None

        return jax.lax.scan(layer, x, None, length=layers)[0]

    return jax.jit(step, compiler_options=options)


def compare(row: dict, steps: dict, suffix: str) -> None:
    """attnlib's speed against the best peer (`speed_vs_best_peer`) and, paged, the best on the page pool
    (`speed_vs_paged_peer`); where it trails, the kernel time per step (`kernel_us`) of it, that peer and attnlib's
    dense call."""
    key = f"step_ms{suffix}"
    peers = {label: r[key] for label, r in row.items() if not label.startswith("attnlib") and key in r}
    paged_peers = [ms for label, ms in peers.items() if reads_pages(label)]
    if not peers:
        return
    best = min(peers, key=peers.get)
    for label in [name for name in row if name.startswith("attnlib") and key in row[name]]:
        row[label][f"speed_vs_best_peer{suffix}"] = peers[best] / row[label][key]
        if reads_pages(label) and paged_peers:
            row[label][f"speed_vs_paged_peer{suffix}"] = min(paged_peers) / row[label][key]
    trailing = [label for label in ("attnlib_paged", "attnlib_dense")
                if row.get(label, {}).get(f"speed_vs_best_peer{suffix}", 1.0) < 1.0]  # fmt: skip
    if trailing:
        labels = {*trailing, "attnlib_dense", best}
        kernel_times(row, {label: steps[label, suffix] for label in labels if (label, suffix) in steps},
                     f"kernel_us{suffix}", calls=5)  # fmt: skip


def timed_steps(row: dict, fns: dict, reference, tol: float, layers: int, rounds: int, loop: int, reps: int) -> dict:
    """Each `{label: (attend, args, to_reference)}`: one layer checked against `reference` (a wrong or failing one is
    reported in `row[label]`, not timed), then its `layers`-layer step compiled per `CONFIGS` (in the label's graph
    replay mode) and timed round-robin into `row[label]["step_ms<suffix>"]`, with what the native executor did
    (`executor_per_step<suffix>`, attnlib's variants on a GPU). Returns the steps, `{(label, suffix): (step, args)}`."""
    steps = {}
    for label, (attend, call_args, to_reference) in fns.items():
        try:
            with harness.graph_replay(label):
                row[label] = harness.checked(to_reference(jax.jit(attend)(*call_args)), reference, tol)
                if "wrong" in row[label]:
                    continue
                for suffix, options in CONFIGS.items():
                    steps[label, suffix] = decode_step(attend, layers, options).lower(*call_args).compile(), call_args
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            row[label] = {"error": harness.error(e)}
    calls = {(label, f"step_ms{suffix}"): (step, args, loop) for (label, suffix), (step, args) in steps.items()}
    for label, times in harness.round_robin(calls, rounds, reps).items():
        row[label].update(times)
    for (label, suffix), (step, call_args) in steps.items():
        if label.startswith("attnlib") and jax.default_backend() == "gpu":
            row[label][f"executor_per_step{suffix}"] = executor_counts_per_step(step, call_args)
    return steps


def executor_counts_per_step(step, call_args, steps: int = 4) -> dict[str, float]:
    """What the native executor did per step (`_attnlib_ffi.graph_replay_counts`): calls replayed, run directly,
    recorded into XLA's command buffer (XLA records a command buffer again when it must update it)."""
    from attnlib import _attnlib_ffi

    jax.block_until_ready(step(*call_args))
    before = _attnlib_ffi.graph_replay_counts()
    for _ in range(steps):
        jax.block_until_ready(step(*call_args))
    after = _attnlib_ffi.graph_replay_counts()
    return {name: (after[name] - before[name]) / steps for name in after}


PROMPTS = (512, 768, 1024, 1280, 1536, 1792, 2048, 1024)  # mixed steps: 8 prompts and 56 decodes over 2048 tokens
MIXED = {f"mixed_8x512to2k_56x2k_p{p}": harness.PagedCase(0, 0, N, K, H, p, PROMPTS, 56, 2048) for p in (32, 64)}
SMOKE_MIXED = {"smoke_mixed": harness.PagedCase(0, 0, 4, 2, 16, 8, (7, 12, 5), decodes=4, decode_length=19)}
MIXED_PEERS = ("jax_nn_cudnn", "jax_nn_cudnn_two_calls", "jax_nn")


def mixed_inputs(case: harness.PagedCase):
    """Packed queries `[T, N, H]`, the token-major `PagedKVCache` of the step (pages shuffled), `cu_seqlens_q`, and
    the same tokens dense: queries `[B, T_max, N, H]`, keys and values `[B, S, K, H]`, `S` = the longest cache."""
    q_lengths, kv_lengths = np.asarray(case.q_lengths), np.asarray(case.kv_lengths)
    B, T_max, S = len(q_lengths), int(q_lengths.max()), int(kv_lengths.max())
    pages_per_seq = -(-S // case.page_size)
    kv_shape = (B, pages_per_seq * case.page_size, case.k, case.h)
    q, k, v = harness.normal((int(q_lengths.sum()), case.n, case.h), kv_shape, kv_shape, seed=1)
    cache = harness.token_major_cache(*paged(k, v, case.page_size), kv_lengths)
    cu = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    token_rows = np.concatenate([b * T_max + np.arange(t) for b, t in enumerate(q_lengths)])  # packed -> dense rows
    dense_q = jnp.zeros((B * T_max, case.n, case.h), q.dtype).at[token_rows].set(q).reshape(B, T_max, case.n, case.h)
    return q, cache, jnp.asarray(cu), dense_q, k[:, :S], v[:, :S], token_rows


def mixed_fns(case: harness.PagedCase, q, cache, cu, dense_q, k, v, token_rows):
    """name -> (attention(x, k, v) of one layer, its arguments, its output packed): `attnlib` reads the packed queries
    and the page pools, the others the dense queries and caches."""
    T_max = max(case.q_lengths)
    q_lengths = jnp.asarray(case.q_lengths, jnp.int32)
    kv_lengths = jnp.asarray(case.kv_lengths, jnp.int32)
    P = len(case.prompts)

    def attnlib_paged(x, k_pages, v_pages):
        c = dataclasses.replace(cache, pools=(k_pages, v_pages))
        return c.attend(x, cu_seqlens_q=cu, max_seqlen_q=T_max)

    def bottom_right_mask(t: int, s: int):  # [B, 1, t, s]: each sequence's last query on its last key
        i, j = jnp.arange(t)[None, :, None], jnp.arange(s)[None, None, :]
        return (j <= i + (kv_lengths - q_lengths)[:, None, None])[:, None]

    def jax_nn(implementation):
        return lambda x, k, v: jax.nn.dot_product_attention(
            x, k, v, mask=bottom_right_mask(x.shape[1], k.shape[1]), query_seq_lengths=q_lengths,
            key_value_seq_lengths=kv_lengths, implementation=implementation)  # fmt: skip

    def two_calls(x, k, v):
        prompts = jax.nn.dot_product_attention(
            x[:P], k[:P], v[:P], is_causal=True, query_seq_lengths=q_lengths[:P],
            key_value_seq_lengths=kv_lengths[:P], implementation="cudnn")  # fmt: skip
        decodes = jax.nn.dot_product_attention(
            x[P:, :1], k[P:], v[P:], key_value_seq_lengths=kv_lengths[P:], implementation="cudnn")  # fmt: skip
        return jnp.concatenate([prompts, jnp.pad(decodes, ((0, 0), (0, T_max - 1), (0, 0), (0, 0)))])

    dense = {
        "attnlib_dense": lambda x, k, v: attnlib.attention(
            x, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, is_causal=True,
            diagonal_alignment="bottom_right"),
        "jax_nn_cudnn": jax_nn("cudnn"), "jax_nn_cudnn_two_calls": two_calls, "jax_nn": jax_nn(None),
    }  # fmt: skip
    packed = lambda out: out.reshape((-1,) + out.shape[2:])[token_rows]  # noqa: E731
    return {"attnlib": (attnlib_paged, (q, *cache.pools), lambda out: out)} | {
        label: (attend, (dense_q, k, v), packed) for label, attend in dense.items()}


def run_mixed(case: harness.PagedCase, args) -> dict:
    q, cache, cu, dense_q, k, v, token_rows = mixed_inputs(case)
    kv_of = lambda b, s: (k[b, :s], v[b, :s])  # noqa: E731
    reference = harness.packed_reference(q, kv_of, case.q_lengths, case.kv_lengths, case.n, case.k, case.h)
    tol = harness.tolerance(reference)
    T_max = max(case.q_lengths)
    row = {"case": dataclasses.asdict(case), "tolerance": tol, "variants": {}}
    row["attnlib_pick"] = attnlib.explain(q, cache, None, cu_seqlens_q=cu, max_seqlen_q=T_max, is_causal=True,
                                          diagonal_alignment="bottom_right").implementation  # fmt: skip
    fns = mixed_fns(case, q, cache, cu, dense_q, k, v, token_rows)
    timed_steps(row["variants"], fns, reference, tol, args.mixed_layers, args.rounds, loop=5, reps=3)
    for suffix in CONFIGS:
        ours = row["variants"].get("attnlib", {}).get(f"step_ms{suffix}")
        peers = {p: row["variants"].get(p, {}).get(f"step_ms{suffix}") for p in MIXED_PEERS}
        peers = {p: ms for p, ms in peers.items() if ms is not None}
        if ours is None or not peers:
            continue
        for peer, ms in peers.items():
            row[f"speed_vs_{peer}{suffix}"] = ms / ours
        row[f"speed_vs_best_peer{suffix}"] = min(peers.values()) / ours
    return row


def decode(args) -> dict:
    shapes, mixed = ({}, SMOKE_MIXED) if args.smoke else (SHAPES, MIXED)
    harness.check_names(args.parser, args.only, [*shapes, *mixed])
    results, mixed_results = {}, {}

    def write():
        harness.write_json(args.json, {**harness.device_and_jax(), "layers": args.layers, "shapes": results,
                                       "mixed_layers": args.mixed_layers, "mixed": mixed_results, "smoke": args.smoke})

    for name, (b, context) in shapes.items():
        if args.only is not None and name not in args.only:
            continue
        x, k, v = harness.normal((b, 1, N, H), (b, context, K, H), (b, context, K, H))
        lengths = jnp.asarray(context - 17 * np.arange(b) % context, jnp.int32)
        k_pool, v_pool, page_table = paged(k, v, PAGE)
        reference = harness.reference(x, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                      diagonal_alignment="bottom_right")  # one layer's  # fmt: skip
        tol = harness.tolerance(reference)
        row, same = {}, lambda out: out  # noqa: E731
        fns = {label: (attend, (x, k_pool, v_pool) if reads_pages(label) else (x, k, v), same)
               for label, attend in layer_fns(lengths, page_table).items()}  # fmt: skip
        steps = timed_steps(row, fns, reference, tol, args.layers, args.rounds, loop=10, reps=5)
        for suffix in CONFIGS:
            compare(row, steps, suffix)
        results[name] = row
        print(name, json.dumps(row), flush=True)
        write()
    for name, case in mixed.items():
        if args.only is not None and name not in args.only:
            continue
        mixed_results[name] = run_mixed(case, args)
        print(name, json.dumps(mixed_results[name]), flush=True)
        write()
    return {"shapes": results, "mixed": mixed_results}


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, only="cases, run in that order", rounds=3)
    parser.add_argument("--suite", choices=("calls", "decode"), default="calls")
    parser.add_argument("--direct", action="store_true", help="calls: also attnlib without graph replay, and always")
    parser.add_argument("--layers", type=int, default=32, help="decode: layers a step")
    parser.add_argument("--mixed-layers", type=int, default=8, help="decode: layers a step of the mixed cases")
    parser.add_argument("--smoke", action="store_true", help="decode: a tiny mixed step only, on any backend")
    args = parser.parse_args(argv)
    args.parser = parser
    return {"calls": calls, "decode": decode}[args.suite](args)


if __name__ == "__main__":
    main()
