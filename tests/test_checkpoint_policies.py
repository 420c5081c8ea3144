"""`attnlib.checkpoint_policies.save_attention`: under `jax.checkpoint`, the backward pass runs no second attention
forward kernel, and the gradients are those of the call without remat.

The kernel calls are counted in the gradient's jaxpr (every sub-jaxpr walked): cuDNN through the CPU emulation of
its graphs (`tests/cudnn_emulation.py`: attnlib's wrapper runs for real, the built graph is plain JAX), Pallas TPU as
traced on a simulated TPU (the kernels' names). The GPU and TPU tests check the same on the devices.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import emulated_cudnn
from helpers import on_a_simulated_tpu

import attnlib
from attnlib.checkpoint_policies import save_attention


B, T, N, K, H, HV = 2, 40, 6, 2, 32, 24


def _count(jaxpr, counts: collections.Counter) -> collections.Counter:
    """Per kind, the equations of `jaxpr` and every sub-jaxpr: attnlib's kernel calls (those `save_attention`
    keeps) and Pallas calls by kernel name."""
    for eqn in jaxpr.eqns:
        if save_attention(eqn.primitive, **eqn.params):
            counts["attnlib kernel calls"] += 1
        if eqn.primitive.name == "pallas_call":
            counts[str(eqn.params.get("name_and_src_info", eqn.params.get("name"))).split(" ")[0]] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _count(sub, counts)
    return counts


def _qkv(t=T, h=H, hv=HV, dtype=jnp.bfloat16):
    a, b, c = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(a, (B, t, N, h)).astype(dtype),
        jax.random.normal(b, (B, t, K, h)).astype(dtype),
        jax.random.normal(c, (B, t, K, hv)).astype(dtype),
    )


def _grad(attention, remat):
    """The gradient wrt q, k, v of a loss through `attention`, under `jax.checkpoint(policy=remat)` (None: none)."""

    def block(q, k, v):
        return jnp.tanh(attention(jnp.sin(q), k, v)).astype(jnp.float32)

    if remat is not None:
        block = jax.checkpoint(block, policy=remat)
    return jax.grad(lambda q, k, v: jnp.sum(block(q, k, v) ** 2), argnums=(0, 1, 2))


def test_cudnn_forward_graph_is_kept_and_gradients_match():
    cudnn = emulated_cudnn()
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation=cudnn)
    q, k, v = _qkv()
    calls = {
        name: _count(jax.make_jaxpr(_grad(attention, remat))(q, k, v).jaxpr, collections.Counter())[
            "attnlib kernel calls"
        ]
        for name, remat in [
            ("none", None),
            ("full", jax.checkpoint_policies.nothing_saveable),
            ("save_attention", save_attention),
        ]
    }
    assert calls == {"none": 2, "full": 3, "save_attention": 2}  # forward + backward graphs; full remat: forward again
    expected = jax.jit(_grad(attention, None))(q, k, v)
    actual = jax.jit(_grad(attention, save_attention))(q, k, v)
    for name, a, e in zip("qkv", actual, expected):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=f"d{name}")


def test_pallas_tpu_forward_kernel_runs_once(monkeypatch):
    on_a_simulated_tpu(monkeypatch)
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="pallas_tpu")
    q, k, v = _qkv(t=1024, h=128, hv=128)
    forwards = {}
    for name, remat in [
        ("none", None),
        ("full", jax.checkpoint_policies.nothing_saveable),
        ("save_attention", save_attention),
        (
            "with_dots",
            jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable, save_attention
            ),
        ),
    ]:
        counts = _count(jax.make_jaxpr(_grad(attention, remat))(q, k, v).jaxpr, collections.Counter())
        forwards[name] = counts["splash_mha_fwd_residuals"]
        assert counts["splash_mha_dq_no_residuals"] == counts["splash_mha_dkv_no_residuals"] == 1, (name, counts)
    assert forwards == {"none": 1, "full": 2, "save_attention": 1, "with_dots": 1}


def test_other_custom_vmap_calls_and_plain_jax_attention_are_not_kept():
    @jax.custom_batching.custom_vmap
    def users_own(x):
        return x * 2.0

    users_own.def_vmap(lambda axis_size, in_batched, x: (x * 2.0, in_batched[0]))
    q, k, v = _qkv(dtype=jnp.float32)

    def f(q, k, v):
        return users_own(attnlib.attention(q, k, v, is_causal=True, implementation="xla"))

    jaxpr = jax.make_jaxpr(f)(q, k, v).jaxpr
    kinds = {eqn.primitive.name for eqn in jaxpr.eqns}
    assert "custom_vmap_call" in kinds
    assert _count(jaxpr, collections.Counter())["attnlib kernel calls"] == 0


@pytest.mark.tpu
def test_gradients_match_without_remat_on_a_tpu():
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="pallas_tpu")
    q, k, v = _qkv(t=1024, h=128, hv=128)
    expected = jax.jit(_grad(attention, None))(q, k, v)
    actual = jax.jit(_grad(attention, save_attention))(q, k, v)
    for name, a, e in zip("qkv", actual, expected):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=f"d{name}")


@pytest.mark.gpu
def test_gradients_match_and_one_forward_graph_on_a_gpu():
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn")
    q, k, v = _qkv()
    expected = jax.jit(_grad(attention, None))(q, k, v)
    step = jax.jit(_grad(attention, save_attention))
    actual = step(q, k, v)
    for name, a, e in zip("qkv", actual, expected):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=f"d{name}")
    hlo = step.lower(q, k, v).compile().as_text()
    full = jax.jit(_grad(attention, jax.checkpoint_policies.nothing_saveable)).lower(q, k, v).compile().as_text()
    graphs = lambda text: text.count('custom_call_target="attnlib_cudnn_graph"')
    assert graphs(hlo) == graphs(full) - 1 == 2
