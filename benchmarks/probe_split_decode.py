"""Probe (issue 17): does splitting the key/value sequence of a decode call (flash-decoding) beat cuDNN's one call?

A single-token query reads `B · S` cached tokens; cuDNN's kernel parallelises over batch and heads (and query tiles),
so at small `B` few CTAs stream the whole cache. Split the cache into `P` chunks — a free reshape `[B, S] ->
[B·P, S/P]` of a dense cache or of a page table — run one cuDNN call over `B·P` "sequences" with each chunk's length,
and combine the `P` partial outputs by their log-sum-exps. `pack` also folds the `G = N/K` query heads of a group
into the query rows (`[B, 1, N, H] -> [B, G, K, H]`, exact for a single query row: its causal mask is the length),
so each CTA serves a key/value head once instead of each of its query heads.

Composed here from the public API (`return_residual=True`); timed as `bench_decode.py` times its step (a jitted
`lax.scan` over 32 layers), XLA's default flags and `xla_gpu_graph_min_graph_size=1`, round-robin, best of rounds;
every variant's output is checked against a float32 reference first.

Usage: python benchmarks/probe_split_decode.py [--rounds 2] [--shapes b1_ctx32k ...] [--splits 1 2 4 ...]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from bench_decode import _inputs, CONFIGS, decode_step, PAGE, reference_and_tolerance

import attnlib


SHAPES = {"b1_ctx32k": (1, 32768), "b8_ctx8k": (8, 8192), "b1_ctx8k": (1, 8192), "b1_ctx1k": (1, 1024),
          "b16_ctx32k": (16, 32768), "b4_ctx32k": (4, 32768), "b64_ctx1k": (64, 1024)}  # fmt: skip


def split_attend(q, k, v, lengths, splits: int, pack: bool, page_table=None):
    """Decode attention of `q` `[B, 1, N, H]` over `splits` chunks of the cache, combined by log-sum-exp."""
    B, _, N, H = q.shape
    K = k.shape[-2]
    G = N // K
    rows = jnp.swapaxes(q.reshape(B, K, G, H), 1, 2) if pack else q  # [B, T', N', H]
    T2, N2 = rows.shape[1], rows.shape[2]
    rows = jnp.broadcast_to(rows[:, None], (B, splits) + rows.shape[1:]).reshape((B * splits,) + rows.shape[1:])
    if page_table is None:
        S = k.shape[1]
        chunk = S // splits
        k, v = (x.reshape((B * splits, chunk) + x.shape[2:]) for x in (k, v))
        kw = {}
    else:
        chunk = page_table.shape[1] // splits * PAGE
        kw = {"page_table": page_table.reshape(B * splits, -1)}
    starts = jnp.arange(splits, dtype=jnp.int32) * chunk
    chunk_lengths = jnp.clip(lengths[:, None] - starts, 0, chunk).reshape(B * splits)
    out, lse = attnlib.attention(rows, k, v, key_value_seq_lengths=chunk_lengths, return_residual=True,
                                 implementation="cudnn", **kw)  # fmt: skip
    out = out.reshape((B, splits, T2, N2, -1)).astype(jnp.float32)
    lse = lse.reshape(B, splits, T2, N2)
    top = jnp.max(lse, axis=1, keepdims=True)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(weight, axis=1)
    combined = jnp.sum(weight[..., None] * out, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    if pack:
        combined = jnp.swapaxes(combined, 1, 2).reshape(B, 1, N, -1)
    return combined.astype(q.dtype)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES)[:5])
    parser.add_argument("--splits", nargs="*", type=int, default=[2, 4, 8, 16, 32])
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0]}; ms per {args.layers}-layer step (default / min_graph_1), "
          f"best of {args.rounds} rounds", flush=True)  # fmt: skip
    for name in args.shapes:
        b, context = SHAPES[name]
        x, k, v, lengths, k_pool, v_pool, page_table = _inputs(b, context)
        reference, tol = reference_and_tolerance(x, k, v, lengths)
        variants = {
            "plain_dense": (lambda q, k, v: attnlib.attention(
                q, k, v, key_value_seq_lengths=lengths, is_causal=True, diagonal_alignment="bottom_right",
                implementation="cudnn"), (k, v)),
            "plain_paged": (lambda q, kp, vp: attnlib.attention(
                q, kp, vp, page_table=page_table, key_value_seq_lengths=lengths, is_causal=True,
                diagonal_alignment="bottom_right", implementation="cudnn"), (k_pool, v_pool)),
            "jax_nn_cudnn": (lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"), (k, v)),
        }  # fmt: skip
        pages_per_seq = context // PAGE
        for splits in args.splits:
            if context % splits or pages_per_seq % splits:
                continue
            for pack in (False, True):
                tag = f"p{splits}{'_pack' if pack else ''}"
                variants[f"split_dense_{tag}"] = (
                    lambda q, k, v, s=splits, p=pack: split_attend(q, k, v, lengths, s, p),
                    (k, v),
                )
                variants[f"split_paged_{tag}"] = (
                    lambda q, kp, vp, s=splits, p=pack: split_attend(q, kp, vp, lengths, s, p, page_table),
                    (k_pool, v_pool))  # fmt: skip
        steps, times = {}, {}
        for label, (attend, cache) in variants.items():
            try:
                err = float(np.max(np.abs(np.asarray(jax.jit(attend)(x, *cache), np.float32) - reference)))
            except Exception as e:  # noqa: BLE001  (reported, not fatal)
                print(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if not err <= tol:
                print(f"{name} {label}: WRONG max|err| {err:.3g} > {tol:.3g}", flush=True)
                continue
            for suffix, options in CONFIGS.items():
                steps[(label, suffix)] = (decode_step(attend, args.layers, options).lower(x, *cache).compile(),
                                          (x, *cache))  # fmt: skip
        for _ in range(args.rounds):
            for key, (step, call_args) in steps.items():
                times[key] = min(times.get(key, np.inf), best_per_call(step, call_args, loop=10, reps=5) * 1e3)
        best_peer = {s: times.get(("jax_nn_cudnn", s), np.nan) for s in CONFIGS}
        for label in variants:
            if (label, "") not in times:
                continue
            cells = " / ".join(f"{times[(label, s)]:.3f} ({best_peer[s] / times[(label, s)]:.2f}x)" for s in CONFIGS)
            print(f"{name:11s} {label:24s} {cells}", flush=True)


if __name__ == "__main__":
    main()
