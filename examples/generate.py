"""Generation with continuous batching over paged KV caches (`attnlib.PagedKVCache`), for the model of `llama.py`.

A fixed number of slots `B` each hold one sequence. Every step is ONE jitted call on a ragged (THD) batch: the
prefill chunks of newly admitted prompts and the single decode tokens of running sequences, concatenated, with
`cu_seqlens` marking each slot's tokens (a slot with nothing to do has an empty range). Each layer appends the new
keys and values to its cache, attends, and the step samples each slot's next token from its last token's logits.
A sequence ends at `eos_id` or after `max_new_tokens`; its slot's pages go back to the pool (released at the start
of the next step, inside the same jitted call) and the next waiting prompt takes the slot.

The flat token count is padded to a power-of-two bucket (padding rows lie past `cu_seqlens[-1]`, which the cache and
the attention ignore), and so is the longest sequence's token count (`max_seqlen_q`: 1 on a step of decodes
only; cuDNN lays queries out as `[B, max_seqlen_q]` rows), so the step compiles once per pair of buckets, a handful
of times in all.

Pages: a prompt is admitted once its slot is free and the pool has the pages for its longest possible sequence
(prompt + `max_new_tokens`), which are reserved until it ends. Simple, and never out of pages mid-sequence; a
server that over-commits the pool would preempt instead.

    python examples/generate.py --tiny                 # a tiny random model, seconds on a CPU
    python examples/generate.py --size bench           # a 0.43B Llama-shaped model with random weights
    python examples/generate.py --tiny --mesh model=2  # tensor parallel: heads and cache pools over 2 devices

`--mesh model=N` serves on N devices with JAX's explicit axes (`llama.make_mesh`, under `jax.set_mesh`): the model's
heads and MLP hidden units split over `model` (`llama.param_shardings`) and each layer's cache pools along their
key/value heads (`cache_sharding`), the page table, lengths and free list replicated (every device reads its heads'
pages through the same table). `N` must divide the key/value heads. The steps are the same jitted function; each
device runs the paged attention of its heads, and the output projections' sums over heads are the only communication.
On a CPU, simulate the devices: `XLA_FLAGS=--xla_force_host_platform_device_count=2`.
"""

import argparse
import collections
import contextlib
import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from llama import Llama, LlamaConfig, make_mesh, num_params, param_shardings, parse_mesh  # examples/ is on sys.path


PRESETS = {
    "tiny": LlamaConfig(),
    "bench": LlamaConfig(
        vocab_size=32_000,
        dim=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        hidden_dim=4096,
        rope_theta=500_000.0,
    ),
}


@dataclasses.dataclass
class Stats:
    """What one `generate` call did.

    Attributes:
        steps: jitted steps run.
        prefill_tokens: prompt tokens fed.
        generated_tokens: tokens sampled.
        decode_steps, decode_tokens, decode_seconds: the steps without prompt tokens (pure decoding), the tokens they
            sampled, and their time. Timings leave out the first step of each bucket (it compiles the step).
        timed_tokens, timed_seconds: the tokens sampled by all steps, and their time (prefill included; the first
            step of each bucket left out).
        seconds: wall time of the whole call, compilation included.
        buckets: the `(padded token count, bound of one sequence's tokens)` pairs used (each compiles the step
            once).
        peak_pages: most pages reserved at once.
        num_pages: pages in each layer's pool.
        layout: the caches' pool layout.
    """

    steps: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    timed_tokens: int = 0
    timed_seconds: float = 0.0
    seconds: float = 0.0
    buckets: tuple[tuple[int, int], ...] = ()
    peak_pages: int = 0
    num_pages: int = 0
    layout: str = ""

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over all steps but each bucket's first, prefill included."""
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else float("nan")


@eqx.filter_jit(donate="all-except-first")  # the caches (the second argument) are updated in place
def _step(inputs, caches):
    """One serving step: release finished slots, run the ragged batch through every layer (appending to its cache and
    attending), sample each slot's next token. Returns `(caches, next_tokens [B], lengths [B], logits [B, V])`."""
    model, tokens, positions, cu_seqlens, longest, release, key, step, temperature = inputs
    caches = [cache.release(release) for cache in caches]  # finished sequences' pages go back to the pool first
    hidden, caches = model.paged_forward(tokens, positions, caches, cu_seqlens, max_seqlen_q=longest)
    last = jnp.maximum(cu_seqlens[1:] - 1, 0)  # each slot's last new token (meaningless for an empty slot)
    logits = model.logits(hidden[last])  # [B, V]
    if temperature == 0.0:
        next_tokens = jnp.argmax(logits, axis=-1)
    else:
        next_tokens = jax.random.categorical(jax.random.fold_in(key, step), logits / temperature, axis=-1)
    return caches, next_tokens.astype(jnp.int32), caches[0].lengths, logits


@dataclasses.dataclass
class _Sequence:
    index: int  # which prompt
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    pages: int  # reserved
    cached: int = 0  # tokens in the cache


def cache_sharding(x: jax.Array, layout: str, mesh: jax.sharding.Mesh) -> NamedSharding:
    """Where one array of a `PagedKVCache` lives on `mesh`: a pool (the 4-d arrays) split over `model` along its
    key/value heads (axis 0 `[K, P, page_size, H']` head-major, axis 2 `[P, page_size, K, H]` token-major or
    `[P, page_size, 2K, D']` combined), everything else (page table, lengths, free list) replicated: every device reads
    its heads' pages through the same table."""
    spec = [None] * x.ndim
    if x.ndim == 4:
        spec[0 if layout == "head_major" else 2] = "model"
    return NamedSharding(mesh, P(*spec))


def shard_for_serving(model: Llama, caches: list, mesh: jax.sharding.Mesh) -> tuple[Llama, list]:
    """`model` and `caches` placed on `mesh` (its only axis `model`) for tensor-parallel serving: the model's heads and
    hidden units split over `model` (`llama.param_shardings`; the key/value heads must be a multiple of the axis's
    size, since the pools split along them) and each cache's pools split by key/value heads (`cache_sharding`)."""
    params, static = eqx.partition(model, eqx.is_array)
    params = jax.device_put(params, param_shardings(params, mesh, replicate_kv=False))
    caches = [
        jax.tree.map(lambda x, layout=cache.layout: jax.device_put(x, cache_sharding(x, layout, mesh)), cache)
        for cache in caches
    ]
    return eqx.combine(params, static), caches


def _bucket(n: int, smallest: int, largest: int) -> int:
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


def generate(
    model: Llama,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    max_batch: int = 8,
    page_size: int = 16,
    num_pages: int | None = None,
    max_tokens_per_step: int = 256,
    eos_id: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    layout=None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[list[list[int]], Stats]:
    """Generate continuations of `prompts` with continuous batching.

    Args:
        model: the `llama.Llama` to run (its `config.dtype` is the caches' dtype).
        prompts: token lists, each non-empty.
        max_new_tokens: most tokens generated per prompt.
        max_batch: slots `B`: sequences in flight at once.
        page_size: tokens per cache page.
        num_pages: pages in each layer's pool. Defaults to enough for `max_batch` of the longest sequences.
        max_tokens_per_step: most tokens in one step (the largest bucket); at least `max_batch`. Longer prompts
            are prefilled in chunks over several steps.
        eos_id: a sequence ends after sampling it (it is included in the output). Defaults to None.
        temperature: 0 samples greedily; else from `softmax(logits / temperature)`.
        seed: sampling seed.
        layout: the caches' pool layout. Defaults to None (the device's best).
        mesh: serve with tensor parallelism on this mesh of explicit axes (one axis, `model`: `llama.make_mesh`):
            the model and the caches' pools split by heads (`shard_for_serving`), every step run under
            `jax.set_mesh(mesh)`. Defaults to None (one device).

    Returns:
        `(outputs, stats)`: the generated tokens of each prompt, in order, and a `Stats`.
    """
    if mesh is not None and set(mesh.axis_names) != {"model"}:
        raise ValueError(f"`mesh` must have one axis, `model` (the heads split; serving splits no batch). Got {mesh}.")
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # explicit axes: types carry shardings
        start = time.perf_counter()
        prompts = [[int(t) for t in p] for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("Every prompt needs at least one token. Got an empty prompt.")
        if max_new_tokens < 1 or max_tokens_per_step < max_batch:
            raise ValueError(
                f"`max_new_tokens` must be >= 1 and `max_tokens_per_step` >= `max_batch`. Got {max_new_tokens}, "
                f"{max_tokens_per_step} and {max_batch}."
            )
        pages_for = lambda n: -(-n // page_size)
        # The last sampled token is never fed back, so a sequence caches at most prompt + max_new_tokens - 1 tokens.
        reserve = [pages_for(len(p) + max_new_tokens - 1) for p in prompts]
        max_pages_per_seq = max(reserve, default=1)
        num_pages = max_batch * max_pages_per_seq if num_pages is None else num_pages
        if max_pages_per_seq > num_pages:
            raise ValueError(
                f"`num_pages` must hold the longest sequence ({max_pages_per_seq} pages of {page_size} tokens). "
                f"Got num_pages={num_pages}."
            )
        caches = model.make_caches(max_batch, num_pages, page_size, max_pages_per_seq, layout)
        if mesh is not None:
            model, caches = shard_for_serving(model, caches, mesh)
        stats = Stats(num_pages=num_pages, layout=str(caches[0].layout))
        smallest_bucket = _bucket(max_batch, 8, 1 << 30)
        key = jax.random.key(seed)

        waiting = collections.deque(range(len(prompts)))
        slots: list[_Sequence | None] = [None] * max_batch
        release = np.zeros(max_batch, bool)
        free_pages = num_pages
        outputs: list[list[int]] = [[] for _ in prompts]
        while waiting or any(s is not None for s in slots):
            # Admit waiting prompts, in order, into free slots while the pool has their pages.
            for b in range(max_batch):
                if slots[b] is None and waiting and reserve[waiting[0]] <= free_pages:
                    i = waiting.popleft()
                    slots[b] = _Sequence(i, list(prompts[i]), len(prompts[i]), reserve[i])
                    free_pages -= reserve[i]
            stats.peak_pages = max(stats.peak_pages, num_pages - free_pages)

            # Schedule: one token for every sequence first (a decode token, or the start of a prompt), then the rest of
            # the budget to prompts still prefilling, in slot order.
            counts = np.array([0 if s is None else min(1, len(s.tokens) - s.cached) for s in slots])
            budget = max_tokens_per_step - int(counts.sum())
            for b, s in enumerate(slots):
                if s is not None and budget > 0:
                    extra = min(budget, len(s.tokens) - s.cached - counts[b])
                    counts[b] += extra
                    budget -= extra
            cu_seqlens = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            bucket = _bucket(int(cu_seqlens[-1]), smallest_bucket, max_tokens_per_step)
            tokens = np.zeros(bucket, np.int32)  # padding rows past cu_seqlens[-1]
            positions = np.zeros(bucket, np.int32)
            prefill = 0
            for b, s in enumerate(slots):
                if s is not None and counts[b]:
                    lo, hi = cu_seqlens[b], cu_seqlens[b + 1]
                    tokens[lo:hi] = s.tokens[s.cached : s.cached + counts[b]]
                    positions[lo:hi] = np.arange(s.cached, s.cached + counts[b])
                    prefill += max(0, min(s.prompt_len, s.cached + counts[b]) - s.cached)

            longest = _bucket(int(counts.max()), 1, bucket)  # static: 1 on a step of decodes only
            compiles = (bucket, longest) not in stats.buckets
            tick = time.perf_counter()
            inputs = (model, tokens, positions, cu_seqlens, longest, release, key, np.int32(stats.steps), temperature)
            caches, next_tokens, lengths, _ = _step(inputs, caches)
            next_tokens, lengths = np.asarray(next_tokens), np.asarray(lengths)
            elapsed = time.perf_counter() - tick
            stats.steps += 1
            stats.buckets = tuple(sorted({*stats.buckets, (bucket, longest)}))
            stats.prefill_tokens += prefill
            release = np.zeros(max_batch, bool)

            sampled = 0
            for b, s in enumerate(slots):
                if s is None or not counts[b]:
                    continue
                s.cached += int(counts[b])
                if lengths[b] != s.cached:
                    raise RuntimeError(
                        f"The cache of slot {b} holds {lengths[b]} tokens, expected {s.cached}: out of pages? "
                        f"(num_pages={num_pages}, page_size={page_size})"
                    )
                if s.cached < len(s.tokens):
                    continue  # mid-prompt: this chunk's last logits predict a token we already have
                token = int(next_tokens[b])
                s.tokens.append(token)
                sampled += 1
                if token == eos_id or len(s.tokens) - s.prompt_len == max_new_tokens:
                    outputs[s.index] = s.tokens[s.prompt_len :]
                    release[b] = True
                    free_pages += s.pages
                    slots[b] = None
            stats.generated_tokens += sampled
            if not compiles:
                stats.timed_tokens += sampled
                stats.timed_seconds += elapsed
            if prefill == 0 and not compiles:
                stats.decode_steps += 1
                stats.decode_tokens += sampled
                stats.decode_seconds += elapsed
    stats.seconds = time.perf_counter() - start
    return outputs, stats


def main(argv: list[str] | None = None) -> Stats:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(PRESETS), default="bench", help="model preset (random weights)")
    parser.add_argument("--tiny", action="store_true", help="same as --size tiny: runs in seconds on a CPU")
    parser.add_argument("--num-prompts", type=int, default=None, help="defaults to 4 x --max-batch")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--max-batch", type=int, default=None, help="slots")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-tokens-per-step", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mesh", default=None, help="serve on a device mesh with explicit axes, model=N: heads and pools split N ways"
    )
    args = parser.parse_args(argv)
    mesh = None if args.mesh is None else make_mesh(parse_mesh(args.mesh))
    size = "tiny" if args.tiny else args.size
    tiny = size == "tiny"
    config = PRESETS[size]
    max_batch = args.max_batch or (4 if tiny else 32)
    num_prompts = args.num_prompts or 4 * max_batch
    lo, hi = args.prompt_len or ((3, 24) if tiny else (32, 512))
    max_new_tokens = args.max_new_tokens or (16 if tiny else 128)
    max_tokens_per_step = args.max_tokens_per_step or (32 if tiny else 1024)

    model = Llama(config, key=jax.random.key(args.seed))
    rng = np.random.default_rng(args.seed)
    prompts = [list(rng.integers(0, config.vocab_size, rng.integers(lo, hi + 1))) for _ in range(num_prompts)]
    c = config
    print(
        f"model {size}: {num_params(model) / 1e6:.1f}M parameters ({c.num_layers} layers, width {c.dim}, "
        f"{c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, vocabulary {c.vocab_size}, "
        f"{jnp.dtype(c.dtype).name} compute)"
    )
    where = f"device {jax.devices()[0].device_kind}"
    if mesh is not None:
        where = f"mesh model={mesh.shape['model']} of {mesh.devices.size} {mesh.devices.flat[0].device_kind} devices"
    print(f"{where}; {num_prompts} prompts of {lo}-{hi} tokens, {max_new_tokens} new each")
    outputs, stats = generate(
        model,
        prompts,
        max_new_tokens,
        max_batch=max_batch,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_tokens_per_step=max_tokens_per_step,
        temperature=args.temperature,
        seed=args.seed,
        mesh=mesh,
    )
    print(
        f"cache layout: {stats.layout}; {stats.num_pages} pages of {args.page_size}, peak {stats.peak_pages} reserved"
    )
    print(
        f"{stats.steps} steps (buckets {list(stats.buckets)}), {stats.prefill_tokens} prompt tokens, "
        f"{stats.generated_tokens} generated in {stats.seconds:.2f} s (compilation included)"
    )
    print(
        f"decode: {stats.decode_tokens_per_s:.1f} tokens/s ({stats.decode_tokens} tokens over {stats.decode_steps} "
        f"pure-decode steps, {max_batch} slots); all steps: {stats.tokens_per_s:.1f} generated tokens/s "
        "(prefill included, compiling steps excluded)"
    )
    print("first output:", outputs[0])
    return stats


if __name__ == "__main__":
    main()
