"""GPU benchmark: a realistic decode step — one jitted `lax.scan` over 32 layers of single-token
attention against a KV cache of `context` tokens per sequence — attnlib (paged cache and dense cache with lengths)
against jax.nn `cudnn` and tokamax (`mosaic`, `triton`), one process. jax.nn has no paged cache: its peer on the
page pool (`jax_nn_cudnn_paged`) gathers each sequence's pages into a dense cache first, as a jax.nn user must; the
paged variants are compared with every peer (`speed_vs_best_peer`, the dense-cache ones included) and with the
peers on the page pool (`speed_vs_paged_peer`). Where attnlib trails the best peer, the step's kernel time
(`kernel_us`) of attnlib's paged and dense calls and of that peer is profiled in the same run: what cuDNN's paged
kernel costs against its dense one.

Usage: python benchmarks/bench_decode.py [--json out.json] [--only NAME ...] [--rounds 3] [--layers 32]

Each layer reads the same cache (one cache per variant: 32 real caches of the larger shapes would not fit; the cache
is far larger than L2, so every layer still streams it from HBM) and feeds its output to the next layer's query.
Sequence lengths are `context - 17 b` (distinct per row). Outputs of one layer are checked against a float32
reference before timing. Timing: `bench_cudnn.best_per_call` (wall clock, best of repetitions), round-robin, best
of `--rounds`. Every variant runs twice: jitted with XLA's default flags (`step_ms`) and with
`compiler_options={"xla_gpu_graph_min_graph_size": 1}` (`step_ms_min_graph_1`), which lets XLA capture the loop
body (the attention call and the layer's two fusions, fewer commands than XLA's default minimum) into a command
buffer (CUDA graph). The `_direct` variants are attnlib's calls with the native executor's CUDA-graph replay off,
the `_always` ones with replay for every call whatever its size (not peers); `executor_per_step` counts what the
native executor did per step.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from bench_peers import graph_replay, replay_mode
from kernel_profile import kernel_profile

import attnlib
from attnlib._src.paged import gather_pages


N, K, H, PAGE = 32, 8, 128, 64
SHAPES = {  # name: (batch, context)
    "b1_ctx1k": (1, 1024), "b1_ctx32k": (1, 32768), "b8_ctx8k": (8, 8192), "b64_ctx1k": (64, 1024),
    "b64_ctx8k": (64, 8192), "b16_ctx32k": (16, 32768),
}  # fmt: skip


def _inputs(b: int, context: int):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (b, 1, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, context, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, context, K, H), jnp.bfloat16)
    lengths = jnp.asarray(context - 17 * np.arange(b) % context, jnp.int32)
    pages_per_seq = context // PAGE
    # Pages of each sequence in a shuffled pool (as a cache that grew by appends would hold them).
    order = np.random.default_rng(0).permutation(b * pages_per_seq)
    page_table = jnp.asarray(order.reshape(b, pages_per_seq), jnp.int32)
    pool = lambda x: jnp.zeros((b * pages_per_seq, PAGE, K, H), x.dtype).at[page_table.reshape(-1)].set(  # noqa: E731
        x.reshape(b * pages_per_seq, PAGE, K, H))
    return x, k, v, lengths, pool(k), pool(v), page_table


def reference_and_tolerance(x, k, v, lengths) -> tuple[np.ndarray, float]:
    """One layer's float32 reference on the bf16 inputs, and the error a variant may have: `4 eps(bf16) max|ref|`."""
    with jax.default_matmul_precision("highest"):
        reference = np.asarray(attnlib.attention(
            x.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), key_value_seq_lengths=lengths,
            is_causal=True, diagonal_alignment="bottom_right", implementation="xla"), np.float32)  # fmt: skip
    return reference, 4 * float(jnp.finfo(jnp.bfloat16).eps) * float(np.max(np.abs(reference)))


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
    try:
        import tokamax

        for impl in ("mosaic", "triton"):
            table[f"tokamax_{impl}"] = lambda q, k, v, impl=impl: tokamax.dot_product_attention(
                q, k, v, key_value_seq_lengths=lengths, implementation=impl)  # fmt: skip
    except Exception as e:  # noqa: BLE001  (reported, not fatal)
        print(f"tokamax unavailable: {type(e).__name__}: {str(e)[:200]}")
    return table


CONFIGS = {"": None, "_min_graph_1": {"xla_gpu_graph_min_graph_size": 1}}  # step_ms suffix: jit compiler_options


def decode_step(attend, layers: int, options: dict | None = None):
    def step(x, k, v):
        def layer(x, _):
            return (attend(x, k, v).astype(jnp.float32) * 0.5 + x.astype(jnp.float32)).astype(x.dtype), None

        return jax.lax.scan(layer, x, None, length=layers)[0]

    return jax.jit(step, compiler_options=options)


def compare(row: dict, steps: dict, suffix: str) -> None:
    """attnlib's speed against the best peer (`speed_vs_best_peer`: every peer, the dense-cache ones included) and,
    for the paged variants, against the best peer on the same page pool (`speed_vs_paged_peer`). Where attnlib's
    paged or dense call trails the best peer, the device's kernel time per step (`kernel_us`) of it, of that peer and
    of attnlib's dense call (the dense graph beside the paged one), same run."""
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
        for label in {*trailing, "attnlib_dense", best}:
            if (label, suffix) in steps:
                step, call_args = steps[(label, suffix)]
                try:
                    row[label][f"kernel_us{suffix}"] = kernel_profile(step, call_args, calls=5)["kernel_us"]
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    row[label][f"kernel_error{suffix}"] = f"{type(e).__name__}: {str(e)[:200]}"


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    results = {}
    for name, (b, context) in SHAPES.items():
        if args.only is not None and name not in args.only:
            continue
        x, k, v, lengths, k_pool, v_pool, page_table = _inputs(b, context)
        reference, tol = reference_and_tolerance(x, k, v, lengths)
        row, steps = {}, {}
        for label, attend in layer_fns(lengths, page_table).items():
            cache = (k_pool, v_pool) if reads_pages(label) else (k, v)
            try:
                with graph_replay(replay_mode(label)):
                    single = jax.jit(attend).lower(x, *cache).compile()
                err = float(np.max(np.abs(np.asarray(single(x, *cache), np.float32) - reference)))
                row[label] = {"max_err": err}
                if not err <= tol:
                    row[label]["wrong"] = f"max |err| {err:.3g} > {tol:.3g}"
                    continue
                for suffix, options in CONFIGS.items():
                    with graph_replay(replay_mode(label)):
                        step = decode_step(attend, args.layers, options).lower(x, *cache).compile()
                    steps[(label, suffix)] = (step, (x, *cache))
            except Exception as e:  # noqa: BLE001
                row[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for _ in range(args.rounds):
            for (label, suffix), (step, call_args) in steps.items():
                ms = best_per_call(step, call_args, loop=10, reps=5) * 1e3
                row[label][f"step_ms{suffix}"] = min(row[label].get(f"step_ms{suffix}", float("inf")), ms)
        for (label, suffix), (step, call_args) in steps.items():
            if label.startswith("attnlib"):
                row[label][f"executor_per_step{suffix}"] = executor_counts_per_step(step, call_args)
        for suffix in CONFIGS:
            compare(row, steps, suffix)
        results[name] = row
        print(name, json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "layers": args.layers,
                           "shapes": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
