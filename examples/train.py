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
    python examples/train.py --tiny --mesh data=2,model=4   # 8 devices: data and tensor parallelism
    python examples/train.py --tiny --dtype float32         # float32 compute (default: bfloat16)

It prints the loss of every step, then the throughput.

`--mesh data=2,model=4` trains on 8 devices with JAX's explicit axes ("sharding in types": `llama.make_mesh`, a
`jax.make_mesh(..., axis_types=(AxisType.Explicit,) * 2)` over the first 8 devices, under `jax.set_mesh`): the batch
rows split over `data` (data parallelism), the heads and the MLP's hidden units over `model` (tensor parallelism,
Megatron-style: the query, key and value projections and the MLP's gate and up projections split by output features,
the output projections by input features; `llama.SPLIT_DIMS`), everything else replicated. Parameters and batches
are placed with `jax.device_put(..., NamedSharding)` (`llama.param_shardings`, `batch_sharding`); the jitted step is
the same function, its arrays typed with their shardings, and attention sees each device's rows and heads. Either
axis may be left out (`--mesh data=8`: pure data parallelism). Key/value heads that `model` does not divide (the
presets' 2 over 4 devices) are repeated so that each device holds its own query heads' (`llama.kv_heads_for`). With
`--dtype float32` the losses equal those without `--mesh` to float32 rounding (the output projections' sums over the
split heads and hidden units, and the batch's sums over `data`, run in another order: at most 4 units in the last
place, measured over 6 steps of `--tiny`); in bfloat16 compute each device's partial sum is rounded to bfloat16 before
they are added, and the losses differ by up to 2e-4 (relative; measured likewise). On a CPU, simulate the devices:
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import data
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from llama import LlamaConfig, make_mesh, param_shardings, parse_mesh  # examples/ is on sys.path as a script


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


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """`[B, T]` token rows split over `data` (data parallelism), whole along `T`; replicated without `data`."""
    return NamedSharding(mesh, P("data" if "data" in mesh.axis_names else None, None))


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
    mesh: jax.sharding.Mesh | None = None,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train from scratch; returns the loss of every step. With a `mesh` (explicit axes `data` and/or `model`:
    `llama.make_mesh`), everything runs under `jax.set_mesh(mesh)`, the parameters placed by `llama.param_shardings`
    and the batches by `batch_sharding`."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # explicit axes: types carry shardings
        tokens, segment_ids = data.pack(data.load_documents(corpus), seq_len)
        params, loss_fn = INIT[framework](config, jax.random.key(seed))
        rows = None
        where = f"device {jax.devices()[0].device_kind}"
        if mesh is not None:
            data_size = dict(mesh.shape).get("data", 1)
            if batch_size % data_size:
                raise ValueError(
                    f"`--batch-size` must be a multiple of the mesh's `data` size {data_size}. Got {batch_size}."
                )
            params = jax.device_put(params, param_shardings(params, mesh))
            rows = batch_sharding(mesh)
            axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items())
            where = f"mesh {axes} of {mesh.devices.size} {mesh.devices.flat[0].device_kind} devices, explicit axes"
        optimizer = make_optimizer(learning_rate, steps)
        opt_state = optimizer.init(params)  # the moments take the parameters' shardings
        step = make_step(loss_fn, optimizer)
        count = sum(x.size for x in jax.tree.leaves(params))
        log(
            f"{framework}: {count / 1e6:.2f}M parameters ({config.num_layers} layers, width {config.dim}, "
            f"{config.num_heads}/{config.num_kv_heads} heads of {config.head_dim}), {jnp.dtype(config.dtype).name} "
            f"compute; {len(tokens)} packed rows of {seq_len} bytes ({np.mean(segment_ids.max(axis=1)):.1f} "
            f"documents a row, {np.mean(segment_ids > 0):.0%} filled); {where}"
        )
        losses = []
        timed_tokens, timed_seconds = 0, 0.0
        for i, (tokens_b, segment_ids_b) in zip(range(steps), data.batches(tokens, segment_ids, batch_size, seed)):
            start = time.perf_counter()
            batch = (tokens_b, segment_ids_b) if rows is None else jax.device_put((tokens_b, segment_ids_b), rows)
            params, opt_state, loss = step(params, opt_state, *batch)
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
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None, help="compute dtype (default bfloat16)"
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help="train on a device mesh with explicit axes, e.g. data=2,model=4: the batch over data, heads over model",
    )
    args = parser.parse_args(argv)
    config, batch_size, seq_len, steps, lr = PRESETS["tiny" if args.tiny else "small"]
    if args.dtype is not None:
        config = dataclasses.replace(config, dtype=jnp.dtype(args.dtype))
    return train(
        args.framework,
        config,
        steps=args.steps or steps,
        batch_size=args.batch_size or batch_size,
        seq_len=args.seq_len or seq_len,
        learning_rate=args.lr or lr,
        corpus=args.corpus,
        seed=args.seed,
        mesh=None if args.mesh is None else make_mesh(parse_mesh(args.mesh)),
    )


if __name__ == "__main__":
    main()
