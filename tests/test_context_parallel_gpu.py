"""Context parallelism on one GPU: the per-step attention runs on cuDNN and matches the reference (mesh of 1).

Multi-GPU runs are a separate issue; this checks that the per-step path inside `shard_map` is the fused one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import attnlib
import attnlib.context_parallel as cp


pytestmark = pytest.mark.gpu

B, S, N, K, H = 2, 512, 8, 2, 64
BF16_EPS = 2.0**-8


def _inputs():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, K, H), jnp.bfloat16)
    sinks = jax.random.normal(keys[3], (N,), jnp.float32)
    return q, k, v, sinks


def _sharded(strategy, load_balanced, options):
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    seq = P(None, "sp")

    def local(q, k, v, sinks):
        return cp.attention(
            q, k, v, axis_name="sp", strategy=strategy, load_balanced=load_balanced, sinks=sinks,
            implementation="cudnn", **options,
        )  # fmt: skip

    def run(q, k, v, sinks):
        if load_balanced:
            q, k, v = (cp.reorder(x, 1) for x in (q, k, v))
        out = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq)(q, k, v, sinks)
        return cp.restore(out, 1) if load_balanced else out

    return run


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("load_balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize(
    "options",
    [{"is_causal": True}, {}, {"is_causal": True, "local_window_size": (96, 0)}],
    ids=["causal", "full", "window"],
)
def test_per_step_runs_on_cudnn_and_matches_reference(strategy, load_balanced, options):
    q, k, v, sinks = _inputs()
    run = _sharded(strategy, load_balanced, options)
    weights = jnp.cos(jnp.arange(H, dtype=jnp.float32) * 0.3)[None, None, None, :]
    loss = lambda q, k, v, s, f: jnp.sum(f(q, k, v, s).astype(jnp.float32) * weights)
    reference = lambda q, k, v, s: attnlib.attention(q, k, v, sinks=s, implementation="xla", **options)

    hlo = jax.jit(jax.grad(lambda *a: loss(*a, run), argnums=(0, 1, 2, 3))).lower(q, k, v, sinks).as_text()
    assert "custom_call @attnlib_cudnn_graph" in hlo, "the per-step attention must lower to attnlib's cuDNN call"

    out = jax.jit(run)(q, k, v, sinks)
    expected = jax.jit(reference)(q, k, v, sinks)
    # bf16 outputs: within 5 bf16 epsilons of the float32-accumulated reference (one rounding of the output plus
    # the bf16 probabilities in the PV product); gradients, two more products deep, within 8 epsilons of their scale.
    tol = 5 * BF16_EPS
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol)

    grads = jax.jit(jax.grad(lambda *a: loss(*a, run), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    expected_grads = jax.jit(jax.grad(lambda *a: loss(*a, reference), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for got, want in zip(grads, expected_grads, strict=True):
        want = np.asarray(want, np.float32)
        scale = max(1.0, float(np.max(np.abs(want))))
        tol = 8 * BF16_EPS
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol * scale, rtol=tol)
