"""The Equinox and Haiku layers on the TPU path (`pallas_tpu`, splash attention), unchanged.

On CPU the layers run `attnlib.PallasTpu(interpret=True)` (the same kernels, padding and backward in Pallas interpret
mode, float32) and must equal the same layer on `xla`: forward and the gradients of query, key, value and the
learnable sinks, under `vmap` and `jit`. The `tpu`-marked tests run the layers in bfloat16 on a TPU with
`implementation=None` (automatic dispatch must pick `pallas_tpu`) against the same layer on `xla` in float32 at full
matmul precision on the same bfloat16 values (tolerances from bfloat16's eps, as tests/test_cudnn_gpu.py).
"""

import equinox as eqx
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, GRAD_TOL, normal, OUT_TOL

import attnlib
import attnlib.equinox as aeqx
import attnlib.haiku as ahk


F32 = jnp.float32
OPTIONS = dict(is_causal=True, local_window_size=(9, 0), softmax_type="learnable")
INTERPRET = attnlib.PallasTpu(interpret=True)


def _inputs(dtype, batch=2, t=37, s=53, n=4, k=2, h=16, seed=0):
    r = np.random.default_rng(seed)
    q = normal(r, (batch, t, n, h), dtype)
    kv = [normal(r, (batch, s, k, h), dtype) for _ in range(2)]
    return q, *kv, normal(r, (n,)), normal(r, (batch, t, n, h))


def _equinox_out_and_grads(implementation, sinks, q, k, v, cot):
    core = eqx.tree_at(lambda m: m.sinks, aeqx.DotProductAttention(4, **OPTIONS, implementation=implementation), sinks)

    def run(core, q, k, v):
        loss = lambda args: jnp.sum(jax.vmap(args[0])(*args[1:]).astype(F32) * cot)
        grads = eqx.filter_grad(loss)((core, q, k, v))
        return jax.vmap(core)(q, k, v), (grads[0].sinks, *grads[1:])

    return eqx.filter_jit(run)(core, q, k, v)


def _haiku_out_and_grads(implementation, sinks, q, k, v, cot):
    f = hk.transform(lambda q, k, v: ahk.DotProductAttention(**OPTIONS, implementation=implementation)(q, k, v))
    params = {"dot_product_attention": {"sinks": sinks}}

    def run(params, q, k, v):
        batched = lambda p, q, k, v: jax.vmap(lambda q, k, v: f.apply(p, None, q, k, v))(q, k, v)
        loss = lambda p, q, k, v: jnp.sum(batched(p, q, k, v).astype(F32) * cot)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(params, q, k, v)
        return batched(params, q, k, v), (grads[0]["dot_product_attention"]["sinks"], *grads[1:])

    return jax.jit(run)(params, q, k, v)


LAYERS = {"equinox": _equinox_out_and_grads, "haiku": _haiku_out_and_grads}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_layer_on_pallas_tpu_in_interpret_mode_equals_xla(layer):
    q, k, v, sinks, cot = _inputs(F32)
    out, grads = LAYERS[layer](INTERPRET, sinks, q, k, v, cot)
    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads = LAYERS[layer]("xla", sinks, q, k, v, cot)
    assert_close(out, ref_out, OUT_TOL[np.dtype(F32)], what="out")
    for a, e, what in zip(grads, ref_grads, ("dsinks", "dq", "dk", "dv"), strict=True):
        assert_close(a, e, GRAD_TOL[np.dtype(F32)], what=what, scale_atol_by_max=True)


@pytest.mark.tpu
@pytest.mark.parametrize("layer", list(LAYERS))
def test_tpu_layer_runs_pallas_tpu_by_default(layer):
    eps = 2.0**-7
    q, k, v, sinks, cot = _inputs(jnp.bfloat16, t=640, s=704, h=128)
    explanation = attnlib.explain(
        q[0], k[0], v[0], sinks=sinks, **{n: o for n, o in OPTIONS.items() if n != "softmax_type"}
    )
    assert explanation.implementation == "pallas_tpu", explanation
    out, grads = LAYERS[layer](None, sinks, q, k, v, cot)
    with jax.default_matmul_precision("highest"):
        up = lambda x: x.astype(F32)
        ref_out, ref_grads = LAYERS[layer]("xla", sinks, up(q), up(k), up(v), cot)
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out)
    assert np.all(np.abs(out - ref_out) <= 2 * eps + eps * np.abs(ref_out)), np.abs(out - ref_out).max()
    for a, e, what in zip(grads, ref_grads, ("dsinks", "dq", "dk", "dv"), strict=True):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.all(np.abs(a - e) <= 8 * eps * np.abs(e).max() + eps * np.abs(e)), (what, np.abs(a - e).max())
