"""Model benchmark: the training step of the Llama-shaped model of `examples/`, with only the attention core swapped.

Usage: python benchmarks/bench_model.py [--json out.json] [--only CONFIG ...] [--framework equinox haiku]
       [--variants NAME ...] [--warmup 2] [--steps 5] [--remat save_attention] [--profile] [--smoke]

The step is `examples/train.py`'s (`make_step`, `make_optimizer`): forward, backward and the optax update (AdamW,
float32 master weights, gradient clipping) of `examples/llama.py` (Equinox) or `examples/llama_haiku.py` (Haiku),
per-layer remat, bfloat16 compute, donated parameters and optimizer state. The remat (`--remat`) is by default
`save_attention`: each block is recomputed in the backward pass except its attention kernel, whose results are kept
(`attnlib.checkpoint_policies.save_attention`; the peers' kernels are kept alike); `full` recomputes everything.
Both frameworks start from the same weights (`llama_haiku.params_from_equinox`) and see the same batch (random tokens;
packed configs add segment ids of several documents per row). Variants, one attention core each, everything else equal
(`q` `[B, T, N, H]`, `k`, `v` `[B, T, K, H]`, causal, the config's window and documents):

- `attnlib`: the model as written: `attnlib.equinox` / `attnlib.haiku.DotProductAttention`, `implementation=None`
  (what it picks: `attnlib_pick`, from `attnlib.explain`, and the custom calls in the step's HLO).
- `jax_nn`: `jax.nn.dot_product_attention(implementation=None)` (JAX 0.10: the XLA path, scores materialized).
- `jax_nn_cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`; GPU only.
- `splash`: raw `jax.experimental.pallas.ops.tpu.splash_attention` with 512-blocks (`bench_tpu.py`'s
  `_splash_blocks`), `make_splash_mqa_single_device` per key/value head, segment ids as splash `SegmentIds`, `q`
  pre-scaled, the transposes to its `[heads, T, H]` layout inside the core; TPU only.
- `tokamax`: `tokamax.dot_product_attention` (its automatic choice); GPU only, where `import tokamax` works.

jax.nn and tokamax take no segment ids: with documents their core gets the dense `[B, 1, T, T]` mask built from the
segment ids (`seg[:, None, :, None] == seg[:, None, None, :]`, plus `is_causal`); jax.nn's cuDNN path turns it into
an additive bias. A variant that cannot run here is recorded with `skipped` and the reason; one that fails with
`error` (`out of memory` when it is that).

Per config, framework and variant: `step_ms` (median of `--steps` timed steps after `--warmup` steps; every step ends
in `block_until_ready`; also min / max), `tokens_per_s` (`B T` / step), `mfu`, `compile_s`, memory (`peak_bytes_in_use`
from `device.memory_stats()` where the device has it: a high-water mark of the whole process, so a later variant
reads at least an earlier one's peak; and `compiled_bytes`, the step executable's argument / output / temporary bytes,
per variant), the loss of every step and `max_loss_diff_vs_attnlib` (the largest difference from attnlib's loss at
the same step: same weights, same batch; bfloat16 noise), and the layer overhead:

- `hlo`: in the compiled HLO of the step (`jax.jit(step).lower(...).compile().as_text()`), the `transpose` and `copy`
  instructions (all computations, fused ones included), the attention custom calls (cuDNN, Mosaic TPU, Triton,
  Mosaic GPU targets) and, for their operands and results, the transposes / copies that produce or consume them
  directly (through bitcasts and tuples, into and out of wrapped computations such as command buffers):
  `feeding` / `consuming`, each `standalone` (a transpose or copy, or a fusion of nothing else: an extra pass over
  the tensor) and `in_fusion` (a fusion that computes and also writes a transposed layout); `traced_in_attention`:
  transposes / copies whose source location lies under a scope named like attention. The model's projections
  write `[B, T, N, H]`: the target is zero standalone copies around attnlib's call.
- `attention_core`: the core alone on the model's shapes: forward and forward + backward (the gradient of
  `sum(out * dout)` wrt q, k, v) timed as `bench_tpu.py` does (`time_calls`), and `share_of_step` =
  `num_layers (fwd_bwd + fwd) / step` under `--remat full` (which runs each layer's forward twice), `num_layers
  fwd_bwd / step` otherwise: the attention share of the step, an estimate from isolated calls.
- `profile` (`--profile`): 2 more steps under the JAX profiler; per step, `device_ms` (the device's XLA ops summed),
  `attention_ms` (the attention custom calls among them) and `attention_share`: the measured share, where the
  backend's trace has an "XLA Ops" line (the TPU's; elsewhere `skipped`).

MFU counts model FLOPs (the PaLM convention: forward + backward = 3x forward, remat recomputation not counted):
`6 P tokens + 12 L N H E`, with `P` the parameters of the matrix multiplies (all but the input embedding and the
RMSNorm weights), `L` layers, `N` query heads of `H`, and `E` the visible (query, key) pairs summed over rows (causal:
`T (T + 1) / 2` a row, i.e. `12 L T^2 D / 2` for `D = N H`; windows and documents counted exactly: the useful FLOPs,
also for a dense-mask core that computes every pair). Peaks (dense bf16): H100 / H200 989 TFLOP/s, TPU v5e 197
TFLOP/s; elsewhere `mfu` is null.

`--smoke` runs tiny configs on any backend in seconds (attnlib and jax.nn; the others recorded as skipped): a check
that the script works, not a measurement.
"""

import argparse
import collections
import dataclasses
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np


_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_ROOT / "examples"))
import llama  # noqa: E402
import train  # noqa: E402

import attnlib  # noqa: E402


def _bench_tpu():
    """`bench_tpu.py`: its splash block sizes, timing loop and error reporting."""
    spec = importlib.util.spec_from_file_location("bench_tpu", pathlib.Path(__file__).parent / "bench_tpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_tpu = _bench_tpu()


@dataclasses.dataclass(frozen=True)
class Config:
    model: llama.LlamaConfig
    batch: int
    seq: int
    documents: tuple[int, int] | None = None  # packed: document lengths drawn uniformly from [lo, hi], rows filled
    gpu_only: bool = False


LLAMA_492M = llama.LlamaConfig(
    vocab_size=32_000,
    dim=2048,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=128,
    hidden_dim=5632,
    rope_theta=500_000.0,
    remat=True,
)  # 8 layers of 45.1M + embedding and head of 65.5M each: 492M parameters
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


REMAT_CHOICES = {
    "none": False,
    "full": True,
    **{
        name: jax.checkpoint_policies.save_from_both_policies(policy, _peer_kernels)
        for name, policy in llama.REMAT_POLICIES.items()
        if name != "full"
    },
}  # llama.LlamaConfig.remat by name; the policies that keep attnlib's kernels keep every peer's too
DEFAULT_REMAT = "save_attention"
VARIANTS = ("attnlib", "jax_nn", "jax_nn_cudnn", "splash", "tokamax")
FRAMEWORKS = ("equinox", "haiku")
LEARNING_RATE = 3e-4
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "v5 lite": 197.0, "v5e": 197.0}
FLOPS_CONVENTION = (
    "model FLOPs, fwd+bwd = 3x fwd, remat not counted: 6 P tokens + 12 L N H E; P = matmul parameters (all but the "
    "input embedding and the norm weights), E = visible (query, key) pairs summed over rows (causal T(T+1)/2 a row; "
    "windows and documents exact)"
)


# ----------------------------------------------------------------------------------------------------------------
# Data and FLOPs


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
    total = 0
    for row in rows:
        _, lengths = np.unique(row, return_counts=True)  # each document one contiguous run
        for n in lengths:
            i = np.arange(int(n))
            total += int(np.sum(i + 1 if window is None else np.minimum(i, window) + 1))
    return total


def model_flops(config: Config, params, segment_ids) -> dict:
    m = config.model
    leaves = jax.tree.leaves(params)
    total = sum(x.size for x in leaves)
    matmul = sum(x.size for x in leaves if x.ndim >= 2) - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    tokens = config.batch * config.seq
    pairs = visible_pairs(segment_ids, config.batch, config.seq, m.sliding_window)
    dense = 6.0 * matmul * tokens
    attention = 12.0 * m.num_layers * m.num_heads * m.head_dim * pairs
    return {
        "params": total,
        "matmul_params": matmul,
        "tokens": tokens,
        "visible_pairs": pairs,
        "dense": dense,
        "attention": attention,
        "total": dense + attention,
        "attention_share": attention / (dense + attention),
    }


def peak_tflops(device) -> float | None:
    kind = device.device_kind.lower()
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in kind), None)


# ----------------------------------------------------------------------------------------------------------------
# Attention cores: fn(q, k, v, segment_ids) -> out


def _segment_mask(segment_ids):
    """`[B, 1, T, T]` True where query and key are in the same document."""
    if segment_ids is None:
        return None
    s = jnp.asarray(segment_ids)
    return s[:, None, :, None] == s[:, None, None, :]


def _window(config: Config):
    w = config.model.sliding_window
    return None if w is None else (w, 0)


def splash_core(config: Config, *, interpret: bool = False):
    """Raw splash attention on `[B, T, N, H]` (see the module docstring)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
        splash_attention_mask as mask_lib,
    )

    m = config.model
    shape = (config.seq, config.seq)
    case = bench_tpu.Case(config.batch, config.seq, m.num_heads, m.num_kv_heads, m.head_dim, True, m.sliding_window)
    one = (
        mask_lib.CausalMask(shape)
        if m.sliding_window is None
        else mask_lib.LocalMask(shape, window_size=(m.sliding_window, 0), offset=0)
    )
    group = m.num_heads // m.num_kv_heads
    kernel = kernel_lib.make_splash_mqa_single_device(
        mask_lib.MultiHeadMask([one] * group),
        block_sizes=bench_tpu._splash_blocks(case, default=False),
        interpret=interpret,
    )
    scale = m.head_dim**-0.5

    def core(q, k, v, segment_ids):
        b, t, n, h = q.shape
        q = q * jnp.asarray(scale, q.dtype)
        q5 = jnp.transpose(jnp.reshape(q, (b, t, m.num_kv_heads, group, h)), (0, 2, 3, 1, 4))  # [B, K, G, T, H]
        to_kv = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # [B, K, S, H]
        if segment_ids is None:
            out = jax.vmap(jax.vmap(kernel))(q5, to_kv(k), to_kv(v))
        else:
            ids = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
            per_head = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids), in_axes=(0, 0, 0, None))
            out = jax.vmap(per_head)(q5, to_kv(k), to_kv(v), ids)
        return jnp.reshape(jnp.transpose(out, (0, 3, 1, 2, 4)), (b, t, n, h))

    return core


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
    if variant == "splash":
        if platform != "tpu":
            raise NotImplementedError(
                f"raw splash attention needs a TPU (interpret mode is too slow for a model step); this device is a "
                f"{platform}"
            )
        return splash_core(config)
    if variant == "tokamax":
        if platform != "gpu":
            raise NotImplementedError(f"tokamax is benchmarked on GPUs only; this device is a {platform}")
        try:
            import tokamax
        except Exception as e:  # noqa: BLE001
            raise NotImplementedError(f"tokamax is not importable: {type(e).__name__}: {str(e)[:200]}") from e
        return lambda q, k, v, s: tokamax.dot_product_attention(
            q, k, v, mask=_segment_mask(s), is_causal=True, local_window_size=window
        )
    raise ValueError(f"unknown variant {variant!r}; known: {VARIANTS}")


def attention_mask_note(variant: str, config: Config) -> str | None:
    if config.documents is None:
        return None
    if variant in ("attnlib", "splash"):
        return "segment ids"
    if variant == "jax_nn_cudnn":
        return "dense [B, 1, T, T] mask from the segment ids (jax.nn's cuDNN path: an additive bias)"
    return "dense [B, 1, T, T] mask from the segment ids"


# ----------------------------------------------------------------------------------------------------------------
# Models


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


# ----------------------------------------------------------------------------------------------------------------
# HLO: transposes and copies around the attention custom calls

ATTENTION_TARGETS = r"attnlib|fmha|tpu_custom_call|mosaic|triton"
_LAYOUT_OPS = ("transpose", "copy")  # copy-start / copy-done: between memory spaces (prefetch)
_DATA_MOVEMENT = ("parameter", "bitcast", "reshape", "get-tuple-element", "tuple", "convert", "slice")
_OP = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


@dataclasses.dataclass
class _Instr:
    name: str
    op: str
    operands: list[str]
    calls: list[str]
    target: str | None
    op_name: str
    index: int | None  # parameter number, tuple index of a get-tuple-element
    root: bool
    bytes: int  # of its result (all arrays of a tuple)


def _parse_operands(text: str, start: int) -> tuple[list[str], int]:
    depth, i, parts, current = 1, start, [], []
    while i < len(text) and depth:
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if depth == 1 and ch == ",":
            parts.append("".join(current))
            current = []
        elif depth:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return [p.split()[-1].lstrip("%") for p in parts if p.strip()], i


def _bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(result_type):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype)[:2] or 8)
        total += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * bits // 8
    return total


def parse_hlo(text: str) -> dict[str, list[_Instr]]:
    """Computation name -> its instructions, from `Compiled.as_text()`."""
    computations: dict[str, list[_Instr]] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            header = line.split("(")[0].split()
            current = computations.setdefault(header[-1].lstrip("%"), [])
            continue
        if current is None or " = " not in line or not line.startswith(" "):
            continue
        lhs, rhs = line.split(" = ", 1)
        words = lhs.split()
        match = _OP.search(rhs)
        if not match or not words:
            continue
        op = match.group(1)
        operands, end = _parse_operands(rhs, match.end())
        attrs = rhs[end:]
        index = None
        if op == "parameter" and operands and operands[0].isdigit():
            index = int(operands[0])
        found = re.search(r"index=(\d+)", attrs)
        if op == "get-tuple-element" and found:
            index = int(found.group(1))
        target = re.search(r'custom_call_target="([^"]*)"', attrs)
        op_name = re.search(r'op_name="([^"]*)"', attrs)
        calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", attrs)
        for group in re.findall(r"(?:calls|branch_computations)=\{([^}]*)\}", attrs):
            calls += [c.strip().lstrip("%") for c in group.split(",")]
        current.append(
            _Instr(
                name=words[-1].lstrip("%"),
                op=op,
                operands=operands if op != "parameter" else [],
                calls=calls,
                target=target.group(1) if target else None,
                op_name=op_name.group(1) if op_name else "",
                index=index,
                root=words[0] == "ROOT",
                bytes=_bytes(rhs[: match.start()]),
            )
        )
    return computations


def layout_ops(text: str, targets: str = ATTENTION_TARGETS, max_examples: int = 8) -> dict:
    """Transposes and copies of a compiled HLO module, and those next to the custom calls matching `targets`.

    Next to a call: an instruction producing one of its operands or consuming one of its results, through bitcasts,
    tuples and wrapped computations (command buffers, async wrappers). `standalone`: a transpose or copy, or a fusion
    that only moves data (its ops are transposes, copies, bitcasts, reshapes, converts, slices): an extra pass over
    the tensor, with its bytes. `in_fusion`: a fusion that computes and also lays its result out transposed (it
    holds a transpose or copy, or its source is a `transpose` in the program): no extra pass.
    """
    computations = parse_hlo(text)
    by_name = {(c, i.name): i for c, instrs in computations.items() for i in instrs}
    callers = collections.defaultdict(list)  # computation -> [(caller computation, caller instruction)]
    users = collections.defaultdict(list)  # (computation, name) -> [user instruction]
    for comp, instrs in computations.items():
        for instr in instrs:
            for called in instr.calls:
                callers[called].append((comp, instr))
            for operand in instr.operands:
                users[comp, operand].append(instr)

    memo: dict[str, bool] = {}

    def has_layout_op(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(
                i.op in _LAYOUT_OPS or any(has_layout_op(c) for c in i.calls) for i in computations.get(comp, [])
            )
        return memo[comp]

    def only_moves_data(comp: str) -> bool:
        ops = {i.op for i in computations.get(comp, [])}
        return bool(ops & set(_LAYOUT_OPS)) and ops <= {*_LAYOUT_OPS, *_DATA_MOVEMENT}

    def classify(instr: _Instr) -> str | None:
        if instr.op in _LAYOUT_OPS or (instr.op == "fusion" and instr.calls and all(map(only_moves_data, instr.calls))):
            return "standalone"
        if instr.op == "fusion" and (
            instr.op_name.endswith("/transpose") or any(has_layout_op(c) for c in instr.calls)
        ):
            return "in_fusion"
        return None

    def producers(comp: str, name: str, depth: int = 0) -> list[_Instr]:
        instr = by_name.get((comp, name))
        if instr is None or depth > 20:
            return []
        if instr.op == "parameter" and instr.index is not None:  # a wrapped computation (command buffer, async)
            found = []
            for caller_comp, caller in callers.get(comp, []):
                if caller.op != "fusion" and instr.index < len(caller.operands):
                    found += producers(caller_comp, caller.operands[instr.index], depth + 1)
            return found
        if instr.op in ("bitcast", "get-tuple-element", "copy-start", "copy-done") and instr.operands:
            return producers(comp, instr.operands[0], depth + 1)
        return [instr]

    def consumers(comp: str, name: str, index: int | None = None, depth: int = 0) -> list[_Instr]:
        found = []
        if depth > 20:
            return found
        for user in users.get((comp, name), []):
            if user.op == "get-tuple-element":
                if index is None or user.index == index:
                    found += consumers(comp, user.name, None, depth + 1)
            elif user.op in ("bitcast", "copy-start", "copy-done"):
                found += consumers(comp, user.name, index, depth + 1)
            elif user.op == "tuple" and user.root:  # leaves a wrapped computation: follow its callers' outputs
                position = user.operands.index(name)
                for caller_comp, caller in callers.get(comp, []):
                    if caller.op != "fusion":
                        found += consumers(caller_comp, caller.name, position, depth + 1)
            elif user.op == "tuple":
                found += consumers(comp, user.name, user.operands.index(name), depth + 1)
            else:
                found.append(user)
        return found

    counts = collections.Counter(i.op for instrs in computations.values() for i in instrs)
    calls = [(c, i) for c, instrs in computations.items() for i in instrs if i.target and re.search(targets, i.target)]
    side = {"feeding": collections.Counter(), "consuming": collections.Counter()}
    examples: dict[str, list[str]] = {"standalone": [], "in_fusion": []}
    seen = set()
    for comp, call in calls:
        neighbours = [("feeding", p) for operand in call.operands for p in producers(comp, operand)]
        neighbours += [("consuming", c) for c in consumers(comp, call.name)]
        for which, instr in neighbours:
            kind = classify(instr)
            if kind is None or (which, instr.name) in seen:
                continue
            seen.add((which, instr.name))
            side[which][kind] += 1
            if kind == "standalone":
                side[which]["standalone_bytes"] += instr.bytes
            arrow = f"{instr.op} -> {call.target}" if which == "feeding" else f"{call.target} -> {instr.op}"
            examples[kind].append(f"{arrow} {instr.name} ({instr.bytes / 2**20:.1f} MiB; {instr.op_name[-90:]})")
    in_attention = collections.Counter(
        i.op
        for instrs in computations.values()
        for i in instrs
        if i.op in _LAYOUT_OPS and re.search(r"attention|splash", i.op_name, re.I)
    )
    return {
        "transposes": counts["transpose"],
        "copies": counts["copy"],
        "attention_calls": len(calls),
        "attention_targets": sorted({call.target for _, call in calls}),
        **{which: {k: c[k] for k in ("standalone", "standalone_bytes", "in_fusion")} for which, c in side.items()},
        "examples": {kind: lines[:max_examples] for kind, lines in examples.items()},
        "traced_in_attention": {"transposes": in_attention["transpose"], "copies": in_attention["copy"]},
    }


# ----------------------------------------------------------------------------------------------------------------
# Profiling


def device_op_times(planes, hlo_text: str, steps: int, targets: str = ATTENTION_TARGETS) -> dict:
    """Per step, the device time of a profiler trace's XLA ops (`jax.profiler.ProfileData` planes of `steps` calls)
    and the attention kernels' part: the custom calls whose target matches `targets`, looked up by instruction name
    in the compiled HLO (`hlo_text`; a TPU trace names each op by its HLO line). A trace without a device "XLA Ops"
    line (the CPU's) gives `skipped`."""
    instructions = {i.name: i for comp in parse_hlo(hlo_text).values() for i in comp}
    total = attention = 0.0
    kernels: collections.Counter = collections.Counter()
    lines = 0
    for plane in planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            lines += 1
            for event in line.events:
                ms = event.duration_ns / 1e6 / steps
                total += ms
                name = event.name.split(" = ")[0].split()[-1].lstrip("%")
                instr = instructions.get(name)
                if instr is not None and instr.op == "custom-call" and re.search(targets, instr.target or ""):
                    attention += ms
                    kernels[re.sub(r"\.\d+$", "", name)] += ms
    if not lines:
        return {"skipped": "the trace has no device 'XLA Ops' line on this backend"}
    return {
        "device_ms": total,
        "attention_ms": attention,
        "attention_share": attention / total if total else None,
        "attention_kernels_ms": dict(kernels),
    }


def profile_device_time(run_step: Callable[[], None], hlo_text: str, steps: int = 2) -> dict:
    """`device_op_times` of `steps` calls of `run_step` under the JAX profiler (`jax.profiler.trace`)."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            for _ in range(steps):
                run_step()
        paths = sorted(pathlib.Path(directory).rglob("*.xplane.pb"))
        if not paths:
            return {"skipped": "the profiler wrote no trace"}
        data = jax.profiler.ProfileData.from_file(str(paths[0]))
        return device_op_times(data.planes, hlo_text, steps)


# Running


def _memory_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None


def _compiled_bytes(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
        return {
            "arguments": int(m.argument_size_in_bytes),
            "outputs": int(m.output_size_in_bytes),
            "aliased": int(m.alias_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes),
        }
    except Exception:  # noqa: BLE001
        return None


def time_attention_core(core: Callable, config: Config, segment_ids, loops: int, target_s: float = 0.05) -> dict:
    """The core alone on the model's shapes (bf16): fwd and fwd+bwd ms, as `bench_tpu.time_calls` times them."""
    m = config.model
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (config.batch, config.seq, m.num_heads, m.head_dim), m.dtype)
    k = jax.random.normal(keys[1], (config.batch, config.seq, m.num_kv_heads, m.head_dim), m.dtype)
    v = jax.random.normal(keys[2], k.shape, m.dtype)
    dout = jax.random.normal(keys[3], q.shape, m.dtype)
    s = None if segment_ids is None else jnp.asarray(segment_ids)
    fwd = jax.jit(lambda q, k, v: core(q, k, v, s))
    loss = lambda q, k, v: jnp.sum(core(q, k, v, s).astype(jnp.float32) * dout.astype(jnp.float32))
    fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    result = {}
    for kind, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            times = bench_tpu.time_calls(fn, (q, k, v), loops=loops, target_s=target_s)
            result[f"{kind}_ms"] = statistics.median(times) * 1e3
        except Exception as e:  # noqa: BLE001
            result[f"{kind}_error"] = bench_tpu._error(e)
    return result


def run_variant(
    framework: str,
    variant: str,
    config: Config,
    batch,
    *,
    warmup: int,
    steps: int,
    peak,
    smoke: bool = False,
    profile: bool = False,
) -> dict:
    result: dict = {}
    try:
        core_fn = attention_core(variant, config)
    except NotImplementedError as e:
        return {"skipped": str(e)}
    note = attention_mask_note(variant, config)
    if note:
        result["attention_mask"] = note
    tokens, segment_ids = batch
    try:
        params, loss_fn = build(framework, config, None if variant == "attnlib" else core_fn)
        optimizer = train.make_optimizer(LEARNING_RATE, warmup + steps)
        opt_state = optimizer.init(params)
        step = train.make_step(loss_fn, optimizer)
        args = (tokens, segment_ids)
        start = time.perf_counter()
        compiled = step.lower(params, opt_state, *args).compile()
        result["compile_s"] = time.perf_counter() - start
        result["compiled_bytes"] = _compiled_bytes(compiled)
        try:
            result["hlo"] = layout_ops(compiled.as_text())
        except Exception as e:  # noqa: BLE001
            result["hlo"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
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
        result["error"] = bench_tpu._error(e)
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
    stats = _memory_stats()
    result["peak_bytes_in_use"] = None if not stats else stats.get("peak_bytes_in_use")
    core = time_attention_core(core_fn, config, segment_ids, loops=2 if smoke else 5, target_s=0.005 if smoke else 0.05)
    if "fwd_ms" in core and "fwd_bwd_ms" in core:
        recomputed_forward = core["fwd_ms"] if config.model.remat is True else 0.0  # --remat full
        core["share_of_step"] = config.model.num_layers * (core["fwd_bwd_ms"] + recomputed_forward) / result["step_ms"]
    result["attention_core"] = core
    return result


def attnlib_pick(config: Config, segment_ids) -> str:
    """`attnlib.explain(...).implementation` for the model's attention call, traced as under `jit`."""
    m = config.model
    q = jax.ShapeDtypeStruct((config.batch, config.seq, m.num_heads, m.head_dim), m.dtype)
    kv = jax.ShapeDtypeStruct((config.batch, config.seq, m.num_kv_heads, m.head_dim), m.dtype)
    s = None if segment_ids is None else jax.ShapeDtypeStruct(segment_ids.shape, jnp.int32)
    picked = {}

    def probe(q, k, v, s):
        picked["pick"] = attnlib.explain(
            q, k, v, is_causal=True, local_window_size=_window(config), q_segment_ids=s
        ).implementation
        return q

    try:
        jax.eval_shape(probe, q, kv, kv, s)
        return str(picked["pick"])
    except Exception as e:  # noqa: BLE001
        return f"explain failed: {type(e).__name__}: {str(e)[:200]}"


def param_shapes(config: Config):
    """The model's parameters as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    import equinox as eqx

    return jax.eval_shape(lambda: eqx.filter(llama.Llama(config.model, key=jax.random.key(0)), eqx.is_inexact_array))


def run_config(
    name: str,
    config: Config,
    frameworks,
    variants,
    *,
    warmup: int,
    steps: int,
    smoke: bool = False,
    profile: bool = False,
    on_result: Callable[[dict], None] = lambda row: None,
) -> dict:
    """One config: every framework and variant; `on_result(row)` after each variant (the row so far)."""
    device = jax.devices()[0]
    if config.gpu_only and device.platform != "gpu":
        return {"skipped": f"GPU only (~1B parameters: too large for this {device.device_kind})"}
    batch = make_batch(config)
    flops = model_flops(config, param_shapes(config), batch[1])
    tflops = peak_tflops(device)
    peak = None if tflops is None else {"flops": flops["total"], "tflops": tflops}
    row = {
        "model": {
            k: (jnp.dtype(v).name if k.endswith("dtype") else v)
            for k, v in dataclasses.asdict(config.model).items()
            if k != "remat"  # the header's name
        },
        "batch": config.batch,
        "seq": config.seq,
        "documents_per_row": None if batch[1] is None else [int(r.max()) for r in batch[1]],
        "flops": flops,
        "attnlib_pick": attnlib_pick(config, batch[1]),
        "frameworks": {},
    }
    for framework in frameworks:
        out = row["frameworks"][framework] = {"variants": {}}
        for variant in variants:
            result = run_variant(
                framework, variant, config, batch, warmup=warmup, steps=steps, peak=peak, smoke=smoke, profile=profile
            )
            out["variants"][variant] = result
            print(f"{name} {framework} {variant}: {_summary(result)}", flush=True)
            on_result(row)
        base = out["variants"].get("attnlib", {})
        diffs = {}
        for variant, result in out["variants"].items():
            if "losses" in result and "losses" in base:
                result["max_loss_diff_vs_attnlib"] = diffs[variant] = max(
                    abs(a - b) for a, b in zip(result["losses"], base["losses"])
                )
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
    lines = [
        "| config | framework | variant | step ms | tokens/s | MFU | peak GiB | loss | Δloss vs attnlib | attention "
        "share | transposes / copies (standalone next to attention) |",
        "|---" * 11 + "|",
    ]
    for name, row in results.items():
        if "skipped" in row:
            lines.append(f"| {name} | | | skipped: {row['skipped']} |" + " |" * 7)
            continue
        for framework, out in row["frameworks"].items():
            for variant, r in out["variants"].items():
                if "step_ms" not in r:
                    reason = r.get("skipped") or r.get("error")
                    lines.append(f"| {name} | {framework} | {variant} | {reason} |" + " |" * 7)
                    continue
                peak = r.get("peak_bytes_in_use")
                share = r.get("attention_core", {}).get("share_of_step")
                hlo = r.get("hlo", {})
                near = hlo.get("feeding", {}).get("standalone", 0) + hlo.get("consuming", {}).get("standalone", 0)
                moved = hlo.get("feeding", {}).get("standalone_bytes", 0) + hlo.get("consuming", {}).get(
                    "standalone_bytes", 0
                )
                cells = [
                    f"{r['step_ms']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    "—" if r["mfu"] is None else f"{r['mfu']:.1%}",
                    "—" if peak is None else f"{peak / 2**30:.1f}",
                    f"{r['loss']:.4f}",
                    f"{r.get('max_loss_diff_vs_attnlib', float('nan')):.2g}",
                    "—" if share is None else f"{share:.0%}",
                    f"{hlo.get('transposes', '?')} / {hlo.get('copies', '?')} ({near}: {moved / 2**20:.0f} MiB)",
                ]
                lines.append(f"| {name} | {framework} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _versions() -> dict:
    out = {}
    for package in ("jax", "jaxlib", "attnlib", "equinox", "dm-haiku", "optax", "tokamax"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*", default=None, help="configs, run in that order")
    parser.add_argument("--framework", nargs="*", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--variants", nargs="*", default=None, help=f"a subset of {VARIANTS}")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on any backend: the script works")
    parser.add_argument(
        "--remat",
        choices=REMAT_CHOICES,
        default=DEFAULT_REMAT,
        help="per-block remat of every config (llama.LlamaConfig.remat: none, full, or a policy that keeps the "
        "attention kernels' results)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also trace 2 steps of each variant: device time and the attention kernels' share (TPU traces)",
    )
    args = parser.parse_args(argv)
    configs = {
        name: dataclasses.replace(c, model=dataclasses.replace(c.model, remat=REMAT_CHOICES[args.remat]))
        for name, c in (SMOKE_CONFIGS if args.smoke else CONFIGS).items()
    }
    unknown = set(args.only or ()) - set(configs)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; known: {list(configs)}")
    variants = tuple(args.variants or VARIANTS)
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; known: {list(VARIANTS)}")
    if "attnlib" not in variants:
        variants = ("attnlib",) + variants  # the reference of the loss differences
    warmup, steps = (1, 2) if args.smoke else (max(1, args.warmup), max(1, args.steps))
    device = jax.devices()[0]
    header = {
        "device": str(device),
        "device_kind": device.device_kind,
        "platform": device.platform,
        "versions": _versions(),
        "smoke": args.smoke,
        "warmup": warmup,
        "steps": steps,
        "learning_rate": LEARNING_RATE,
        "remat": args.remat,
        "peak_tflops": peak_tflops(device),
        "flops": FLOPS_CONVENTION,
    }
    print(json.dumps(header), flush=True)
    results = {}
    started = time.perf_counter()

    def save(name, row):
        results[name] = row
        if args.json:  # after every variant: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({**header, "configs": results}, f, indent=1)

    for name in args.only or configs:
        row = run_config(
            name,
            configs[name],
            args.framework,
            variants,
            warmup=warmup,
            steps=steps,
            smoke=args.smoke,
            profile=args.profile,
            on_result=lambda row, name=name: save(name, row),
        )
        save(name, row)
    print(table(results))
    print(f"total {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
