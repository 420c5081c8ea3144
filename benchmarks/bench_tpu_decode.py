"""TPU paged-serving benchmark: attnlib on a `PagedKVCache` against JAX's raw paged kernels, one process.

Usage: python benchmarks/bench_tpu_decode.py [--json out.json] [--only CASE ...] [--smoke]

Decode cases (one query per sequence, pages shuffled) and mixed ones (whole-prompt prefill chunks plus decodes,
packed); the variants are docs/performance.md's "Serving from a paged cache": `attnlib` (`cache.attend(q)` on the
layout `PagedKVCache.create` picks; `attnlib_pick`), `attnlib_head_major`, `attnlib_token_major`, `attnlib_xla`, raw
`paged_attention` and `ragged_paged_attention` (decode only but `attnlib` and `ragged_paged_attention`). Each is
checked against a float32 reference first, then timed by `harness.time_calls` (median ms); GB/s counts the visible
keys' and values' bytes once. `--smoke`: a tiny decode in TPU interpret mode on any backend (the ragged kernel, which
interpret mode cannot run in JAX 0.10.2, skipped).
"""

import dataclasses
import json
import statistics
import time

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np

import attnlib
from attnlib._src.backends.pallas_tpu import paged, ragged


Case = harness.PagedCase


CASES = {
    "gqa_b32_len4k": Case(32, 4096, 32, 8, 128, 16),
    "gqa_b8_len32k": Case(8, 32768, 32, 8, 128, 64),
    "mha_b64_len2k_d64": Case(64, 2048, 16, 16, 64, 32),
    "gqa_b32_len1k": Case(32, 1024, 32, 8, 128, 32),
    "gqa_b32_len512": Case(32, 512, 32, 8, 128, 32),
    "mixed_8x512to2k_56x2k": Case(0, 0, 32, 8, 128, 32, (512, 768, 1024, 1280, 1536, 1792, 2048, 1024), 56, 2048),
    "mixed_4x1k_60x4k_p64": Case(0, 0, 32, 8, 128, 64, (1024, 1024, 1024, 1024), 60, 4096),
}
SMOKE_CASES = {"smoke_gqa": Case(3, 40, 4, 2, 64, 8)}
DECODE_ONLY = ("attnlib_head_major", "attnlib_token_major", "attnlib_xla", "paged_attention")
RAGGED_KERNEL = ("attnlib", "ragged_paged_attention")  # they run JAX's ragged paged-attention kernel (not in --smoke)


def inputs(case: Case):
    """Packed queries `[T, N, H]`, token-major pools, the shuffled page table, kv lengths and `cu_seqlens_q`."""
    kv_lengths, q_lengths = np.asarray(case.kv_lengths), np.asarray(case.q_lengths)
    B = len(kv_lengths)
    pages_per_seq = -(-int(kv_lengths.max()) // case.page_size)
    num_pages = B * pages_per_seq
    pool = (num_pages, case.page_size, case.k, case.h)
    q, k, v = harness.normal((int(q_lengths.sum()), case.n, case.h), pool, pool)
    table = np.random.default_rng(0).permutation(num_pages).reshape(B, pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(kv_lengths, jnp.int32), jnp.asarray(cu)


def cache_of(k, v, table, lengths, layout: str) -> attnlib.PagedKVCache:
    """A `PagedKVCache` holding the benchmark's token-major pools, in `layout` (converted once, untimed)."""
    return harness.token_major_cache(k, v, table, lengths).to_layout(layout)


def variant_fns(case: Case, interpret: bool, q, k, v, table, lengths, cu) -> dict:
    """name -> (jitted fn, args)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    impl = attnlib.PallasTpu(interpret=True) if interpret else None
    B = table.shape[0]
    packed = {"cu_seqlens_q": cu} if case.mixed else {}
    dense_q = q if case.mixed else q[:, None]  # decode: [B, 1, N, H]
    unpack = (lambda out: out) if case.mixed else (lambda out: out[:, 0])
    attend = lambda impl: jax.jit(lambda q, c: unpack(c.attend(q, implementation=impl, **packed)))  # noqa: E731
    fns = {"attnlib": (attend(impl), (dense_q, cache_of(k, v, table, lengths, "combined")))}
    pool = jnp.reshape(jnp.stack([k, v], axis=3), (k.shape[0], case.page_size, 2 * case.k, case.h))  # its own layout
    raw_blocks = ragged.kernel_blocks(q, pool, table, interpret=interpret)

    def raw_ragged(q, pool, lengths, table, cu):
        return ragged_paged_attention(q, pool, lengths, table, cu, jnp.array([B], jnp.int32),
                                      sm_scale=case.h**-0.5, **raw_blocks)  # fmt: skip

    fns["ragged_paged_attention"] = (jax.jit(raw_ragged), (q, pool, lengths, table, cu))
    if case.mixed:
        return fns
    block = paged.pages_per_block(case.page_size, table.shape[1])

    def raw_paged(q, k, v, t, n):  # pools arrive head-major: laid out once, outside the timed call
        return paged.decode_kernel(
            (q.astype(jnp.float32) * np.float32(case.h**-0.5)).astype(q.dtype), k, v, n, t,
            soft_cap=None, pages_per_block=block, interpret=interpret,
        )  # fmt: skip

    head_major = tuple(jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))
    fns["attnlib_head_major"] = (attend(impl), (dense_q, cache_of(k, v, table, lengths, "head_major")))
    token_major = cache_of(k, v, table, lengths, "token_major")
    bare = lambda q, k, v, t, n: attnlib.attention(  # noqa: E731
        q, k, v, page_table=t, key_value_seq_lengths=n, implementation=impl, is_causal=True,
        diagonal_alignment="bottom_right",
    )[:, 0]  # fmt: skip
    fns["attnlib_token_major"] = (jax.jit(bare), (dense_q, k, v, table, lengths))
    fns["attnlib_xla"] = (attend("xla"), (dense_q, token_major))
    fns["paged_attention"] = (jax.jit(raw_paged), (q, *head_major, table, lengths))
    return fns


def run_case(case: Case, interpret: bool) -> dict:
    q, k, v, table, lengths, cu = inputs(case)
    gather = lambda pool, b, s: pool[table[b]].reshape(-1, case.k, case.h)[:s]  # noqa: E731
    kv_of = lambda b, s: (gather(k, b, s), gather(v, b, s))  # noqa: E731
    ref = harness.packed_reference(q, kv_of, case.q_lengths, case.kv_lengths, case.n, case.k, case.h)
    tol = harness.tolerance(ref)
    row = {"shape": dataclasses.asdict(case), "tolerance": tol, "variants": {}}
    fns = variant_fns(case, interpret, q, k, v, table, lengths, cu)
    cache = fns["attnlib"][1][1]
    row["attnlib_pick"] = attnlib.explain(
        fns["attnlib"][1][0], cache, None, is_causal=True, diagonal_alignment="bottom_right",
        **({"cu_seqlens_q": cu} if case.mixed else {}),
    ).implementation  # fmt: skip
    row["attnlib_layout"] = cache.layout
    kv_bytes = 2 * sum(case.kv_lengths) * case.k * case.h * 2
    for name, (fn, args) in fns.items():
        if interpret and name in RAGGED_KERNEL:
            row["variants"][name] = {"skipped": "TPU interpret mode cannot run JAX's ragged paged-attention kernel"}
            continue
        try:
            result = harness.checked(fn(*args), ref, tol)
            if "wrong" not in result:
                times = harness.time_calls(fn, args, loops=2 if interpret else 5)
                ms = 1e3 * statistics.median(times)
                result |= {"ms": ms, "min_ms": 1e3 * min(times), "gb_s": kv_bytes / ms / 1e6}
        except Exception as e:  # noqa: BLE001 - a variant's failure is reported, not fatal
            result = {"error": harness.error_or_oom(e)}
        row["variants"][name] = result
    ours = row["variants"]["attnlib"].get("ms")
    for raw in ("paged_attention", "ragged_paged_attention", "attnlib_xla"):
        theirs = row["variants"].get(raw, {}).get("ms")
        row[f"speedup_vs_{raw}"] = theirs / ours if theirs and ours else None
    return row


def main(argv=None):
    parser = harness.parser(__doc__, only="cases")
    parser.add_argument("--smoke", action="store_true", help="tiny cases in TPU interpret mode")
    args = parser.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    harness.check_names(parser, args.only, cases)
    results, started = {}, time.perf_counter()
    for name in args.only or cases:
        results[name] = run_case(cases[name], interpret=args.smoke)
        print(name, json.dumps(results[name]), flush=True)
        harness.write_json(args.json, {**harness.device_and_jax(), "smoke": args.smoke, "cases": results})
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
