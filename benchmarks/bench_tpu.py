"""TPU benchmark: attnlib's implementations against jax.nn and raw splash attention, one process.

Usage: python benchmarks/bench_tpu.py [--json out.json] [--only CASE ... (run in that order)] [--rounds 1]
       [--variants NAME ...] [--flex-blocks BQxBK ...] [--smoke]

Variants, side by side on the same bf16 inputs (`[B, T, N, H]`):
- `attnlib`: `attnlib.attention(implementation=None)`; the implementation it picks (`attnlib.explain`) is recorded
  as `attnlib_pick`.
- `attnlib_pallas_tpu`, `attnlib_xla_chunked`, `attnlib_xla`: `implementation=` that name (an implementation this
  build lacks is reported with its error); `attnlib_flex`: `attnlib.PallasTpu(kernel="flex")`, attnlib's own kernel
  also where splash serves; `--flex-blocks 256x1024 ...` adds `attnlib_flex@256x1024` and so on, the same with
  `flex_blocks=(256, 1024)` (query tokens per block, keys per block: the sweep behind the kernel's default tiles).
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
- `splash_grouped`: as `splash`, but GQA through `make_splash_mha_single_device` with `K` key/value heads (splash's
  own grouping: `N/K` query heads read each key/value head), vmapped over the batch only: the wiring attnlib's
  `pallas_tpu` uses. On MHA rows it is `splash`'s call.

Per case and variant the forward output is checked first (against plain XLA at `Precision.HIGHEST`, or for a
feature row attnlib's `xla_chunked` in float32; beyond `4 eps(bf16) max|ref|` it is marked wrong, not timed; splash's
nearest call to a feature row is not checked), then forward and forward + backward (gradient of `sum(out * dout)`
w.r.t. q, k, v, and a bias) are timed round-robin by `harness.time_calls`: median (and minimum) per call. TFLOP/s
count the visible (query, key) pairs exactly: forward `2 E B N (H + Hv)`, forward + backward `2 E B N (4 H + 3 Hv)`.
The summary gives attnlib's speed-up over `splash`, `splash_default` and `splash_grouped`. `--smoke`: tiny shapes on
any backend (splash interpreted), a check that the script works. Methodology: docs/performance.md#tpu.
"""

import dataclasses
import json
import math
import re
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
    feature: str | None = None  # one of FEATURES: what splash cannot run (its row is the nearest call it can)
    hv: int | None = None  # value head dim (MLA), `h` when None


CASES = {
    "mha_causal_4k": Case(4, 4096, 16, 16, 128),
    "mha_causal_16k": Case(1, 16384, 16, 16, 128),
    "gqa_causal_8k": Case(2, 8192, 32, 8, 128),
    "mha_full_2k": Case(8, 2048, 16, 16, 128, causal=False),
    "gqa_window_8k": Case(2, 8192, 16, 4, 128, window=1024),
    "small_512": Case(8, 512, 16, 16, 64),
}

FEATURE_CASES = {  # issue #68's rows: what splash cannot serve, against splash's nearest call
    "alibi_gqa_8k": Case(2, 8192, 32, 8, 128, feature="alibi"),  # splash: causal
    "prefix_lm_gqa_8k": Case(2, 8192, 32, 8, 128, causal=False, feature="prefix_lm"),  # splash: the same NumPy mask
    "documents_gqa_8k": Case(2, 8192, 32, 8, 128, causal=False, feature="documents"),  # splash: segment ids
    "mla_192_128_8k": Case(2, 8192, 32, 8, 192, hv=128, feature="mla"),  # splash: 192 / 192
    "bias_mha_4k": Case(2, 4096, 16, 16, 128, causal=False, feature="bias"),  # splash: causal; gradient of the bias too
    "mask_mha_4k": Case(2, 4096, 16, 16, 128, causal=False, feature="mask"),  # a causal boolean mask; splash: causal
    "dropout_mha_4k": Case(2, 4096, 16, 16, 128, feature="dropout"),  # rate 0.1; splash: causal, no dropout
    "float32_mha_4k": Case(2, 4096, 16, 16, 128, feature="float32"),  # splash: causal in bfloat16
}
PREFIX, DOCUMENT = 1024, 512
SMOKE_CASES = {  # splash's blocks are multiples of 128 rows, even in interpret mode
    "smoke_gqa_window": Case(1, 256, 4, 2, 64, window=100),
    "smoke_mha_full": Case(1, 256, 2, 2, 64, causal=False),
    "smoke_alibi": Case(1, 256, 4, 2, 64, feature="alibi"),
    "smoke_bias": Case(1, 256, 2, 2, 64, causal=False, feature="bias"),
}

KINDS = ("fwd", "fwd_bwd")

VARIANTS = ("attnlib", "attnlib_pallas_tpu", "attnlib_flex", "attnlib_xla_chunked", "attnlib_xla", "jax_nn", "splash",
            "splash_default", "splash_grouped")
SPLASH_PEERS = ("splash", "splash_default", "splash_grouped")


def _kwargs(case: Case, *extra) -> dict:
    """attnlib's keyword arguments of `case`, with its feature's arrays `extra` (`feature_arrays`)."""
    kw = {"is_causal": case.causal}
    if case.window is not None:
        kw["local_window_size"] = (case.window, 0)
    f = case.feature
    if f == "alibi":
        kw.update(score_mod=lambda s, b, h, i, j, slope: s + slope * (j - i).astype(jnp.float32),
                  score_mod_args=(extra[0],))  # fmt: skip
    elif f == "prefix_lm":
        kw["mask_mod"] = lambda b, h, i, j: (j <= i) | (j < PREFIX)
    elif f == "documents":
        kw["mask_mod"] = lambda b, h, i, j: i // DOCUMENT == j // DOCUMENT
    elif f in ("bias", "mask"):
        kw[f] = extra[0]
    elif f == "dropout":
        kw.update(dropout_rate=0.1, dropout_key=jax.random.key(7))
    return kw


def feature_arrays(case: Case, dtype) -> tuple:
    """The arrays a feature row passes (timed as arguments, not baked into the program): ALiBi slopes `[N, 1, 1]`, a
    bias `[B, N, T, S]`, a causal boolean mask `[B, 1, T, S]`, splash's 192-wide values for MLA."""
    if case.feature == "alibi":
        return (2.0 ** (-8.0 * jnp.arange(1, case.n + 1, dtype=jnp.float32) / case.n)[:, None, None],)
    if case.feature == "bias":
        return tuple(harness.normal((case.b, case.n, case.s, case.s), seed=3, dtype=dtype))
    if case.feature == "mask":
        return (jnp.broadcast_to(jnp.tril(jnp.ones((case.s, case.s), bool)), (case.b, 1, case.s, case.s)),)
    if case.feature == "mla":
        return tuple(harness.normal((case.b, case.s, case.k, case.h), seed=4, dtype=dtype))
    return ()


def flops(case: Case) -> tuple[float, float]:
    """Forward and forward + backward FLOPs (visible pairs only, `harness.flops`)."""
    pairs = harness.visible_pairs(case.s, case.causal or case.feature in ("mask", "prefix_lm"), case.window)
    if case.feature == "prefix_lm":  # causal, and the first PREFIX keys for the first PREFIX queries too
        prefix = min(PREFIX, case.s)
        pairs += prefix * (prefix - 1) // 2
    if case.feature == "documents":
        pairs = (case.s // DOCUMENT) * DOCUMENT**2
    return harness.flops(pairs * case.b * case.n, case.h, case.hv or case.h)


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


def splash_fn(case: Case, *, default: bool, interpret: bool, per_kv_head: bool = False, grouped: bool = False):
    """`fn(q, k, v, segment_ids=None) -> out`, all `[B, T, N, H]`, through raw splash attention (see the module
    docstring); `per_kv_head`: the MQA kernel per key/value head also for MHA; `grouped`: the MHA kernel over all
    `N` query heads against the `K` key/value heads, GQA included (`splash_grouped`). Segment ids `[B, T]` (one
    `SegmentIds` of a batch row for all its heads; the documents row makes its own) reach either kernel."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )

    shape = (case.s, case.s)
    if case.feature == "prefix_lm":
        rows, cols = np.arange(case.s)[:, None], np.arange(case.s)[None, :]
        one = mask_lib.NumpyMask((cols <= rows) | (cols < PREFIX))
    elif case.window is not None:
        one = mask_lib.LocalMask(shape, window_size=(case.window, 0), offset=0)
    elif case.causal or case.feature in ("bias", "mask"):
        one = mask_lib.CausalMask(shape)
    else:
        one = mask_lib.FullMask(shape)
    group = case.n // case.k
    mha = grouped or (group == 1 and not per_kv_head)
    heads = case.n if mha else group
    mask = mask_lib.MultiHeadMask([one] * heads)
    make = kernel_lib.make_splash_mha_single_device if mha else kernel_lib.make_splash_mqa_single_device
    kernel = make(mask, block_sizes=_splash_blocks(case, default), interpret=interpret)
    scale = 1.0 / math.sqrt(case.h)

    documents = case.feature == "documents"

    def fn(q, k, v, segment_ids=None, extra=()):
        if documents:
            segment_ids = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) // DOCUMENT, q.shape[:2])
        if case.feature == "mla":
            v = extra[0]  # splash's nearest call: 192-wide values
        if case.feature == "float32":
            q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        b, t, n, h = q.shape
        q = q * jnp.asarray(scale, q.dtype)
        to_heads = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # [B, T, N, H] -> [B, N, T, H]
        ids = None if segment_ids is None else kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
        with_ids = lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids)
        if mha:  # one kernel over all heads, vmapped over the batch
            return to_heads(jax.vmap(with_ids)(to_heads(q), to_heads(k), to_heads(v), ids))
        # GQA: [B, T, K, G, H] -> [B, K, G, T, H] against [B, K, S, H]; vmapped over batch and key/value heads
        q5 = jnp.transpose(jnp.reshape(q, (b, t, case.k, group, h)), (0, 2, 3, 1, 4))
        per_head = jax.vmap(with_ids, in_axes=(0, 0, 0, None))
        out = jax.vmap(per_head)(q5, to_heads(k), to_heads(v), ids)  # [B, K, G, T, H]
        return jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (b, t, n, h))

    return fn


def variant_fns(case: Case, names, interpret: bool) -> dict:
    """name -> `fn(q, k, v, *feature_arrays) -> out`; a variant that cannot even be built maps to its exception."""
    table = {}
    for name in names:
        try:
            if name == "attnlib":
                table[name] = lambda q, k, v, *x: attnlib.attention(q, k, v, **_kwargs(case, *x))
            elif name.startswith("attnlib_flex"):  # attnlib's own Pallas kernel, also where splash would serve
                blocks = tuple(map(int, name.split("@")[1].split("x"))) if "@" in name else None
                flex = attnlib.PallasTpu(kernel="flex", flex_blocks=blocks, interpret=interpret)
                table[name] = lambda q, k, v, *x: attnlib.attention(q, k, v, implementation=flex, **_kwargs(case, *x))
            elif name.startswith("attnlib_"):
                impl = name[len("attnlib_") :]
                table[name] = lambda q, k, v, *x, impl=impl: attnlib.attention(
                    q, k, v, implementation=impl, **_kwargs(case, *x)
                )
            elif name == "jax_nn":
                if case.feature not in (None, "bias", "mask", "float32"):
                    raise NotImplementedError(f"jax.nn has no {case.feature}")
                table[name] = lambda q, k, v, *x: jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                                                               **_kwargs(case, *x))  # fmt: skip
            elif name in SPLASH_PEERS:
                call = splash_fn(case, default=name == "splash_default", interpret=interpret,
                                 grouped=name == "splash_grouped")  # fmt: skip
                table[name] = lambda q, k, v, *x, call=call: call(q, k, v, None, x)[..., : case.hv or case.h]
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
    hv = case.hv or case.h
    dtype = jnp.float32 if case.feature == "float32" else jnp.bfloat16
    shape_kv = (case.b, case.s, case.k, case.h)
    q, k, v, dout = harness.normal((case.b, case.s, case.n, case.h), shape_kv, shape_kv[:3] + (hv,),
                                   (case.b, case.s, case.n, hv), dtype=dtype)  # fmt: skip
    extra = feature_arrays(case, dtype)
    args = (q, k, v, *extra)
    kw = _kwargs(case, *extra)
    if case.feature is None:
        ref = reference(q, k, v, case)
    else:  # attnlib's plain-JAX path at full precision (tested against float64 in tests/)
        f32 = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
        ref = np.asarray(jax.jit(lambda *a: attnlib.attention(*a[:3], implementation="xla_chunked",
                                                              **_kwargs(case, *a[3:])))(*map(f32, args)))  # fmt: skip
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
            if case.feature is not None and label.startswith("splash"):
                result["unchecked"] = "splash's nearest call, not this row's computation"
            else:
                result.update(harness.checked(fwd(*args), ref, tol))
            if "wrong" in result:
                continue
        except Exception as e:  # noqa: BLE001
            result["error"] = harness.error_or_oom(e)
            continue
        timed[label] = {"fwd": fwd}
        try:
            argnums = (0, 1, 2, 3) if case.feature == "bias" and not label.startswith("splash") else (0, 1, 2)
            grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dout.astype(jnp.float32)), argnums)
            timed[label]["fwd_bwd"] = jax.jit(grad).lower(*args).compile()
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
    for peer in SPLASH_PEERS:
        theirs = row["variants"].get(peer, {})
        for kind in ("fwd", "fwd_bwd"):
            if f"{kind}_ms" in mine and f"{kind}_ms" in theirs:
                row.setdefault(f"attnlib_vs_{peer}", {})[kind] = theirs[f"{kind}_ms"] / mine[f"{kind}_ms"]
    return row


def table(results: dict) -> str:
    labels = list(dict.fromkeys(label for row in results.values() for label in row["variants"]))
    lines = [
        "| case | attnlib picks | " + " | ".join(labels) + "".join(f" | attnlib vs {p}" for p in SPLASH_PEERS) + " |",
        "|---" * (len(labels) + 2 + len(SPLASH_PEERS)) + "|",
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
            for peer in SPLASH_PEERS
        ]
        lines.append(f"| {name} | {row.get('attnlib_pick')} | " + " | ".join(cells + speed) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = harness.parser(__doc__, only="cases, run in that order", rounds=1)
    parser.add_argument("--variants", nargs="*", default=None, help=f"a subset of {VARIANTS}")
    parser.add_argument("--flex-blocks", nargs="*", default=(), help="flex kernel tiles to add, as BQxBK (256x1024)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, splash interpreted, few repetitions")
    args = parser.parse_args(argv)
    cases = SMOKE_CASES if args.smoke else {**CASES, **FEATURE_CASES}
    harness.check_names(parser, args.only, cases)
    harness.check_names(parser, args.variants, VARIANTS, "variants")
    for blocks in args.flex_blocks:
        if not re.fullmatch(r"\d+x\d+", blocks):
            parser.error(f"--flex-blocks takes BQxBK such as 256x1024; got {blocks!r}")
    names = tuple(args.variants or VARIANTS) + tuple(f"attnlib_flex@{b}" for b in args.flex_blocks)
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
