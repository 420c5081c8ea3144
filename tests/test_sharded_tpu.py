"""On a TPU: a program written for a slice (`jax.set_mesh` of a mesh with explicit axes, operands placed `P("data",
None, "model")`) run on a one-device mesh gives, bit for bit, the call with no mesh, forward and gradients, for splash
and the flex kernel's features. Skipped without a TPU; the slice itself is compiled without one in
`test_pallas_tpu_slice_compile.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import attnlib


pytestmark = pytest.mark.tpu


def _alibi(score, batch, head, q_idx, kv_idx):
    return score - 0.01 * ((head + 1) * jnp.abs(q_idx - kv_idx)).astype(score.dtype)


CASES = {
    "causal_gqa": dict(is_causal=True),
    "window": dict(local_window_size=(200, 0)),
    "mla": dict(is_causal=True, value_head_dim=128),
    "score_mod": dict(is_causal=True, score_mod=_alibi),
    "bias": dict(bias=True),
    "dropout": dict(is_causal=True, dropout_rate=0.25),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_device_explicit_mesh_equals_no_mesh(name):
    kw = dict(CASES[name])
    B, T, S, N, K = 4, 1024, 1280, 16, 4
    H, Hv = (192, kw.pop("value_head_dim")) if "value_head_dim" in kw else (128, 128)
    r = np.random.default_rng(0)
    arrays = [r.standard_normal(s) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))]
    if kw.pop("bias", False):
        arrays.append(r.standard_normal((1, N, T, S)))
    arrays = [jnp.asarray(x, jnp.bfloat16) for x in arrays]
    if "dropout_rate" in kw:
        kw["dropout_key"] = jax.random.key(3)

    def loss(*xs):
        out = attnlib.attention(*xs, implementation=attnlib.PallasTpu(), **kw)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    program = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True))
    (_, out), grads = program(*arrays)
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model") if x.shape[0] == B else P()))
                  for x in arrays]  # fmt: skip
        (_, out_m), grads_m = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays))), has_aux=True))(
            *placed
        )
    np.testing.assert_array_equal(np.asarray(out_m, np.float32), np.asarray(out, np.float32))
    for g, g_m in zip(grads, grads_m):
        np.testing.assert_array_equal(np.asarray(g_m, np.float32), np.asarray(g, np.float32))
