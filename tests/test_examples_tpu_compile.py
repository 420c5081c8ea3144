"""The examples' training and serving steps on a mesh with explicit axes, compiled ahead of time for a deviceless
`v5e:2x4` slice (libtpu, no TPU attached; nothing runs).

Training: the step of `examples/train.py --mesh data=2,model=4` (`train.make_step` of the Equinox model, AdamW, the
parameters placed by `llama.param_shardings`, the batch by `train.batch_sharding`; the `"small"` preset with 2 of its
4 layers) on a mesh of the slice's 8 chips with explicit axes under `jax.set_mesh`, its inputs abstract
(`jax.ShapeDtypeStruct(..., sharding=NamedSharding)`). `attnlib`'s automatic implementation picks `pallas_tpu` there
for rows of 1024 tokens (it leaves sequences of at most 512 tokens to `xla_chunked` on a v5e, so the rows are longer
than `train.py`'s default 256). The compiled program holds splash's Mosaic kernels (forward, dK/dV and dQ of each
layer) on each chip's batch rows and heads, and gathers no activation:

- the preset's 8 query and 2 key/value heads over `model=4`: each chip holds a copy of its query heads' key/value
  projections (`llama.kv_heads_for`), and the only arrays gathered are those copies' gradients, f32 `[D, 4, H]`
  (parameter gradients, gathered to be summed, as FSDP gathers parameters);
- the same model with 4 key/value heads (one a chip): no all-gather at all (pure data and tensor parallelism).

Serving: one step of `examples/generate.py --mesh model=4` (`generate._step`: release, a ragged batch through every
layer, sampling; the `"bench"` preset with 2 of its 24 layers: 16 query and 4 key/value heads of 64) on 4 chips of the
slice, the model's heads and the `"combined"` caches' pools split over `model` (`generate.shard_for_serving`): one
ragged paged-attention Mosaic kernel per layer on each chip's 4 query heads, the pools still split on the way out, no
all-gather.
"""

import dataclasses
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_a_simulated_tpu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


pytestmark = pytest.mark.tpu_compile  # skipped without libtpu and on a TPU machine (conftest.py)

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import generate  # noqa: E402
import llama  # noqa: E402
import train  # noqa: E402


MOSAIC = "tpu_custom_call"
SEQ_LEN = 1024


@pytest.fixture(scope="module")
def slice_devices() -> np.ndarray:
    """The 8 chips of a deviceless `v5e:2x4` slice."""
    from jax.experimental import topologies

    with pytest.MonkeyPatch.context() as env:
        env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is used: pytest-xdist workers may share libtpu
        return np.asarray(topologies.get_topology_desc("v5e:2x4", "tpu").devices)


@pytest.fixture(autouse=True)
def compile_for_a_tpu(monkeypatch):
    on_a_simulated_tpu(monkeypatch)


def _abstract(x, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _all_gathers(text: str) -> list[str]:
    """The result type of each all-gather in compiled HLO text."""
    gathers = [line for line in text.splitlines() if re.search(r"\ball-gather(?:-start)?\(", line)]
    return [line.split("=")[1].split()[0] for line in gathers]


def _mosaic_results(text: str) -> list[tuple[str, list[tuple[int, ...]]]]:
    """`(kernel name, the shapes of its 3-d and 4-d results)` of each Mosaic kernel call in compiled HLO text."""
    calls = []
    for line in text.splitlines():
        if MOSAIC in line and "custom-call(" in line:
            name, result = line.split("=", 1)
            result = result.split("custom-call(")[0]
            shapes = [tuple(map(int, s.split(","))) for s in re.findall(r"\w+\[(\d+(?:,\d+){2,3})\]", result)]
            calls.append((name.strip(), shapes))
    return calls


def _compile_training_step(devices: np.ndarray, config: llama.LlamaConfig, batch: int) -> str:
    """The compiled text of `train.py`'s step on a `data=2, model=4` mesh of `devices` with explicit axes."""
    mesh = jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    params, loss_fn = train.init_equinox(config, jax.random.key(0))  # a small model: made on this host's CPU
    params = jax.tree.map(_abstract, params, llama.param_shardings(params, mesh))
    optimizer = train.make_optimizer(1e-3, 100)
    step = train.make_step(loss_fn, optimizer)
    rows = jax.ShapeDtypeStruct((batch, SEQ_LEN), jnp.int32, sharding=train.batch_sharding(mesh))
    with jax.default_device(devices[0]), jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):
        opt_state = jax.eval_shape(optimizer.init, params)  # the moments typed like the parameters
        opt_state = jax.tree.map(
            lambda x: _abstract(x, NamedSharding(mesh, P() if x.sharding is None else x.sharding.spec)), opt_state
        )
        return step.trace(params, opt_state, rows, rows).lower().compile().as_text()


@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["small_preset", "one_kv_head_a_chip"])
def test_training_step_compiles_fused_on_a_v5e_slice(num_kv_heads, slice_devices):
    config, batch, _, _, _ = train.PRESETS["small"]  # width 256, 8 query heads of 32, batch 8
    config = dataclasses.replace(config, num_kv_heads=num_kv_heads, num_layers=2)  # 2 of its 4 layers: half the compile
    text = _compile_training_step(slice_devices, config, batch)

    calls = _mosaic_results(text)
    names = " ".join(name for name, _ in calls)
    per_layer = {kind: len(re.findall(rf"splash_mha_{kind}", names)) for kind in ("fwd", "dkv", "dq")}
    assert per_layer == {"fwd": config.num_layers, "dkv": config.num_layers, "dq": config.num_layers}, names
    kv_heads_per_chip = max(num_kv_heads // 4, 1)  # 2 heads: repeated to 4, one a chip
    for name, shapes in calls:  # [batch, heads, T, H] results: each chip's 8 / 2 rows and 8 / 4 query heads
        blocks = [s for s in shapes if len(s) == 4]
        local = ((4, 2, SEQ_LEN), (4, kv_heads_per_chip, SEQ_LEN))
        assert blocks and all(s[:3] in local for s in blocks), (name, shapes)

    gathered = _all_gathers(text)
    if num_kv_heads % 4 == 0:
        assert gathered == [], gathered
    else:  # the key/value projections' copies: f32 [D, 4, H] parameter gradients, nothing with a batch or token dim
        assert gathered and all(g.startswith(f"f32[{config.dim},4,{config.head_dim}]") for g in gathered), gathered


def test_serving_step_compiles_fused_on_a_v5e_slice(slice_devices):
    devices = slice_devices[:4]
    mesh = jax.sharding.Mesh(devices, ("model",), axis_types=(AxisType.Explicit,))
    config = dataclasses.replace(generate.PRESETS["bench"], num_layers=2)  # 16 query, 4 key/value heads of 64
    model = eqx.filter_eval_shape(llama.Llama, config, key=jax.random.key(0))
    slots, tokens = 8, 64
    with jax.default_device(devices[0]):
        caches = jax.eval_shape(lambda: model.make_caches(slots, 64, 16, 8))  # the TPU's layout
    layout = caches[0].layout
    assert layout == "combined"
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model, is_leaf, is_leaf=is_leaf)
    params = jax.tree.map(_abstract, params, llama.param_shardings(params, mesh, replicate_kv=False))
    caches = [jax.tree.map(lambda x: _abstract(x, generate.cache_sharding(x, layout, mesh)), c) for c in caches]
    whole = NamedSharding(mesh, P())
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=whole)
    cu_seqlens = jax.ShapeDtypeStruct((slots + 1,), jnp.int32, sharding=whole)
    release = jax.ShapeDtypeStruct((slots,), jnp.bool_, sharding=whole)

    def serve(params, caches, tokens, positions, cu_seqlens, release):
        inputs = (eqx.combine(params, static), tokens, positions, cu_seqlens, 16, release, jax.random.key(0), 0, 0.0)
        return generate._step(inputs, caches)

    with jax.default_device(devices[0]), jax.set_mesh(mesh):
        compiled = jax.jit(serve).trace(params, caches, ids, ids, cu_seqlens, release).lower().compile()
    text = compiled.as_text()

    calls = _mosaic_results(text)
    assert [name for name, _ in calls] and len(calls) == config.num_layers, calls
    for name, shapes in calls:  # [T, heads, H'] output: each chip's 16 / 4 query heads
        assert shapes and all(s[:2] == (tokens, 4) for s in shapes), (name, shapes)
    assert _all_gathers(text) == []
    specs = [tuple(s.spec) for s in jax.tree.leaves(compiled.output_shardings[0])]  # the caches'
    split = [spec[:3] for spec in specs if "model" in spec]
    assert split == [(None, None, "model")] * config.num_layers, specs  # each layer's pool, still split by heads
