"""`examples/`: the Llama-shaped model of `llama.py` trains, and `generate.py`'s continuous batching over paged KV
caches generates exactly what greedy decoding with the model's plain (uncached) forward generates."""

import collections
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib


eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
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
