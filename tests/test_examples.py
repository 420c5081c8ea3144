"""`examples/`: the Llama-shaped model of `llama.py` trains, and `generate.py`'s continuous batching over paged KV
caches generates exactly what greedy decoding with the model's plain (uncached) forward generates. On simulated CPU
devices (a subprocess each), `train.py --mesh data=2,model=4` (explicit axes: data and tensor parallelism) trains
to the losses of the run without a mesh, and `generate.py --mesh model=2` (heads and pools split) generates its
tokens."""

import collections
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib


eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import generate as generate_lib  # noqa: E402
import llama  # noqa: E402


# Tiny: width 64, 2 layers, 4 query / 2 key-value heads of 16, vocabulary 97. Float32 compute where tokens are
# compared, so that argmax ties between two orders of summation are unlikely.
CONFIG = llama.LlamaConfig(vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
CONFIG32 = llama.LlamaConfig(**{**CONFIG.__dict__, "dtype": jnp.float32})


def _packed_batch():
    """Two rows of 24 tokens, each packing counting sequences (documents) and a little padding (segment 0)."""
    rng = np.random.default_rng(0)
    tokens = np.zeros((2, 24), np.int32)
    segments = np.zeros((2, 24), np.int32)
    for row, lengths in enumerate([(9, 7, 5), (13, 10)]):
        at = 0
        for doc, n in enumerate(lengths, start=1):
            tokens[row, at : at + n] = (rng.integers(0, 97) + rng.integers(1, 4) * np.arange(n)) % 97
            segments[row, at : at + n] = doc
            at += n
    return tokens, segments


def test_training_decreases_the_loss():
    """A few optax steps on packed documents, with a tied head and per-block remat (bfloat16 compute)."""
    config = llama.LlamaConfig(**{**CONFIG.__dict__, "tie_embeddings": True, "remat": True})
    model = llama.Llama(config, key=jax.random.key(0))
    tokens, segments = _packed_batch()
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    grad = eqx.filter_value_and_grad(llama.loss)
    assert "remat" in str(jax.make_jaxpr(lambda: grad(model, tokens, segments))())  # blocks are checkpointed

    @eqx.filter_jit
    def step(model, state):
        loss, grads = grad(model, tokens, segments)
        updates, state = optimizer.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 step counts and Python floats
        for _ in range(8):
            model, state, loss = step(model, state)
            losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[0] > math.log(97) - 1.0  # starts near chance
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.head is None and model.embed.dtype == jnp.float32


def test_packed_documents_match_separate_rows():
    """Segment ids keep documents apart and restart positions: a packed row's logits equal each document's on its
    own row."""
    model = llama.Llama(CONFIG32, key=jax.random.key(1))
    tokens, segments = _packed_batch()
    forward = eqx.filter_jit(lambda model, tokens, segments: model(tokens, segments))
    packed = forward(model, tokens, segments)
    alone = np.zeros((3, 9), np.int32)  # the first row's documents, one per row (causal: trailing padding unseen)
    starts, lengths = (0, 9, 16), (9, 7, 5)
    for i, (at, n) in enumerate(zip(starts, lengths)):
        alone[i, :n] = tokens[0, at : at + n]
    alone = forward(model, alone, None)
    for i, (at, n) in enumerate(zip(starts, lengths)):
        np.testing.assert_allclose(packed[0, at : at + n], alone[i, :n], rtol=1e-5, atol=1e-5)


def _greedy_without_cache(model, prompts, max_new_tokens):
    """Greedy decoding by re-running the training forward on each growing sequence (no cache)."""
    width = max(map(len, prompts)) + max_new_tokens
    forward = eqx.filter_jit(lambda model, rows: model(rows))
    sequences = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        rows = np.zeros((len(prompts), width), np.int32)  # causal: the padding after each sequence is never seen
        for i, s in enumerate(sequences):
            rows[i, : len(s)] = s
        logits = forward(model, rows)
        last = np.array([len(s) - 1 for s in sequences])
        for i, token in enumerate(np.asarray(jnp.argmax(logits[np.arange(len(prompts)), last], axis=-1))):
            sequences[i].append(int(token))
    return [s[len(p) :] for s, p in zip(sequences, prompts)]


LENGTHS = [5, 1, 12, 3, 9, 17, 2]  # prompt lengths
MAX_NEW = 6


@pytest.fixture(scope="module")
def greedy_case():
    """A float32 model, prompts, eos, and the uncached greedy outputs."""
    model = llama.Llama(CONFIG32, key=jax.random.key(3))
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 97, n)) for n in LENGTHS]
    expected = _greedy_without_cache(model, prompts, MAX_NEW)
    # The token most outputs contain before their last is eos: those sequences end early (eos kept as their last
    # token), the others run to MAX_NEW.
    eos = collections.Counter(t for e in expected for t in set(e[:-1])).most_common(1)[0][0]
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    assert 1 < sum(len(e) < MAX_NEW for e in expected) < len(prompts)
    return model, prompts, eos, expected


@pytest.mark.parametrize(
    "layout, max_tokens_per_step",
    [(None, 16), ("head_major", 8), ("combined", 8)],
    ids=["default", "head_major", "combined"],
)
def test_continuous_batching_matches_greedy_without_cache(greedy_case, layout, max_tokens_per_step):
    """Prompts of different lengths, more than the slots, in a pool too small for all of them at once: the cache's
    greedy generation equals the uncached one, whatever the pools' layout (None: the device's best). The 17-token
    prompt is prefilled in chunks (at most `max_tokens_per_step` tokens a step)."""
    model, prompts, eos, expected = greedy_case
    lengths, max_new, page_size, num_pages, slots = LENGTHS, MAX_NEW, 4, 10, 3

    outputs, stats = generate_lib.generate(
        model,
        prompts,
        max_new,
        max_batch=slots,
        page_size=page_size,
        num_pages=num_pages,
        max_tokens_per_step=max_tokens_per_step,
        eos_id=eos,
        layout=layout,
    )
    assert outputs == expected
    # More prompts than slots, and a pool too small for all sequences at once: slots and pages were reused (and
    # `generate` checks every step that each cache holds the tokens it fed, so no append silently ran out of pages).
    reserved = sum(math.ceil((n + max_new - 1) / page_size) for n in lengths)
    assert len(prompts) > slots and reserved > num_pages >= stats.peak_pages
    assert stats.generated_tokens == sum(map(len, expected)) and stats.prefill_tokens == sum(lengths)
    assert {bucket for bucket, _ in stats.buckets} <= {8, max_tokens_per_step}
    assert (8, 1) in stats.buckets  # steps of decodes only attend with max_seqlen_q=1
    assert all(longest <= bucket for bucket, longest in stats.buckets)
    assert stats.layout == (layout or attnlib.PagedKVCache.create(1, 1, 1, 1, 2).layout)


def test_sampling_with_temperature_is_seeded():
    model = llama.Llama(CONFIG32, key=jax.random.key(4))
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    sample = lambda seed: generate_lib.generate(
        model, prompts, 4, max_batch=2, page_size=4, max_tokens_per_step=8, temperature=1.0, seed=seed
    )[0]
    outputs = sample(1)
    assert [len(o) for o in outputs] == [4, 4, 4]
    assert all(0 <= t < 97 for o in outputs for t in o)
    assert sample(1) == outputs


def test_main_tiny_runs(capsys):
    args = "--tiny --num-prompts 3 --max-new-tokens 3 --max-batch 2 --max-tokens-per-step 8 --prompt-len 2 9"
    stats = generate_lib.main(args.split())
    assert stats.generated_tokens == 9
    out = capsys.readouterr().out
    assert "cache layout:" in out and "tokens/s" in out


def test_mesh_flag_parsing():
    assert llama.parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert llama.parse_mesh(" model = 8 ") == {"model": 8}
    for bad in ("data=2,tensor=4", "data=2,data=2", "data=two", "model=0", "data"):
        with pytest.raises(ValueError, match="`--mesh` must name `data` and/or `model`"):
            llama.parse_mesh(bad)
    with pytest.raises(ValueError, match=f"`--mesh` needs {2 * jax.device_count()} devices"):
        llama.make_mesh({"data": 2, "model": jax.device_count()})


def _run_on_cpu_devices(code: str, num_devices: int, *args: str) -> dict:
    """Run `code` (with `args` in `sys.argv[1:]`) in a Python subprocess whose CPU backend has `num_devices` devices
    (the count is fixed when JAX starts, and this process's has started), in examples/ with the test suite's strict
    promotion; the JSON object it prints on its last line."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(EXAMPLES))
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
        " --xla_backend_optimization_level=0"  # tiny programs: LLVM's optimisation would dominate their compile
    ).strip()
    prelude = (
        "import jax\n"
        "jax.config.update('jax_numpy_dtype_promotion', 'strict')\n"
        "jax.config.update('jax_numpy_rank_promotion', 'raise')\n"
    )
    command = [sys.executable, "-c", prelude + code, *args]
    proc = subprocess.run(command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    report = (proc.stdout + proc.stderr)[-12000:]
    assert proc.returncode == 0, report
    return json.loads(proc.stdout.strip().splitlines()[-1])


TRAIN_ON_A_MESH = """
import json, re
import jax, jax.numpy as jnp, numpy as np
import dataclasses, llama, train

args = ["--tiny", "--steps", "3", "--dtype", "float32"]
with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 step counts and Python floats
    sharded = train.main(args + ["--mesh", "data=2,model=4"])
    unsharded = train.main(args)

# The same step, traced and compiled on its own: what it keeps and what it gathers.
config = dataclasses.replace(train.PRESETS["tiny"][0], dtype=jnp.float32)
mesh = llama.make_mesh({"data": 2, "model": 4})
with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):
    params, loss_fn = train.init_equinox(config, jax.random.key(0))
    params = jax.device_put(params, llama.param_shardings(params, mesh))
    optimizer = train.make_optimizer(3e-3, 3)
    opt_state = optimizer.init(params)
    step = train.make_step(loss_fn, optimizer)
    batch = jax.device_put((np.ones((4, 128), np.int32),) * 2, train.batch_sharding(mesh))
    before = jax.tree.leaves((params, opt_state))
    after = jax.tree.leaves(jax.eval_shape(step, params, opt_state, *batch)[:2])
    text = step.lower(params, opt_state, *batch).compile().as_text()
print(json.dumps(dict(
    sharded=sharded,
    unsharded=unsharded,
    specs=[str(jax.typeof(x).sharding.spec) for x in before],
    kept=[a.sharding == jax.typeof(b).sharding for a, b in zip(after, before)],
    all_gathers=[line.split("=")[1].split()[0] for line in text.splitlines()
                 if re.search(r"\\ball-gather(?:-start)?\\(", line)],
)))
"""


def test_train_on_a_mesh_equals_the_unsharded_run():
    """`train.py --tiny --mesh data=2,model=4` on 8 simulated CPU devices: 3 AdamW steps in float32 compute give the
    losses of the same steps without a mesh, to float32 rounding (measured: 1 to 4 units in the last place; the
    output projections' sums over heads and hidden units split 4 ways, and the loss's and the gradients' sums over
    the batch split 2 ways, add in another order, and XLA compiles each device's program for its local shapes). A
    device reading another's rows or heads, or a lost gradient term, would move the losses by far more. The step
    keeps every parameter's and optimizer moment's sharding, and the only all-gathers in its compiled program are of
    the gradients of the key/value projections: the tiny model has 2 key/value heads for 4 devices, so each device
    holds a copy of its query heads' (`llama.kv_heads_for`), and the copies' gradients are gathered to be summed
    (`[D, 4, H]` per projection and layer); none of an activation."""
    result = _run_on_cpu_devices(TRAIN_ON_A_MESH, 8)
    sharded, unsharded = np.asarray(result["sharded"]), np.asarray(result["unsharded"])
    assert len(sharded) == 3 and np.isfinite(sharded).all()
    np.testing.assert_allclose(sharded, unsharded, rtol=16 * np.finfo(np.float32).eps, atol=0)
    assert "P(None, 'model', None)" in result["specs"] and "P('model', None, None)" in result["specs"]  # wq, wo
    assert all(result["kept"]), result["specs"]
    assert result["all_gathers"] and all(g.startswith("f32[64,4,16]") for g in result["all_gathers"]), result


GENERATE_ON_A_MESH = """
import json, re, sys
import equinox as eqx, jax, jax.numpy as jnp, numpy as np
import generate, llama

layout = sys.argv[1]
model = llama.Llama(llama.LlamaConfig(dtype=jnp.float32), key=jax.random.key(3))  # 4 query, 2 key/value heads
prompts = [[5, 17, 3, 9, 40], [1], [12, 80, 7, 7, 2, 61, 33, 90, 14, 4, 28], [66, 3]]
settings = dict(max_batch=2, page_size=4, num_pages=8, max_tokens_per_step=8, layout=layout)
mesh = llama.make_mesh({"model": 2})
sharded, stats = generate.generate(model, prompts, 5, mesh=mesh, **settings)
unsharded, _ = generate.generate(model, prompts, 5, **settings)

# One step on the mesh, traced and compiled on its own: where its pools stay, what it gathers.
with jax.set_mesh(mesh):
    served, caches = generate.shard_for_serving(model, model.make_caches(2, 8, 4, 4, layout), mesh)
    inputs = (served, np.zeros(8, np.int32), np.zeros(8, np.int32), np.array([0, 5, 6], np.int32), 8,
              np.zeros(2, bool), jax.random.key(0), np.int32(0), 0.0)
    after = eqx.filter_eval_shape(generate._step, inputs, caches)[0]
    text = generate._step.lower(inputs, caches).lowered.compile().as_text()
print(json.dumps(dict(
    sharded=sharded,
    unsharded=unsharded,
    layout=stats.layout,
    pools=[str(jax.typeof(p).sharding.spec) for cache in caches for p in cache.pools],
    pools_after=[str(p.sharding.spec) for cache in after for p in cache.pools],
    all_gathers=sum(bool(re.search(r"\\ball-gather(?:-start)?\\(", line)) for line in text.splitlines()),
)))
"""


@pytest.mark.parametrize(
    "layout",
    [
        "token_major",  # a CPU's and a GPU's
        pytest.param("head_major", marks=pytest.mark.full),
        pytest.param("combined", marks=pytest.mark.full),  # a TPU's
    ],
)
def test_generate_on_a_mesh_equals_the_unsharded_run(layout):
    """`generate(..., mesh=llama.make_mesh({"model": 2}))` (`generate.py --mesh model=2`) on 2 simulated CPU devices,
    float32: the model's heads and each cache's pools split over `model` by key/value heads (`cache_sharding`), the
    greedy tokens equal those of the run without a mesh (continuous batching over 4 prompts in 2 slots, prefill
    chunks and decodes), a step keeps its pools split and compiles with no all-gather."""
    result = _run_on_cpu_devices(GENERATE_ON_A_MESH, 2, layout)
    assert result["sharded"] == result["unsharded"] and all(len(o) == 5 for o in result["sharded"]), result
    assert result["layout"] == layout
    heads_axis = 0 if layout == "head_major" else 2
    split = str(jax.sharding.PartitionSpec(*[("model" if i == heads_axis else None) for i in range(4)]))
    assert result["pools"] == result["pools_after"] == [split] * len(result["pools"]), result
    assert result["all_gathers"] == 0
