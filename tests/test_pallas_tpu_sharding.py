"""`pallas_tpu` under `jit` on sharded inputs: the 8-device cases, the rule, and `vmap` of a partitionable call.

`test_eight_device_cases` runs `tests/tpu_sharding_cases.py` in a subprocess with 8 simulated CPU devices (the flag
must be set before JAX starts): splash and the paged decode in interpret mode, and a serving step on a cache split
over its key/value heads (the ragged kernel's call), partitioned by attnlib's rule, against the unsharded call, with
no all-gather. The rest runs here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    normal,
    on_a_simulated_tpu,
    ragged_paged_stand_in,
    rng,
    run_pytest_on_simulated_devices,
)  # fmt: skip

import attnlib
from attnlib._src.backends import partition_rules as rules
from attnlib._src.backends.pallas_tpu import partitioning, ragged


def test_eight_device_cases():
    run_pytest_on_simulated_devices("tpu_sharding_cases.py", 8)


@pytest.mark.full
def test_eight_device_cases_full_matrix():
    run_pytest_on_simulated_devices("tpu_sharding_cases.py", 8, tier="full")


def _rule(signature: partitioning.Signature, n: int, k: int, segmented: bool = True, sinks: bool = False):
    inputs = [i for i in signature.inputs if (segmented or not i.endswith("_ids")) and (sinks or i != "sinks")]
    in_dims = [partitioning.dims(i, n, k) for i in inputs]
    out_dims = [partitioning.dims(o, n, k) for o in signature.outputs]
    return rules.rule(in_dims, out_dims, partitioning.SPLITTABLE, n, k)


def test_forward_rule_names_batch_and_grouped_heads():
    rule, replicated, sizes = _rule(partitioning.FORWARD, n=8, k=2)
    assert rule == "b (k g) t h, b k s h, b k s hv, b t, b s -> b (k g) t hv, b (k g) t"
    assert replicated == ("t", "h", "s", "hv") and sizes == {"g": 4}
    rule, _, _ = _rule(partitioning.FORWARD, n=8, k=2, sinks=True)
    assert rule == "b (k g) t h, b k s h, b k s hv, b t, b s, (k g) -> b (k g) t hv, b (k g) t"


def test_backward_rule_and_mha_mqa_heads():
    rule, _, sizes = _rule(partitioning.BACKWARD, n=4, k=4, segmented=False)
    assert rule == "b k t h, b k s h, b k s hv, b k t, b k t hv, b k t -> b k t h, b k s h, b k s hv"
    assert sizes == {}
    rule, _, _ = _rule(partitioning.OUT_ONLY, n=4, k=1, segmented=False)
    assert rule == "b g t h, b k s h, b k s hv -> b g t hv"


@pytest.mark.parametrize(
    "n, k, want, sizes",
    [
        (8, 2, "t (k g) h, p page (k pair) h, seqs, seqs pages, cu -> t (k g) h", {"k": 2, "g": 4, "pair": 2}),
        (4, 4, "t k h, p page (k pair) h, seqs, seqs pages, cu -> t k h", {"pair": 2}),
        (4, 1, "t g h, p page pair h, seqs, seqs pages, cu -> t g h", {}),  # one kv head: the pair alone
    ],
)
def test_ragged_rule_splits_the_combined_pool_by_whole_key_value_pairs(n, k, want, sizes):
    """The combined pool's head axis `2K` is `(k pair)`: a split of it follows the key/value heads and never
    separates a head's key slot from its value slot; the per-sequence operands and the packed tokens stay whole."""
    rule, replicated, got_sizes = _rule(partitioning.RAGGED, n=n, k=k)
    assert rule == want and got_sizes == sizes
    assert set(replicated) == {"t", "h", "p", "page", "pair", "seqs", "pages", "cu"}
    split = rules.Split(heads=("model",), kv_heads=("model",))
    pool = partitioning.dims("combined_pool", n, k)
    assert split.axes(pool[2]) == (("model",) if k > 1 else ())


class FakeMesh:
    shape = {"data": 4, "model": 2, "pipe": 3}


@pytest.mark.parametrize(
    "heads_axes, n, k, want",
    [
        (("model",), 8, 2, (("data",), ("model",), ("model",))),
        (("model",), 4, 1, (("data",), ("model",), ())),  # MQA: the groups split, kv whole (dK, dV summed)
        (("model",), 6, 3, (("data",), (), ())),  # 3 kv heads over 2: heads stay whole
    ],
)
def test_choose_split(heads_axes, n, k, want):
    q_dims = partitioning.dims("q", n, k)
    split = rules.choose_split(FakeMesh(), q_dims, (("data",), heads_axes, (), ()), 4, n, k, partitioning.SPLITTABLE)
    assert (split.batch, split.heads, split.kv_heads) == want


@pytest.mark.parametrize(
    "k, dtype, want",
    [
        (2, "bfloat16", (("model",), ("model",))),  # 1 kv head a shard: its 2 slots tile
        (24, "bfloat16", ((), ())),  # 12 kv heads a shard: 24 slots do not tile (2, 4, 8, 16 or a multiple of 16)
        (4, "float32", (("model",), ("model",))),  # float32 tiles 2 kv heads (4 slots)
    ],
)
def test_ragged_split_keeps_kv_heads_the_kernel_can_tile(k, dtype, want):
    n = 2 * k
    q_dims = partitioning.dims("packed_q", n, k)
    ok = lambda local: ragged._kv_heads_tile(local, np.dtype(dtype))  # noqa: E731
    split = rules.choose_split(FakeMesh(), q_dims, ((), ("model",), ()), 5, n, k, partitioning.SPLITTABLE,
                               kv_heads_ok=ok)  # fmt: skip
    assert (split.heads, split.kv_heads) == want


def test_vmap_of_a_ragged_call_runs_one_call_per_example(monkeypatch):
    """Packed tokens cannot fold into one call's ranges: `vmap` over serving steps runs one call per example, each
    equal to the step alone."""
    on_a_simulated_tpu(monkeypatch)
    monkeypatch.setattr(ragged, "ragged_kernel", ragged_paged_stand_in())
    r = rng(7)
    caches = []
    for prefix in ((5, 9), (12, 1)):
        cache = attnlib.PagedKVCache.create(2, 6, 16, 2, 8, max_pages_per_seq=2, layout="combined")
        kv = normal(r, (2, 12, 2, 8), jnp.bfloat16)
        caches.append(cache.append(kv, kv * 0.5, lengths=jnp.asarray(prefix, jnp.int32)))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *caches)
    q = normal(r, (2, 5, 4, 8), jnp.bfloat16)
    cu = jnp.asarray([0, 3, 4], jnp.int32)

    def attend(cache, q):
        return cache.attend(q, cu_seqlens_q=cu, implementation=attnlib.PallasTpu())

    out = jax.jit(jax.vmap(attend))(stacked, q)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(attend(caches[i], q[i]), np.float32))


def test_vmap_folds_into_the_batch():
    """`vmap` of a call (through the partitionable splash calls' batching rule) equals the call on the stacked batch."""
    r = rng(3)
    q = normal(r, (3, 2, 9, 4, 8), jnp.float32)
    k = normal(r, (3, 2, 13, 2, 8), jnp.float32)
    v = normal(r, (3, 2, 13, 2, 8), jnp.float32)
    d_out = normal(r, q.shape, jnp.float32)
    impl = attnlib.PallasTpu(interpret=True)

    def f(q, k, v):
        return attnlib.attention(q, k, v, is_causal=True, implementation=impl, return_residual=True)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * d_out) + jnp.sum(lse), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(lambda *a: loss(jax.vmap(f), *a), (0, 1, 2), has_aux=True))(
        q, k, v
    )
    (_, (out_ref, lse_ref)), grads_ref = jax.jit(jax.value_and_grad(lambda *a: loss(f, *a), (0, 1, 2), has_aux=True))(
        q, k, v
    )
    assert_out_close(out, out_ref, jnp.float32)
    assert_lse_close(lse, lse_ref, jnp.float32)
    for g, g_ref in zip(grads, grads_ref):
        assert_grad_close(g, g_ref, jnp.float32)
