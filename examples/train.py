"""Train the Llama-shaped model of `llama.py` (Equinox) or `llama_haiku.py` (Haiku) on packed documents.

Plain optax: AdamW on float32 parameters (the master weights) with bfloat16 compute inside the model, gradient
clipping, warm-up then cosine decay; weight decay on the matrices only. The data are bytes of the repository's own
`docs/*.md` (`data.py`: read at run time, no download), packed into rows with segment ids, so each document attends
only to itself and its rotary positions restart at 0. Both frameworks share one training step: a pure function of
`(params, opt_state, tokens, segment_ids)`; only the model (its parameters and its loss) differs.

    python examples/train.py --tiny                         # seconds on a CPU: a tiny model, a few steps
    python examples/train.py --framework haiku --tiny
    python examples/train.py                                # ~3M parameters, 200 steps: a few minutes on a CPU
    python examples/train.py --corpus my_texts/ --seq-len 1024 --batch-size 16

It prints the loss of every step, then the throughput.
"""

import argparse
import time
from collections.abc import Callable
from typing import Any

import data
import jax
import jax.numpy as jnp
import numpy as np
import optax
from llama import LlamaConfig  # examples/ is on sys.path when this file runs as a script


PRESETS = {
    # model, batch size, sequence length, steps, peak learning rate
    "tiny": (LlamaConfig(vocab_size=data.VOCAB_SIZE, remat="save_attention"), 4, 128, 20, 3e-3),
    "small": (
        LlamaConfig(
            vocab_size=data.VOCAB_SIZE,
            dim=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=32,
            hidden_dim=688,
            remat="save_attention",
        ),
        8,
        256,
        200,
        1e-3,
    ),
}


LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


def init_equinox(config: LlamaConfig, key: jax.Array) -> tuple[Any, LossFn]:
    """`(params, loss_fn)` of the Equinox model: its arrays (`eqx.partition`), and `loss_fn(params, tokens,
    segment_ids)` that puts the model back together and calls `llama.loss`."""
    import equinox as eqx
    import llama

    params, static = eqx.partition(llama.Llama(config, key=key), eqx.is_inexact_array)

    def loss_fn(params, tokens, segment_ids):
        return llama.loss(eqx.combine(params, static), tokens, segment_ids)

    return params, loss_fn


def init_haiku(config: LlamaConfig, key: jax.Array) -> tuple[Any, LossFn]:
    """`(params, loss_fn)` of the Haiku model (`llama_haiku.transform`)."""
    import llama_haiku

    model = llama_haiku.transform(config)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.jit(model.init)(key, tokens, jnp.ones((1, 8), jnp.int32))  # jitted: one compile, not op by op

    def loss_fn(params, tokens, segment_ids):
        return llama_haiku.loss(params, tokens, segment_ids, model=model)

    return params, loss_fn


INIT = {"equinox": init_equinox, "haiku": init_haiku}


def make_optimizer(learning_rate: float, steps: int, weight_decay: float = 0.1) -> optax.GradientTransformation:
    """AdamW (b2 0.95) after clipping the global gradient norm to 1; linear warm-up over the first tenth of the steps
    (at most 100), then cosine decay to a tenth; weight decay on arrays of rank >= 2 (not on the RMSNorm weights)."""
    warmup = min(100, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1), end_value=learning_rate / 10
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def make_step(loss_fn: LossFn, optimizer: optax.GradientTransformation):
    """The jitted training step `(params, opt_state, tokens, segment_ids) -> (params, opt_state, loss)`; the old
    parameters and optimizer state are donated (updated in place)."""

    def step(params, opt_state, tokens, segment_ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, segment_ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def train(
    framework: str,
    config: LlamaConfig,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    learning_rate: float,
    corpus: list[str] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train from scratch; returns the loss of every step."""
    tokens, segment_ids = data.pack(data.load_documents(corpus), seq_len)
    params, loss_fn = INIT[framework](config, jax.random.key(seed))
    optimizer = make_optimizer(learning_rate, steps)
    opt_state = optimizer.init(params)
    step = make_step(loss_fn, optimizer)
    count = sum(x.size for x in jax.tree.leaves(params))
    log(
        f"{framework}: {count / 1e6:.2f}M parameters ({config.num_layers} layers, width {config.dim}, "
        f"{config.num_heads}/{config.num_kv_heads} heads of {config.head_dim}), {jnp.dtype(config.dtype).name} "
        f"compute; {len(tokens)} packed rows of {seq_len} bytes ({np.mean(segment_ids.max(axis=1)):.1f} documents a "
        f"row, {np.mean(segment_ids > 0):.0%} filled); device {jax.devices()[0].device_kind}"
    )
    losses = []
    timed_tokens, timed_seconds = 0, 0.0
    for i, (tokens_b, segment_ids_b) in zip(range(steps), data.batches(tokens, segment_ids, batch_size, seed)):
        start = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens_b, segment_ids_b)
        losses.append(float(loss))  # waits for the step
        elapsed = time.perf_counter() - start
        if i > 0:  # the first step compiles
            timed_tokens += int(np.sum(segment_ids_b > 0))
            timed_seconds += elapsed
        log(f"step {i:4d}  loss {losses[-1]:.4f}  {elapsed * 1e3:7.1f} ms")
    if timed_seconds:
        log(f"{timed_tokens / timed_seconds:,.0f} tokens/s (non-padding tokens, first step left out)")
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(INIT), default="equinox")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and a few steps: seconds on a CPU")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--corpus", nargs="*", default=None, help="text files or folders (default: docs/)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config, batch_size, seq_len, steps, lr = PRESETS["tiny" if args.tiny else "small"]
    return train(
        args.framework,
        config,
        steps=args.steps or steps,
        batch_size=args.batch_size or batch_size,
        seq_len=args.seq_len or seq_len,
        learning_rate=args.lr or lr,
        corpus=args.corpus,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
