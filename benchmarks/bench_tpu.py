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
variants, `--rounds` rounds: wall clock under `jax.jit`, 2 warm-up calls, then loops of calls ending in one
`block_until_ready` (each loop about 50 ms, at most 20 calls), 5 loops a round; the median per-call time over all
loops is reported (and the minimum). Out of memory (compiling or running) is reported as "out of memory" for that
variant. TFLOP/s count only the visible (query, key) pairs exactly, as `bench_cudnn.py`: with `E` visible pairs per
batch row and head, forward = `2 E B N (H + Hv)`, forward + backward = `2 E B N (4 H + 3 Hv)` (3.5x).

The summary gives attnlib's default speed-up over `splash` and `splash_default` (their time / attnlib's), forward and
forward + backward. `--smoke` runs tiny shapes on any backend (splash with `interpret=True`, few repetitions): a
check that the script works, not a measurement.
"""

import argparse
import dataclasses
import json
import math
import statistics
import time

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

VARIANTS = (
    "attnlib",
    "attnlib_pallas_tpu",
    "attnlib_xla_chunked",
    "attnlib_xla",
    "jax_nn",
    "splash",
    "splash_default",
)


def _kwargs(case: Case) -> dict:
    kw = {"is_causal": case.causal}
    if case.window is not None:
        kw["local_window_size"] = (case.window, 0)
    return kw


def visible_pairs(case: Case) -> int:
    """Exact number of visible (query, key) pairs of one batch row and head."""
    s = case.s
    if not case.causal:
        return s * s
    if case.window is None:
        return s * (s + 1) // 2
    return int(np.sum(np.minimum(np.arange(s), case.window) + 1))


def flops(case: Case) -> tuple[float, float]:
    """Forward and forward + backward FLOPs (visible pairs only)."""
    e = visible_pairs(case) * case.b * case.n
    return 2.0 * e * (case.h + case.h), 2.0 * e * (4 * case.h + 3 * case.h)


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


def splash_fn(case: Case, *, default: bool, interpret: bool):
    """`fn(q, k, v) -> out`, all `[B, T, N, H]`, through raw splash attention (see the module docstring)."""
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
    mha = group == 1
    heads = case.n if mha else group
    mask = mask_lib.MultiHeadMask([one] * heads)
    make = kernel_lib.make_splash_mha_single_device if mha else kernel_lib.make_splash_mqa_single_device
    kernel = make(mask, block_sizes=_splash_blocks(case, default), interpret=interpret)
    scale = 1.0 / math.sqrt(case.h)

    def fn(q, k, v):
        b, t, n, h = q.shape
        q = q * jnp.asarray(scale, q.dtype)
        if mha:  # [B, T, N, H] -> [B, N, T, H]; one kernel over all heads, vmapped over the batch
            to_heads = lambda x: jnp.transpose(x, (0, 2, 1, 3))
            out = jax.vmap(kernel)(to_heads(q), to_heads(k), to_heads(v))
            return jnp.transpose(out, (0, 2, 1, 3))
        # GQA: [B, T, K, G, H] -> [B, K, G, T, H] against [B, K, S, H]; vmapped over batch and key/value heads
        q5 = jnp.transpose(jnp.reshape(q, (b, t, case.k, group, h)), (0, 2, 3, 1, 4))
        to_kv = lambda x: jnp.transpose(x, (0, 2, 1, 3))
        out = jax.vmap(jax.vmap(kernel))(q5, to_kv(k), to_kv(v))  # [B, K, G, T, H]
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


def _is_oom(e: Exception) -> bool:
    text = f"{type(e).__name__}: {e}".lower()
    return "resource_exhausted" in text or "out of memory" in text or "ran out of memory" in text


def _error(e: Exception) -> str:
    return "out of memory" if _is_oom(e) else f"{type(e).__name__}: {str(e)[:300]}"


def time_calls(fn, args, *, target_s: float = 0.05, max_loop: int = 20, loops: int = 5, warmup: int = 2) -> list:
    """Per-call seconds of `loops` timed loops (each `loop` calls then one `block_until_ready`), after `warmup`
    calls; `loop` is chosen from the last warm-up call so that a loop takes about `target_s`."""
    one = float("inf")
    for _ in range(warmup):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        one = time.perf_counter() - start
    loop = max(1, min(max_loop, int(target_s / max(one, 1e-9))))
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(loop):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / loop)
    return times


def run_case(case: Case, names, rounds: int, *, interpret: bool = False, loops: int = 5) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    shape_q = (case.b, case.s, case.n, case.h)
    shape_kv = (case.b, case.s, case.k, case.h)
    q = jax.random.normal(keys[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(keys[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.bfloat16)
    dout = jax.random.normal(keys[3], shape_q, jnp.bfloat16)
    args = (q, k, v)
    kw = _kwargs(case)
    ref = reference(q, k, v, case)
    tol = 4 * float(jnp.finfo(jnp.bfloat16).eps) * float(np.max(np.abs(ref)))
    fwd_flops, fwd_bwd_flops = flops(case)
    row = {
        "shape": dataclasses.asdict(case),
        "flops": {"fwd": fwd_flops, "fwd_bwd": fwd_bwd_flops},
        "tolerance": tol,
        "variants": {},
    }
    try:
        row["attnlib_pick"] = attnlib.explain(q, k, v, **kw).implementation
    except Exception as e:  # noqa: BLE001
        row["attnlib_pick"] = f"explain failed: {type(e).__name__}: {str(e)[:200]}"

    timed = {}
    for label, fn in variant_fns(case, names, interpret).items():
        result = row["variants"][label] = {}
        if isinstance(fn, Exception):
            result["error"] = _error(fn)
            continue
        try:
            fwd = jax.jit(fn).lower(*args).compile()
            out = np.asarray(fwd(*args), np.float32)
            result["max_err"] = err = float(np.max(np.abs(out - ref)))
            del out
            if not err <= tol:
                result["wrong"] = f"max |err| {err:.3g} > {tol:.3g}"
                continue
        except Exception as e:  # noqa: BLE001
            result["error"] = _error(e)
            continue
        timed[label] = {"fwd": fwd}

        def loss(q, k, v, fn=fn):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

        try:
            timed[label]["fwd_bwd"] = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
        except Exception as e:  # noqa: BLE001
            result["fwd_bwd_error"] = _error(e)

    samples = {(label, kind): [] for label, fns in timed.items() for kind in fns}
    for _ in range(rounds):
        for label, fns in timed.items():
            for kind, fn in fns.items():
                if f"{kind}_error" in row["variants"][label]:
                    continue
                try:
                    samples[label, kind] += time_calls(fn, args, loops=loops)
                except Exception as e:  # noqa: BLE001
                    row["variants"][label][f"{kind}_error"] = _error(e)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", default=None, help="cases, run in that order")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--variants", nargs="*", default=None, help=f"a subset of {VARIANTS}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, splash interpreted, few repetitions")
    args = parser.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else CASES
    unknown = set(args.only or ()) - set(cases)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {list(cases)}")
    names = tuple(args.variants or VARIANTS)
    if set(names) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(names) - set(VARIANTS))}; known: {list(VARIANTS)}")
    results = {}
    started = time.perf_counter()
    for name in args.only or cases:
        results[name] = run_case(cases[name], names, args.rounds, interpret=args.smoke, loops=2 if args.smoke else 5)
        print(name, json.dumps(results[name]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "device": str(jax.devices()[0]),
                        "jax": jax.__version__,
                        "smoke": args.smoke,
                        "rounds": args.rounds,
                        "flops": "visible (query, key) pairs only: fwd 2 E B N (H + Hv), fwd+bwd 2 E B N (4 H + 3 Hv)",
                        "cases": results,
                    },
                    f,
                    indent=1,
                )
    print(table(results))
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
