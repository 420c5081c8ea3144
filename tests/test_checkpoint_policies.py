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


def _exact(fn, *args):
    """`fn(*args)` compiled with XLA's excess precision off (`xla_allow_excess_precision`, on by default on TPUs and
    GPUs): XLA may then not skip a bfloat16 rounding inside a fusion. A `jax.checkpoint`ed program fuses its
    recomputed elementwise ops (here `sin`, `tanh` and the casts around the kernel) differently from the program
    without remat, so with excess precision on, the two round differently: measured on a TPU v5e (2026-12-07), the
    gradients differed by up to 1 bfloat16 ulp of their largest entries under every policy alike (`save_attention`,
    `nothing_saveable`, even `everything_saveable`), were bitwise equal with the flag off, and bitwise equal with
    the flag on when nothing but the kernel sits inside the checkpoint."""
    return jax.jit(fn).lower(*args).compile(compiler_options={"xla_allow_excess_precision": False})(*args)


def _assert_remat_gradients_match(attention, q, k, v):
    """Bitwise equal without excess precision (`_exact`); with XLA's defaults, within the measured 1 bfloat16 ulp of
    the largest gradient (bound: 2 ulps)."""
    expected = _exact(_grad(attention, None), q, k, v)
    actual = _exact(_grad(attention, save_attention), q, k, v)
    for name, a, e in zip("qkv", actual, expected):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=f"d{name}")
    expected = jax.jit(_grad(attention, None))(q, k, v)
    actual = jax.jit(_grad(attention, save_attention))(q, k, v)
    for name, a, e in zip("qkv", actual, expected):
        e = np.asarray(e, np.float32)
        bound = 2 * 2.0**-7 * float(np.max(np.abs(e)))  # 2 ulps of bfloat16 (8 significant bits) at the largest entry
        np.testing.assert_allclose(np.asarray(a, np.float32), e, rtol=0, atol=bound, err_msg=f"d{name}")


@pytest.mark.tpu
def test_gradients_match_without_remat_on_a_tpu():
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="pallas_tpu")
    _assert_remat_gradients_match(attention, *_qkv(t=1024, h=128, hv=128))


@pytest.mark.gpu
def test_gradients_match_and_one_forward_graph_on_a_gpu():
    attention = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn")
    q, k, v = _qkv()
    _assert_remat_gradients_match(attention, q, k, v)
    hlo = jax.jit(_grad(attention, save_attention)).lower(q, k, v).compile().as_text()
    full = jax.jit(_grad(attention, jax.checkpoint_policies.nothing_saveable)).lower(q, k, v).compile().as_text()
    graphs = lambda text: text.count('custom_call_target="attnlib_cudnn_graph"')
    assert graphs(hlo) == graphs(full) - 1 == 2
