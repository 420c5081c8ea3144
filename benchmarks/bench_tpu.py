"""TPU benchmark: attnlib's implementations against jax.nn and raw splash attention, one process.

Usage: python benchmarks/bench_tpu.py [--json out.json] [--only CASE ... (run in that order)] [--rounds 1]
       [--variants NAME ...] [--smoke]

Variants, side by side on the same bf16 inputs (`[B, T, N, H]`):
- `attnlib`: `attnlib.attention(implementation=None)`; the implementation it picks (`attnlib.explain`) is recorded
  as `attnlib_pick`.
- `attnlib_pallas_tpu`, `attnlib_xla_chunked`, `attnlib_xla`: `implementation=` that name (an implementation this
  build lacks is reported with its error).
- `jax_nn`: `jax.nn.dot_product_attention(implementation="xla")`.
- `splash`: raw `jax.experimental.pallas.ops.tpu.splash_attention` with `BlockSizes` of 512 wherever the lengths allow
  (`min(512, T)` query rows and `min(512, S)` keys for `block_q`, `block_kv`, `block_kv_compute`, `block_q_dkv`,
  `block_kv_dkv`, `block_kv_dkv_compute`, `block_q_dq`, `block_kv_dq`; separate dq and dkv backward kernels).
  MHA: `make_splash_mha_single_device` over all heads; GQA: `make_splash_mqa_single_device` per key/value head
  (its `N/K` query heads share one key and value). Causal / local masks from `splash_attention_mask`
  (`CausalMask`, `LocalMask(window_size=(left, 0))`), vmapped over the batch (and the key/value heads); `q` is
  pre-scaled by `1/sqrt(H)` (splash does not scale). The timed function takes the same `[B, T, N, H]` arrays as the
  others: the transposes to splash's `[N, T, H]` layout and back, and the scaling, are inside it.
- `splash_default`: the same with splash's default `BlockSizes` (`BlockSizes.get_default()`: 128 everywhere).

Per case and variant: the forward output is first checked against a float32 reference computed on the same inputs
by plain XLA (einsum + softmax at `Precision.HIGHEST`, 1024 query rows at a time so that it fits in HBM): max |err|
is reported, and a variant beyond `4 eps(bf16) max|ref|` is marked wrong and not timed. Then forward and
forward + backward (the gradient of `sum(out * dout)` with respect to q, k, v) are timed, round-robin over the
variants, `--rounds` rounds of `harness.time_calls` (wall clock under `jax.jit`, 2 warm-up calls, then loops of calls
ending in one `block_until_ready`, each loop about 50 ms, at most 20 calls), 5 loops a round; the median per-call
time over all loops is reported (and the minimum). Out of memory (compiling or running) is reported as "out of
memory" for that variant. TFLOP/s count only the visible (query, key) pairs exactly, as `bench_cudnn.py`: with `E`
visible pairs per batch row and head, forward = `2 E B N (H + Hv)`, forward + backward = `2 E B N (4 H + 3 Hv)`
(3.5x).

The summary gives attnlib's default speed-up over `splash` and `splash_default` (their time / attnlib's), forward and
forward + backward. `--smoke` runs tiny shapes on any backend (splash with `interpret=True`, few repetitions): a
check that the script works, not a measurement.
"""

import dataclasses
import json
import math
import statistics
import time

import harness  # run as a script: benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np

import attnlib


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    s: int  # T = S
    n: int
    k: int
    h: int
    causal: bool = True
    window: int | None = None  # left window: keys i - window .. i (with causal)


CASES = {
    "mha_causal_4k": Case(4, 4096, 16, 16, 128),
    "mha_causal_16k": Case(1, 16384, 16, 16, 128),
    "gqa_causal_8k": Case(2, 8192, 32, 8, 128),
    "mha_full_2k": Case(8, 2048, 16, 16, 128, causal=False),
    "gqa_window_8k": Case(2, 8192, 16, 4, 128, window=1024),
    "small_512": Case(8, 512, 16, 16, 64),
}

SMOKE_CASES = {  # splash's blocks are multiples of 128 rows, even in interpret mode
    "smoke_gqa_window": Case(1, 256, 4, 2, 64, window=100),
    "smoke_mha_full": Case(1, 256, 2, 2, 64, causal=False),
}

KINDS = ("fwd", "fwd_bwd")

VARIANTS = ("attnlib", "attnlib_pallas_tpu", "attnlib_xla_chunked", "attnlib_xla", "jax_nn", "splash", "splash_default")


def _kwargs(case: Case) -> dict:
    kw = {"is_causal": case.causal}
    if case.window is not None:
        kw["local_window_size"] = (case.window, 0)
    return kw


def flops(case: Case) -> tuple[float, float]:
    """Forward and forward + backward FLOPs (visible pairs only, `harness.flops`)."""
    return harness.flops(harness.visible_pairs(case.s, case.causal, case.window) * case.b * case.n, case.h, case.h)


def _splash_blocks(case: Case, default: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if default:
        return splash.BlockSizes.get_default()
    bq = bkv = min(512, case.s)
    return splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv,
        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
        block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip


def splash_fn(case: Case, *, default: bool, interpret: bool, per_kv_head: bool = False):
    """`fn(q, k, v, segment_ids=None) -> out`, all `[B, T, N, H]`, through raw splash attention (see the module
    docstring); `per_kv_head`: the MQA kernel per key/value head also for MHA (`bench_model.py`'s cores), which
    alone takes segment ids `[B, T]` (one `SegmentIds` of a batch row for all its heads)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )

    shape = (case.s, case.s)
    if case.window is not None:
        one = mask_lib.LocalMask(shape, window_size=(case.window, 0), offset=0)
    elif case.causal:
        one = mask_lib.CausalMask(shape)
    else:
        one = mask_lib.FullMask(shape)
    group = case.n // case.k
    mha = group == 1 and not per_kv_head
    heads = case.n if mha else group
    mask = mask_lib.MultiHeadMask([one] * heads)
    make = kernel_lib.make_splash_mha_single_device if mha else kernel_lib.make_splash_mqa_single_device
    kernel = make(mask, block_sizes=_splash_blocks(case, default), interpret=interpret)
    scale = 1.0 / math.sqrt(case.h)

    def fn(q, k, v, segment_ids=None):
        b, t, n, h = q.shape
        q = q * jnp.asarray(scale, q.dtype)
        to_heads = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # [B, T, N, H] -> [B, N, T, H]
        if mha:  # one kernel over all heads, vmapped over the batch
            return to_heads(jax.vmap(kernel)(to_heads(q), to_heads(k), to_heads(v)))
        # GQA: [B, T, K, G, H] -> [B, K, G, T, H] against [B, K, S, H]; vmapped over batch and key/value heads
        q5 = jnp.transpose(jnp.reshape(q, (b, t, case.k, group, h)), (0, 2, 3, 1, 4))
        if segment_ids is None:
            out = jax.vmap(jax.vmap(kernel))(q5, to_heads(k), to_heads(v))  # [B, K, G, T, H]
        else:
            ids = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
            per_head = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids), in_axes=(0, 0, 0, None))
            out = jax.vmap(per_head)(q5, to_heads(k), to_heads(v), ids)
        return jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (b, t, n, h))

    return fn


def variant_fns(case: Case, names, interpret: bool) -> dict:
    """name -> `fn(q, k, v) -> out`; a variant that cannot even be built maps to its exception."""
    kw = _kwargs(case)
    table = {}
    for name in names:
        try:
            if name == "attnlib":
                table[name] = lambda q, k, v: attnlib.attention(q, k, v, **kw)
            elif name.startswith("attnlib_"):
                impl = name[len("attnlib_") :]
                table[name] = lambda q, k, v, impl=impl: attnlib.attention(q, k, v, implementation=impl, **kw)
            elif name == "jax_nn":
                table[name] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
            elif name in ("splash", "splash_default"):
                table[name] = splash_fn(case, default=name == "splash_default", interpret=interpret)
            else:
                raise ValueError(f"unknown variant {name!r}; known: {VARIANTS}")
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            table[name] = e
    return table


def reference(q, k, v, case: Case, rows_per_chunk: int = 1024) -> np.ndarray:
    """float32 `[B, T, N, H]` by plain XLA at `Precision.HIGHEST`, `rows_per_chunk` query rows at a time."""
    group = case.n // case.k
    scale = 1.0 / math.sqrt(case.h)

    @jax.jit
    def chunk(q_rows, start, k, v):
        rows = start + jnp.arange(q_rows.shape[1])
        keys = jnp.arange(k.shape[1])
        qg = jnp.reshape(q_rows, q_rows.shape[:2] + (case.k, group, case.h)).astype(jnp.float32)
        s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision="highest") * scale
        visible = jnp.ones((rows.shape[0], keys.shape[0]), bool)
        if case.causal:
            visible &= keys[None, :] <= rows[:, None]
        if case.window is not None:
            visible &= keys[None, :] >= rows[:, None] - case.window
        s = jnp.where(visible, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), precision="highest")
        return jnp.reshape(out, q_rows.shape)

    parts = []
    for start in range(0, case.s, rows_per_chunk):
        parts.append(np.asarray(chunk(q[:, start : start + rows_per_chunk], start, k, v)))
    return np.concatenate(parts, axis=1)


def run_case(case: Case, names, rounds: int, *, interpret: bool = False, loops: int = 5) -> dict:
    shape_q, shape_kv = (case.b, case.s, case.n, case.h), (case.b, case.s, case.k, case.h)
    q, k, v, dout = harness.normal(shape_q, shape_kv, shape_kv, shape_q)
    args = (q, k, v)
    kw = _kwargs(case)
    ref = reference(q, k, v, case)
    tol = harness.tolerance(ref)
    fwd_flops, fwd_bwd_flops = flops(case)
    row = {"shape": dataclasses.asdict(case), "flops": {"fwd": fwd_flops, "fwd_bwd": fwd_bwd_flops}, "tolerance": tol,
           "variants": {}}  # fmt: skip
    try:
        row["attnlib_pick"] = attnlib.explain(q, k, v, **kw).implementation
    except Exception as e:  # noqa: BLE001
        row["attnlib_pick"] = f"explain failed: {harness.error(e, 200)}"

    timed = {}
    for label, fn in variant_fns(case, names, interpret).items():
        result = row["variants"][label] = {}
        if isinstance(fn, Exception):
            result["error"] = harness.error_or_oom(fn)
            continue
        try:
            fwd = jax.jit(fn).lower(*args).compile()
            result.update(harness.checked(fwd(*args), ref, tol))
            if "wrong" in result:
                continue
        except Exception as e:  # noqa: BLE001
            result["error"] = harness.error_or_oom(e)
            continue
        timed[label] = {"fwd": fwd}
        try:
            timed[label]["fwd_bwd"] = jax.jit(harness.grad_fn(fn, dout)).lower(*args).compile()
        except Exception as e:  # noqa: BLE001
            result["fwd_bwd_error"] = harness.error_or_oom(e)

    samples = {(label, kind): [] for label, fns in timed.items() for kind in fns}
    for _ in range(rounds):
        for label, fns in timed.items():
            for kind, fn in fns.items():
                if f"{kind}_error" in row["variants"][label]:
                    continue
                try:
                    samples[label, kind] += harness.time_calls(fn, args, loops=loops)
                except Exception as e:  # noqa: BLE001
                    row["variants"][label][f"{kind}_error"] = harness.error_or_oom(e)
    for (label, kind), times in samples.items():
        if not times:
            continue
        result = row["variants"][label]
        result[f"{kind}_ms"] = statistics.median(times) * 1e3
        result[f"{kind}_min_ms"] = min(times) * 1e3
        result[f"{kind}_tflops"] = row["flops"][kind] / (result[f"{kind}_ms"] * 1e-3) / 1e12
    mine = row["variants"].get("attnlib", {})
    for peer in ("splash", "splash_default"):
        theirs = row["variants"].get(peer, {})
        for kind in ("fwd", "fwd_bwd"):
            if f"{kind}_ms" in mine and f"{kind}_ms" in theirs:
                row.setdefault(f"attnlib_vs_{peer}", {})[kind] = theirs[f"{kind}_ms"] / mine[f"{kind}_ms"]
    return row


def table(results: dict) -> str:
    labels = [label for label in VARIANTS if any(label in row["variants"] for row in results.values())]
    lines = [
        "| case | attnlib picks | " + " | ".join(labels) + " | attnlib vs splash | attnlib vs splash_default |",
        "|---" * (len(labels) + 4) + "|",
    ]
    for name, row in results.items():
        cells = []
        for label in labels:
            r = row["variants"].get(label, {})
            if "fwd_ms" in r:
                cells.append(f"{r['fwd_ms']:.3f} / {r.get('fwd_bwd_ms', float('nan')):.3f}")
            elif "wrong" in r:
                cells.append("wrong")
            elif r.get("error") == "out of memory":
                cells.append("OOM")
            else:
                cells.append("—" if not r else "error")
        speed = [
            " / ".join(f"{row.get(f'attnlib_vs_{peer}', {}).get(kind, float('nan')):.2f}×" for kind in KINDS)
            for peer in ("splash", "splash_default")
        ]
        lines.append(f"| {name} | {row.get('attnlib_pick')} | " + " | ".join(cells) + f" | {speed[0]} | {speed[1]} |")
    return "\n".join(lines)


def main(argv=None):
    parser = harness.parser(__doc__, only="cases, run in that order", rounds=1)
    parser.add_argument("--variants", nargs="*", default=None, help=f"a subset of {VARIANTS}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, splash interpreted, few repetitions")
    args = parser.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    harness.check_names(parser, args.only, cases)
    harness.check_names(parser, args.variants, VARIANTS, "variants")
    names = tuple(args.variants or VARIANTS)
    results = {}
    started = time.perf_counter()
    for name in args.only or cases:
        results[name] = run_case(cases[name], names, args.rounds, interpret=args.smoke, loops=2 if args.smoke else 5)
        print(name, json.dumps(results[name]), flush=True)
        flop_convention = "visible (query, key) pairs only: fwd 2 E B N (H + Hv), fwd+bwd 2 E B N (4 H + 3 Hv)"
        header = {**harness.device_and_jax(), "smoke": args.smoke, "rounds": args.rounds, "flops": flop_convention}
        harness.write_json(args.json, {**header, "cases": results})
    print(table(results))
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
