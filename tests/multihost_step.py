"""A sharded SGD training step of the example Llama (`examples/llama.py`) on a global mesh `data=2, model=4`: run by
one process with 8 CPU devices, or by two processes with 4 each (`jax.distributed` on 127.0.0.1, CPU collectives).

Not collected by a plain `pytest` run (not named `test_*.py`): `tests/test_multihost.py` starts it as one process of 8
devices (plain, and under `jax.distributed` with one process) and as two processes of 4, and compares what they
write. Run it by hand with:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/multihost_step.py --out /tmp/one.npz
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multihost_step.py --out /tmp/p0.npz \
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 0 &
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/multihost_step.py --out /tmp/p1.npz \
        --coordinator 127.0.0.1:12355 --num-processes 2 --process-id 1

The model is tiny (2 layers, 8 query / 4 key-value heads of 8, float32 compute), its attention `attnlib.attention`
with `implementation=None` (on a CPU: `xla_chunked`), causal GQA with a sliding window over packed documents
(segment ids). Batch over `data`, heads over `model` (Megatron-style: the query, key and value projections and the
MLP's up projections split by output features, the output projections by input features). Every process builds the
same parameters from one seed and places them with `jax.make_array_from_callback`; the batch is fed with
`jax.make_array_from_process_local_data`, each process passing only the rows its devices hold. After `--steps` SGD
steps every process gathers the parameters (`multihost_utils.process_allgather`) and writes the losses and the
parameters to `--out` (`np.savez`), and prints one summary line.

The mesh is the classic one (`jax.sharding.Mesh`, automatic axes; JAX 0.10.2's `jax.make_mesh` makes explicit axes by
default): `data` spans the processes, `model` the devices of one process, so the batch rows of a process are
contiguous and the heads' collectives stay within a process.
"""

import argparse
import pathlib
import sys


ROOT = pathlib.Path(__file__).resolve().parent.parent
MESH_SHAPE = (2, 4)  # data, model
STEPS = 3
BATCH = 4  # rows: 2 per data shard
SEQ_LEN = 32
LEARNING_RATE = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the losses and the parameters (.npz)")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (two-process mode)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--perturb",
        action="store_true",
        help="this process feeds one token of its rows changed (a host with other data: the results must differ)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import jax

    if args.coordinator is not None:
        # Before anything touches a backend: the CPU client is made with the distributed runtime's global topology.
        jax.distributed.initialize(
            args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
            coordinator_bind_address=args.coordinator, initialization_timeout=120,
        )  # fmt: skip
    run(args)
    if args.coordinator is not None:
        jax.distributed.shutdown()


def run(args: argparse.Namespace) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    sys.path.insert(0, str(ROOT / "examples"))
    import data
    import llama

    if jax.device_count() != MESH_SHAPE[0] * MESH_SHAPE[1] or jax.process_count() != args.num_processes:
        raise RuntimeError(
            f"tests/multihost_step.py needs 8 devices in all, got {jax.device_count()} over {jax.process_count()} "
            "process(es): set XLA_FLAGS=--xla_force_host_platform_device_count=8 (one process) or =4 (two)."
        )
    # Global devices in process order (process 0's, then process 1's): `data` spans the processes.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.asarray(devices).reshape(MESH_SHAPE), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    config = llama.LlamaConfig(
        vocab_size=data.VOCAB_SIZE, dim=32, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, hidden_dim=64,
        dtype=jnp.float32, sliding_window=5, implementation=None,
    )  # fmt: skip
    model = llama.Llama(config, key=jax.random.key(0))  # the same on every process: one seed, computed locally
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def param_spec(path, p) -> P:
        name = jax.tree_util.keystr(path)
        if name.endswith((".wq", ".wk", ".wv")):
            return P(None, "model", None)  # [D, N or K, H]: heads over `model`
        if name.endswith(".wo"):
            return P("model", None, None)  # [N, H, D]
        if name.endswith((".w_gate", ".w_up")):
            return P(None, "model")  # [D, F]
        if name.endswith(".w_down"):
            return P("model", None)  # [F, D]
        return P()  # embeddings, head, norms: replicated

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), jax.tree_util.tree_map_with_path(param_spec, params))
    host_params = jax.tree.map(np.asarray, params)
    params = jax.tree.map(
        lambda p, s: jax.make_array_from_callback(p.shape, s, lambda index: p[index]), host_params, shardings
    )

    # The global batches: packed generated documents, the same on every process; each feeds its own rows only.
    documents = [d.encode() for d in data.generated_documents(40, seed=0)]
    tokens, segment_ids = data.pack(documents, SEQ_LEN)
    assert len(tokens) >= args.steps * BATCH, len(tokens)
    batch_sharding = NamedSharding(mesh, P("data", None))
    held = batch_sharding.addressable_devices_indices_map((BATCH, SEQ_LEN)).values()
    local_rows = np.unique(np.concatenate([np.arange(BATCH)[index[0]] for index in held]))  # this process's rows

    def local_batch(step: int) -> tuple[jax.Array, jax.Array]:
        rows = slice(step * BATCH, (step + 1) * BATCH)
        tok, seg = tokens[rows][local_rows].copy(), segment_ids[rows][local_rows]
        if args.perturb and step == 0:
            tok[0, 3] = (tok[0, 3] + 1) % data.VOCAB_SIZE
        put = lambda x: jax.make_array_from_process_local_data(batch_sharding, x, (BATCH, SEQ_LEN))  # noqa: E731
        return put(tok), put(seg)

    def loss_fn(params, tok, seg):
        return llama.loss(eqx.combine(params, static), tok, seg)

    @jax.jit
    def step(params, tok, seg):
        loss, grads = jax.value_and_grad(loss_fn)(params, tok, seg)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss

    losses = []
    for i in range(args.steps):
        params, loss = step(params, *local_batch(i))
        losses.append(loss)
    for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)):
        assert p.sharding.is_equivalent_to(s, p.ndim), (p.sharding, s)  # the step kept the layout

    gathered = multihost_utils.process_allgather(params, tiled=True)  # global NumPy arrays on every process
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(gathered)]
    arrays = dict(zip(names, jax.tree.leaves(gathered)))
    losses = np.asarray(multihost_utils.process_allgather(jnp.stack(losses), tiled=True))
    np.savez(args.out, losses=losses, **{f"param{name}": a for name, a in arrays.items()})
    checksum = sum(float(np.sum(a.astype(np.float64))) for a in arrays.values())
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {args.steps} steps, losses "
        f"{' '.join(f'{x:.9g}' for x in losses)}, parameter sum {checksum:.17g}",
        flush=True,
    )


if __name__ == "__main__":
    main()
