"""`pallas_tpu` under `jit` on sharded inputs: the 8-device cases, the rule, and `vmap` of a partitionable call.

`test_eight_device_cases` runs `tests/tpu_sharding_cases.py` in a subprocess with 8 simulated CPU devices (the flag
must be set before JAX starts): splash in interpret mode, partitioned by attnlib's rule, against the unsharded call,
with no all-gather. The rest runs here.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close, normal, rng, run_pytest_on_simulated_devices

import attnlib
from attnlib._src.backends import partition_rules as rules
from attnlib._src.backends.pallas_tpu import partitioning


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
