"""Model benchmark: the training step of the Llama-shaped model of `examples/`, with only the attention core swapped.

Usage: python benchmarks/bench_model.py [--json out.json] [--only CONFIG ...] [--framework equinox haiku]
       [--variants NAME ...] [--warmup 2] [--steps 5] [--remat save_attention] [--optimizer adamw] [--profile]
       [--smoke]

The step is `examples/train.py`'s on `llama.py` (Equinox) or `llama_haiku.py` (Haiku, the same weights), per-block
remat (`--remat`: `save_attention` keeps every core's kernel results, `full` recomputes everything), bfloat16,
`--optimizer`'s update (`adamw`: `train.make_optimizer`'s; `sgd`: plain SGD, an update that costs little), the same
batch (packed configs: segment ids of several documents a row). Variants: `attnlib` (the model as written; its pick:
`attnlib_pick`), `jax_nn` (XLA), `jax_nn_cudnn` (GPU), `splash` (raw, 512-blocks, `bench_tpu.splash_fn`: the MQA
kernel per key/value head; TPU), `splash_grouped` (the same, GQA through splash's MHA kernel; TPU), `tokamax`
(GPU); jax.nn and tokamax get documents as a dense `[B, 1, T, T]` mask. One that cannot run: `skipped`.

Per config, framework and variant: `step_ms` (median of `--steps` after `--warmup`), `tokens_per_s`, `mfu`,
`compile_s`, `peak_bytes_in_use` (the process's high-water mark), `compiled_bytes`, the losses and
`max_loss_diff_vs_attnlib`; `hlo` (`hlo_and_traces.layout_ops`: transposes and copies next to the attention calls);
`attention_core` (the core alone, `harness.time_calls`; `share_of_step` = `num_layers (fwd_bwd + fwd) / step` under
`--remat full`, `num_layers fwd_bwd / step` otherwise); `--profile`: `profile` (the device time of 2 traced steps and
the attention kernels' share, `hlo_and_traces.profile_device_time`; TPU traces).

MFU counts model FLOPs (the PaLM convention: forward + backward = 3x forward, remat recomputation not counted):
`6 P tokens + 12 L N H E`, with `P` the parameters of the matrix multiplies (all but the input embedding and the
RMSNorm weights), `L` layers, `N` query heads of `H`, and `E` the visible (query, key) pairs summed over rows (causal:
`T (T + 1) / 2` a row; windows and documents exact). Peaks (dense bf16): H100 / H200 989 TFLOP/s, TPU v5e 197 TFLOP/s;
elsewhere `mfu` is null.

`--smoke`: tiny configs on any backend (attnlib and jax.nn), not a measurement.
"""

import dataclasses
import importlib.metadata
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import bench_tpu  # run as a script: benchmarks/ is on sys.path
import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hlo_and_traces import layout_ops, profile_device_time


_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "examples"))
import llama  # noqa: E402
import train  # noqa: E402

import attnlib  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    model: llama.LlamaConfig
    batch: int
    seq: int
    documents: tuple[int, int] | None = None  # packed: document lengths drawn uniformly from [lo, hi], rows filled
    gpu_only: bool = False


# 8 layers of 45.1M + embedding and head of 65.5M each: 492M parameters
LLAMA_492M = llama.LlamaConfig(vocab_size=32_000, dim=2048, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=128,
                               hidden_dim=5632, rope_theta=500_000.0, remat=True)  # fmt: skip
LLAMA_1B = dataclasses.replace(LLAMA_492M, num_layers=20)  # 1.03B parameters

CONFIGS = {
    "llama_492m_1x8k": Config(LLAMA_492M, 1, 8192),
    "llama_492m_4x2k": Config(LLAMA_492M, 4, 2048),
    "packed_4x2k": Config(LLAMA_492M, 4, 2048, documents=(128, 1024)),
    "llama_1b_4k": Config(LLAMA_1B, 2, 4096, gpu_only=True),
    "sliding_window_8k": Config(dataclasses.replace(LLAMA_492M, sliding_window=4096), 1, 8192),
}

_TINY = llama.LlamaConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, remat=True)
SMOKE_CONFIGS = {
    "smoke_packed": Config(_TINY, 2, 64, documents=(8, 40)),
    "smoke_window": Config(dataclasses.replace(_TINY, sliding_window=16), 1, 64),
}


def _peer_kernels(primitive, *_, **__) -> bool:
    """The peers' attention kernels, kept as attnlib's are: raw splash and tokamax run Pallas calls, jax.nn's cuDNN
    path binds `dot_product_attention_fwd_wrapper` (JAX 0.10-0.12; `dot_product_attention_fwd` below it)."""
    return primitive.name in ("pallas_call", "dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")


REMAT_CHOICES = {"none": False, "full": True} | {
    name: jax.checkpoint_policies.save_from_both_policies(policy, _peer_kernels)
    for name, policy in llama.REMAT_POLICIES.items()
    if name != "full"
}  # llama.LlamaConfig.remat by name; the policies that keep attnlib's kernels keep every peer's too
DEFAULT_REMAT = "save_attention"
OPTIMIZERS = ("adamw", "sgd")
VARIANTS = ("attnlib", "jax_nn", "jax_nn_cudnn", "splash", "splash_grouped", "tokamax")
FRAMEWORKS = ("equinox", "haiku")
LEARNING_RATE = 3e-4
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "v5 lite": 197.0, "v5e": 197.0}
FLOPS_CONVENTION = " ".join(next(p for p in __doc__.split("\n\n") if p.startswith("MFU counts")).split())  # in the JSON


def make_batch(config: Config, seed: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """Random tokens `[B, T]`; with `documents`, segment ids `1, 2, ...` of documents of random lengths filling each
    row (the last one cut at the row's end)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.model.vocab_size, (config.batch, config.seq), dtype=np.int32)
    if config.documents is None:
        return tokens, None
    lo, hi = config.documents
    segment_ids = np.zeros((config.batch, config.seq), np.int32)
    for row in range(config.batch):
        at, doc = 0, 0
        while at < config.seq:
            doc += 1
            n = int(rng.integers(lo, hi + 1))
            segment_ids[row, at : at + n] = doc
            at += n
    return tokens, segment_ids


def visible_pairs(segment_ids: np.ndarray | None, batch: int, seq: int, window: int | None) -> int:
    """(query, key) pairs a causal (windowed) attention over documents sees, summed over rows."""
    rows = np.ones((batch, seq), np.int32) if segment_ids is None else segment_ids
    lengths = [n for row in rows for n in np.unique(row, return_counts=True)[1]]  # each document one contiguous run
    return sum(harness.visible_pairs(int(n), True, window) for n in lengths)


def model_flops(config: Config, params, segment_ids) -> dict:
    m = config.model
    leaves = jax.tree.leaves(params)
    total = sum(x.size for x in leaves)
    matmul = sum(x.size for x in leaves if x.ndim >= 2) - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    tokens = config.batch * config.seq
    pairs = visible_pairs(segment_ids, config.batch, config.seq, m.sliding_window)
    dense = 6.0 * matmul * tokens
    attention = 12.0 * m.num_layers * m.num_heads * m.head_dim * pairs
    return {"params": total, "matmul_params": matmul, "tokens": tokens, "visible_pairs": pairs, "dense": dense,
            "attention": attention, "total": dense + attention, "attention_share": attention / (dense + attention)}


def peak_tflops(device) -> float | None:
    kind = device.device_kind.lower()
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in kind), None)


def _segment_mask(segment_ids):
    """`[B, 1, T, T]` True where query and key are in the same document."""
    if segment_ids is None:
        return None
    s = jnp.asarray(segment_ids)
    return s[:, None, :, None] == s[:, None, None, :]


def _window(config: Config):
    w = config.model.sliding_window
    return None if w is None else (w, 0)


def attention_core(variant: str, config: Config) -> Callable:
    """`core(q, k, v, segment_ids) -> out` of `variant`; raises `NotImplementedError(reason)` where it cannot run."""
    platform = jax.devices()[0].platform
    window = _window(config)
    if variant == "attnlib":
        impl = config.model.implementation
        return lambda q, k, v, s: attnlib.attention(
            q, k, v, is_causal=True, local_window_size=window, q_segment_ids=s, implementation=impl
        )
    if variant in ("jax_nn", "jax_nn_cudnn"):
        if variant == "jax_nn_cudnn" and platform != "gpu":
            raise NotImplementedError(f"jax.nn's cuDNN path needs a CUDA GPU; this device is a {platform}")
        impl = "cudnn" if variant == "jax_nn_cudnn" else None
        return lambda q, k, v, s: jax.nn.dot_product_attention(
            q, k, v, mask=_segment_mask(s), is_causal=True, local_window_size=window, implementation=impl
        )
    if variant in ("splash", "splash_grouped"):
        if platform != "tpu":
            raise NotImplementedError("raw splash attention needs a TPU (interpret mode is too slow for a model step); "
                                      f"this device is a {platform}")  # fmt: skip
        m = config.model  # raw splash on [B, T, N, H], causal (bench_tpu.splash_fn)
        case = bench_tpu.Case(config.batch, config.seq, m.num_heads, m.num_kv_heads, m.head_dim, True, m.sliding_window)
        grouped = variant == "splash_grouped"
        return bench_tpu.splash_fn(case, default=False, interpret=False, per_kv_head=not grouped, grouped=grouped)
    if variant == "tokamax":
        if platform != "gpu":
            raise NotImplementedError(f"tokamax is benchmarked on GPUs only; this device is a {platform}")
        try:
            import tokamax
        except Exception as e:  # noqa: BLE001
            raise NotImplementedError(f"tokamax is not importable: {harness.error(e, 200)}") from e
        return lambda q, k, v, s: tokamax.dot_product_attention(
            q, k, v, mask=_segment_mask(s), is_causal=True, local_window_size=window
        )
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def build(framework: str, config: Config, core: Callable | None):
    """`(params, loss_fn)` of the model with `core` as every layer's attention (None: the model's own attnlib
    layer). The same weights in both frameworks: Haiku's are converted from the Equinox model's."""
    import equinox as eqx

    eqx_model = llama.Llama(config.model, key=jax.random.key(0))
    if framework == "equinox":
        if core is not None:

            class Core(eqx.Module):
                fn: Callable = eqx.field(static=True)

                def __call__(self, q, k, v, q_segment_ids=None):
                    return self.fn(q, k, v, q_segment_ids)

            layers = lambda m: [block.attn.core for block in m.layers]
            eqx_model = eqx.tree_at(layers, eqx_model, [Core(core)] * config.model.num_layers)
        params, static = eqx.partition(eqx_model, eqx.is_inexact_array)

        def loss_fn(params, tokens, segment_ids):
            return llama.loss(eqx.combine(params, static), tokens, segment_ids)

        return params, loss_fn
    if framework == "haiku":
        import llama_haiku

        params = llama_haiku.params_from_equinox(eqx_model)
        model = llama_haiku.transform(config.model, core)

        def loss_fn(params, tokens, segment_ids):
            return llama_haiku.loss(params, tokens, segment_ids, model=model)

        return params, loss_fn
    raise ValueError(f"unknown framework {framework!r}; known: {FRAMEWORKS}")


def time_attention_core(core: Callable, config: Config, segment_ids, loops: int, target_s: float = 0.05) -> dict:
    """The core alone on the model's shapes (bf16): fwd and fwd+bwd ms, as `harness.time_calls` times them."""
    m = config.model
    shape_q = (config.batch, config.seq, m.num_heads, m.head_dim)
    shape_kv = (config.batch, config.seq, m.num_kv_heads, m.head_dim)
    q, k, v, dout = harness.normal(shape_q, shape_kv, shape_kv, shape_q, seed=1, dtype=m.dtype)
    s = None if segment_ids is None else jnp.asarray(segment_ids)
    with_ids = lambda q, k, v: core(q, k, v, s)  # noqa: E731
    result = {}
    for kind, fn in (("fwd", jax.jit(with_ids)), ("fwd_bwd", jax.jit(harness.grad_fn(with_ids, dout)))):
        try:
            times = harness.time_calls(fn, (q, k, v), loops=loops, target_s=target_s)
            result[f"{kind}_ms"] = statistics.median(times) * 1e3
        except Exception as e:  # noqa: BLE001
            result[f"{kind}_error"] = harness.error_or_oom(e)
    return result


def make_optimizer(name: str, steps: int):
    """`train.make_optimizer`'s AdamW over `steps` (`adamw`) or plain SGD (`sgd`), at `LEARNING_RATE`."""
    if name == "sgd":
        return optax.sgd(LEARNING_RATE)
    if name == "adamw":
        return train.make_optimizer(LEARNING_RATE, steps)
    raise ValueError(f"unknown optimizer {name!r}; known: {OPTIMIZERS}")


def run_variant(framework: str, variant: str, config: Config, batch, *, warmup: int, steps: int, peak,
                smoke: bool = False, profile: bool = False, optimizer: str = "adamw") -> dict:  # fmt: skip
    result: dict = {}
    try:
        core_fn = attention_core(variant, config)
    except NotImplementedError as e:
        return {"skipped": str(e)}
    if config.documents is not None:  # how the core sees the documents
        dense = "dense [B, 1, T, T] mask from the segment ids"
        result["attention_mask"] = {"attnlib": "segment ids", "splash": "segment ids", "splash_grouped": "segment ids",
                                    "jax_nn_cudnn": dense +
                                    " (jax.nn's cuDNN path: an additive bias)"}.get(variant, dense)  # fmt: skip
    tokens, segment_ids = batch
    try:
        params, loss_fn = build(framework, config, None if variant == "attnlib" else core_fn)
        update = make_optimizer(optimizer, warmup + steps)
        opt_state = update.init(params)
        step = train.make_step(loss_fn, update)
        args = (tokens, segment_ids)
        start = time.perf_counter()
        compiled = step.lower(params, opt_state, *args).compile()
        result["compile_s"] = time.perf_counter() - start
        result["compiled_bytes"] = harness.compiled_bytes(compiled)
        try:
            result["hlo"] = layout_ops(compiled.as_text())
        except Exception as e:  # noqa: BLE001
            result["hlo"] = {"error": harness.error(e, 200)}
        losses, times = [], []
        for i in range(warmup + steps):
            start = time.perf_counter()
            params, opt_state, loss = jax.block_until_ready(compiled(params, opt_state, *args))
            elapsed = time.perf_counter() - start
            losses.append(float(loss))
            if i >= warmup:
                times.append(elapsed)
        if profile:
            state = [params, opt_state]

            def run_step():
                state[0], state[1], _ = jax.block_until_ready(compiled(state[0], state[1], *args))

            result["profile"] = profile_device_time(run_step, compiled.as_text())
            params, opt_state = state
        del params, opt_state
    except Exception as e:  # noqa: BLE001  (reported, not fatal)
        result["error"] = harness.error_or_oom(e)
        return result
    step_s = statistics.median(times)
    result.update(
        step_ms=step_s * 1e3,
        step_min_ms=min(times) * 1e3,
        step_max_ms=max(times) * 1e3,
        tokens_per_s=config.batch * config.seq / step_s,
        losses=losses,
        loss=losses[0],
    )
    result["mfu"] = None if peak is None else peak["flops"] / step_s / (peak["tflops"] * 1e12)
    result["peak_bytes_in_use"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    core = time_attention_core(core_fn, config, segment_ids, loops=2 if smoke else 5, target_s=0.005 if smoke else 0.05)
    if "fwd_ms" in core and "fwd_bwd_ms" in core:
        recomputed_forward = core["fwd_ms"] if config.model.remat is True else 0.0  # --remat full
        core["share_of_step"] = config.model.num_layers * (core["fwd_bwd_ms"] + recomputed_forward) / result["step_ms"]
    result["attention_core"] = core
    return result


def attnlib_pick(config: Config, segment_ids) -> str:
    """`attnlib.explain(...).implementation` for the model's attention call, on shapes only (the segment ids not
    concrete, as under `jit`)."""
    m = config.model
    q = jax.ShapeDtypeStruct((config.batch, config.seq, m.num_heads, m.head_dim), m.dtype)
    kv = jax.ShapeDtypeStruct((config.batch, config.seq, m.num_kv_heads, m.head_dim), m.dtype)
    s = None if segment_ids is None else jax.ShapeDtypeStruct(segment_ids.shape, jnp.int32)
    try:
        pick = attnlib.explain(q, kv, kv, is_causal=True, local_window_size=_window(config), q_segment_ids=s)
        return str(pick.implementation)
    except Exception as e:  # noqa: BLE001
        return f"explain failed: {harness.error(e, 200)}"


def param_shapes(config: Config):
    """The model's parameters as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    import equinox as eqx

    return jax.eval_shape(lambda: eqx.filter(llama.Llama(config.model, key=jax.random.key(0)), eqx.is_inexact_array))


def run_config(name: str, config: Config, frameworks, variants, *, warmup: int, steps: int, smoke: bool = False,
               profile: bool = False, optimizer: str = "adamw",
               on_result: Callable[[dict], None] = lambda row: None) -> dict:  # fmt: skip
    """One config: every framework and variant; `on_result(row)` after each variant (the row so far)."""
    device = jax.devices()[0]
    if config.gpu_only and device.platform != "gpu":
        return {"skipped": f"GPU only (~1B parameters: too large for this {device.device_kind})"}
    batch = make_batch(config)
    flops = model_flops(config, param_shapes(config), batch[1])
    tflops = peak_tflops(device)
    peak = None if tflops is None else {"flops": flops["total"], "tflops": tflops}
    model = {k: (jnp.dtype(v).name if k.endswith("dtype") else v) for k, v in dataclasses.asdict(config.model).items()
             if k != "remat"}  # remat: the header's name  # fmt: skip
    row = {"model": model, "batch": config.batch, "seq": config.seq,
           "documents_per_row": None if batch[1] is None else [int(r.max()) for r in batch[1]], "flops": flops,
           "attnlib_pick": attnlib_pick(config, batch[1]), "frameworks": {}}  # fmt: skip
    for framework in frameworks:
        out = row["frameworks"][framework] = {"variants": {}}
        for variant in variants:
            out["variants"][variant] = result = run_variant(
                framework, variant, config, batch, warmup=warmup, steps=steps, peak=peak, smoke=smoke, profile=profile,
                optimizer=optimizer,
            )
            print(f"{name} {framework} {variant}: {_summary(result)}", flush=True)
            on_result(row)
        base = out["variants"].get("attnlib", {})
        diffs = {}
        for variant, result in out["variants"].items():
            if "losses" in result and "losses" in base:
                diff = max(abs(a - b) for a, b in zip(result["losses"], base["losses"]))
                result["max_loss_diff_vs_attnlib"] = diffs[variant] = diff
                result["speedup_of_attnlib"] = result["step_ms"] / base["step_ms"]
        out["max_loss_diff_vs_attnlib"] = max(diffs.values(), default=None)
    runs = [row["frameworks"][f]["variants"].get("attnlib", {}).get("losses") for f in frameworks]
    if len(runs) == 2 and all(runs):
        row["max_loss_diff_equinox_vs_haiku"] = max(abs(a - b) for a, b in zip(*runs))
    return row


def _summary(result: dict) -> str:
    if "skipped" in result:
        return f"skipped ({result['skipped']})"
    if "error" in result:
        return f"error ({result['error']})"
    mfu = "" if result["mfu"] is None else f", MFU {result['mfu']:.1%}"
    hlo = result.get("hlo", {})
    return (
        f"{result['step_ms']:.1f} ms/step, {result['tokens_per_s']:,.0f} tokens/s{mfu}, loss {result['loss']:.4f}, "
        f"{hlo.get('attention_calls', '?')} attention calls, layout ops feeding/consuming them "
        f"{hlo.get('feeding')}/{hlo.get('consuming')}"
    )


def table(results: dict) -> str:
    header = ["config", "framework", "variant", "step ms", "tokens/s", "MFU", "peak GiB", "loss", "Δloss vs attnlib",
              "attention share", "transposes / copies (standalone next to attention)"]  # fmt: skip
    lines = []
    for name, row in results.items():
        if "skipped" in row:
            lines.append([name, "", "", f"skipped: {row['skipped']}"] + [""] * 7)
            continue
        for framework, out in row["frameworks"].items():
            for variant, r in out["variants"].items():
                if "step_ms" not in r:
                    lines.append([name, framework, variant, r.get("skipped") or r.get("error")] + [""] * 7)
                    continue
                peak = r.get("peak_bytes_in_use")
                share = r.get("attention_core", {}).get("share_of_step")
                hlo = r.get("hlo", {})
                near = sum(hlo.get(side, {}).get("standalone", 0) for side in ("feeding", "consuming"))
                moved = sum(hlo.get(side, {}).get("standalone_bytes", 0) for side in ("feeding", "consuming"))
                cells = [
                    f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", "—" if r["mfu"] is None else f"{r['mfu']:.1%}",
                    "—" if peak is None else f"{peak / 2**30:.1f}", f"{r['loss']:.4f}",
                    f"{r.get('max_loss_diff_vs_attnlib', float('nan')):.2g}", "—" if share is None else f"{share:.0%}",
                    f"{hlo.get('transposes', '?')} / {hlo.get('copies', '?')} ({near}: {moved / 2**20:.0f} MiB)",
                ]  # fmt: skip
                lines.append([name, framework, variant, *cells])
    return harness.markdown(header, lines)


def _versions() -> dict:
    out = {}
    for package in ("jax", "jaxlib", "attnlib", "equinox", "dm-haiku", "optax", "tokamax"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, only="configs, run in that order")
    parser.add_argument("--framework", nargs="*", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--variants", nargs="*", default=None, help=f"a subset of {VARIANTS}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on any backend: the script works")
    parser.add_argument("--remat", choices=REMAT_CHOICES, default=DEFAULT_REMAT, help="per-block remat of every config "
                        "(llama.LlamaConfig.remat: none, full, or a policy that keeps the attention kernels' results)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="the step's update: adamw "
                        "(train.make_optimizer) or sgd")
    parser.add_argument("--profile", action="store_true", help="also trace 2 steps of each variant: device time and "
                        "the attention kernels' share (TPU traces)")  # fmt: skip
    args = parser.parse_args(argv)
    configs = {
        name: dataclasses.replace(c, model=dataclasses.replace(c.model, remat=REMAT_CHOICES[args.remat]))
        for name, c in (SMOKE_CONFIGS if args.smoke else CONFIGS).items()
    }
    harness.check_names(parser, args.only, configs, "configs")
    harness.check_names(parser, args.variants, VARIANTS, "variants")
    variants = tuple(args.variants or VARIANTS)
    if "attnlib" not in variants:
        variants = ("attnlib",) + variants  # the reference of the loss differences
    warmup, steps = (1, 2) if args.smoke else (max(1, args.warmup), max(1, args.steps))
    device = jax.devices()[0]
    header = {"device": str(device), "device_kind": device.device_kind, "platform": device.platform,
              "versions": _versions(), "smoke": args.smoke, "warmup": warmup, "steps": steps,
              "learning_rate": LEARNING_RATE, "optimizer": args.optimizer, "remat": args.remat,
              "peak_tflops": peak_tflops(device), "flops": FLOPS_CONVENTION}  # fmt: skip
    print(json.dumps(header), flush=True)
    results = {}
    started = time.perf_counter()

    def save(name, row):
        results[name] = row
        harness.write_json(args.json, {**header, "configs": results})  # after every variant

    for name in args.only or configs:
        row = run_config(name, configs[name], args.framework, variants, warmup=warmup, steps=steps, smoke=args.smoke,
                         profile=args.profile, optimizer=args.optimizer,
                         on_result=lambda row, name=name: save(name, row))  # fmt: skip
        save(name, row)
    print(table(results))
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
