"""TPU paged-decode benchmark: attnlib's paged decode against JAX's raw paged-attention kernel, one process.

Usage: python benchmarks/bench_tpu_decode.py [--json out.json] [--only CASE ...] [--smoke]

One decode step (one query per sequence, bf16) over a paged KV cache whose sequences are all `length` tokens long,
pages of `page_size` tokens in a pool of exactly the pages they use, shuffled. Variants, side by side on the same
inputs:
- `attnlib`: `attnlib.attention(q [B, 1, N, H], k_pages, v_pages [P, page_size, K, H], page_table=...,
  key_value_seq_lengths=..., is_causal=True, diagonal_alignment="bottom_right")`, `implementation=None`; the pick
  (`attnlib.explain`) is recorded as `attnlib_pick`. attnlib's pools are token-major, so its call includes the
  head-major copy the kernel needs (docs/implementations.md).
- `attnlib_xla`: the same with `implementation="xla"` (pages gathered, plain JAX).
- `paged_attention`: raw `jax.experimental.pallas.ops.tpu.paged_attention` on pools already head-major
  (`[K, P, page_size, H]`, what a user of the raw kernel keeps), `q` pre-scaled, `pages_per_compute_block` as
  attnlib picks it.

Each output is checked against a float32 reference of the gathered sequences first (a variant beyond
`4 eps(bf16) max|ref|` is marked wrong and not timed), then timed as `bench_tpu.py` does (`time_calls`: median ms
per call). Bandwidth counts the key and value bytes of the visible tokens once: `2 B length K H * 2 bytes`.
`--smoke` runs a tiny case in TPU interpret mode on any backend: a check that the script works, not a measurement.
"""

import argparse
import dataclasses
import importlib.util
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnlib
from attnlib._src.backends.pallas_tpu import paged


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    length: int
    n: int
    k: int
    h: int
    page_size: int


CASES = {
    "gqa_b32_len4k": Case(32, 4096, 32, 8, 128, 16),
    "gqa_b8_len32k": Case(8, 32768, 32, 8, 128, 64),
    "mha_b64_len2k_d64": Case(64, 2048, 16, 16, 64, 32),
}
SMOKE_CASES = {"smoke_gqa": Case(3, 40, 4, 2, 64, 8)}
VARIANTS = ("attnlib", "attnlib_xla", "paged_attention")


def _bench_tpu_helpers():
    """`(time_calls, error)` of `bench_tpu.py`: the same timing loop and error reporting."""
    path = pathlib.Path(__file__).parent / "bench_tpu.py"
    spec = importlib.util.spec_from_file_location("bench_tpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.time_calls, module._error


def inputs(case: Case):
    pages_per_seq = -(-case.length // case.page_size)
    num_pages = case.b * pages_per_seq
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (case.b, 1, case.n, case.h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (num_pages, case.page_size, case.k, case.h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (num_pages, case.page_size, case.k, case.h), jnp.bfloat16)
    table = np.random.default_rng(0).permutation(num_pages).reshape(case.b, pages_per_seq)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.full((case.b,), case.length, jnp.int32)


def reference(q, k, v, table, case: Case) -> np.ndarray:
    gather = lambda pool: pool[table].reshape(case.b, -1, case.k, case.h)[:, : case.length].astype(jnp.float32)
    keys, values = gather(k), gather(v)
    g = case.n // case.k
    qf = q[:, 0].astype(jnp.float32).reshape(case.b, case.k, g, case.h) / np.sqrt(case.h)
    s = jnp.einsum("bkgh,bskh->bkgs", qf, keys, precision=jax.lax.Precision.HIGHEST)
    out = jnp.einsum("bkgs,bskh->bkgh", jax.nn.softmax(s, -1), values, precision=jax.lax.Precision.HIGHEST)
    return np.asarray(out.reshape(case.b, 1, case.n, case.h))


def variant_fns(case: Case, interpret: bool) -> dict:
    impl = attnlib.PallasTpu(interpret=True) if interpret else None
    kw = dict(is_causal=True, diagonal_alignment="bottom_right")
    block = paged.pages_per_block(case.page_size, -(-case.length // case.page_size))

    def attn(implementation):
        return lambda q, k, v, t, n: attnlib.attention(
            q, k, v, page_table=t, key_value_seq_lengths=n, implementation=implementation, **kw
        )

    def raw(q, k, v, t, n):  # pools arrive head-major: laid out once, outside the timed call
        out = paged.decode_kernel(
            (q[:, 0].astype(jnp.float32) * np.float32(case.h**-0.5)).astype(q.dtype), k, v, n, t,
            soft_cap=None, pages_per_block=block, interpret=interpret,
        )  # fmt: skip
        return out[:, None]

    return {"attnlib": jax.jit(attn(impl)), "attnlib_xla": jax.jit(attn("xla")), "paged_attention": jax.jit(raw)}


def run_case(case: Case, interpret: bool) -> dict:
    time_calls, error = _bench_tpu_helpers()
    q, k, v, table, lengths = inputs(case)
    ref = reference(q, k, v, table, case)
    tol = 4 * float(jnp.finfo(jnp.bfloat16).eps) * float(np.max(np.abs(ref)))
    head_major = tuple(jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))
    row = {"shape": dataclasses.asdict(case), "tolerance": tol, "variants": {}}
    row["attnlib_pick"] = attnlib.explain(
        q, k, v, page_table=table, key_value_seq_lengths=lengths, is_causal=True, diagonal_alignment="bottom_right"
    ).implementation
    kv_bytes = 2 * case.b * case.length * case.k * case.h * 2
    for name, fn in variant_fns(case, interpret).items():
        args = (q, *head_major, table, lengths) if name == "paged_attention" else (q, k, v, table, lengths)
        try:
            err = float(np.max(np.abs(np.asarray(fn(*args), np.float32) - ref)))
            result = {"max_err": err}
            if err <= tol:
                times = time_calls(fn, args, loops=2 if interpret else 5)
                ms = 1e3 * statistics.median(times)
                result |= {"ms": ms, "min_ms": 1e3 * min(times), "gb_s": kv_bytes / ms / 1e6}
            else:
                result["wrong"] = True
        except Exception as e:  # noqa: BLE001 - a variant's failure is reported, not fatal
            result = {"error": error(e)}
        row["variants"][name] = result
    raw, ours = row["variants"]["paged_attention"].get("ms"), row["variants"]["attnlib"].get("ms")
    row["speedup_vs_paged_attention"] = raw / ours if raw and ours else None
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny case in TPU interpret mode")
    args = parser.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    unknown = set(args.only or ()) - set(cases)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {list(cases)}")
    results, started = {}, time.perf_counter()
    for name in args.only or cases:
        results[name] = run_case(cases[name], interpret=args.smoke)
        print(name, json.dumps(results[name]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                header = {"device": str(jax.devices()[0]), "jax": jax.__version__, "smoke": args.smoke}
                json.dump(header | {"cases": results}, f, indent=1)
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
