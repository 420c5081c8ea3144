"""Context parallelism whose per-step attention runs attnlib's cuDNN wrapper over an emulated graph, on 4 CPU devices.

Not collected by a plain `pytest` run: `tests/test_cudnn_dense_emulated.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (the flag must be set before JAX starts). Run it directly with:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest tests/cp_cudnn_emulated.py

The ring and all-gather strategies call `attnlib.attention(..., implementation=("cudnn", "xla"))` on every sub-block
inside `shard_map`: blocks cuDNN can express (causal, windows, padding lengths, sinks) go through the cuDNN wrapper
(custom VJP, trimmed lengths, zero-filled results, values that vary over the mesh axis) with the graph replaced by
`cudnn_emulation.emulate`; the others (boolean masks) run on `xla`. Outputs and gradients are compared with
single-device `xla` attention on the whole sequence, in bfloat16 with the tolerances of `test_context_parallel_gpu.py`
(5 bf16 epsilons on the output, 8 times the gradient's scale on gradients). The H200 runs the same path for real on
a mesh of one device; this checks the multi-step merges, the per-step lengths and the sharded custom VJP.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import emulate, install
from jax.sharding import Mesh, PartitionSpec as P

import attnlib
import attnlib.context_parallel as cp


if jax.device_count() < 4:
    raise RuntimeError("tests/cp_cudnn_emulated.py needs XLA_FLAGS=--xla_force_host_platform_device_count=4")

D, B, S, N, K, H = 4, 2, 64, 4, 2, 64
BF16_EPS = 2.0**-8
CALLS: list[str] = []


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    def counted(spec, entry, *operands, tokens=None):
        CALLS.append(spec.label)
        return emulate(spec, entry, *operands, tokens=tokens)

    install(monkeypatch, counted)
    CALLS.clear()


OPTIONS = {
    "causal": {"is_causal": True},
    "window": {"is_causal": True, "local_window_size": (9, 0)},
    "lengths": {"is_causal": True, "query_seq_lengths": [50, 0], "key_value_seq_lengths": [41, 64]},
    "window_lengths_sinks": {"is_causal": True, "local_window_size": (13, 0), "query_seq_lengths": [61, 23],
                             "key_value_seq_lengths": [30, 64], "sinks": True},
}  # fmt: skip


def _inputs(options):
    keys = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(keys[0], (B, S, N, H), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, K, H), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, K, H), jnp.float32).astype(jnp.bfloat16)
    sinks = jax.random.normal(keys[3], (N,), jnp.float32) if options.get("sinks") else None
    weights = jax.random.normal(keys[4], (B, S, N, H), jnp.float32)
    kw = {key: jnp.asarray(val, jnp.int32) if key.endswith("lengths") else val for key, val in options.items()
          if key != "sinks"}  # fmt: skip
    return q, k, v, sinks, weights, kw


def _params():
    """Every option with every strategy and layout. The fast tier runs "causal" ring (load-balanced) and
    "window_lengths_sinks" (window, padding lengths and sinks together) all-gather (contiguous): every option, both
    strategies and both layouts once; "window" and "lengths" on their own are `full`."""
    params = []
    for name in OPTIONS:
        fast = {"causal": ("ring", True), "window_lengths_sinks": ("all_gather", False)}.get(name)
        for strategy in ("ring", "all_gather"):
            for balanced in (True, False):
                marks = () if (strategy, balanced) == fast else (pytest.mark.full,)
                layout = "balanced" if balanced else "contiguous"
                params.append(pytest.param(name, strategy, balanced, marks=marks, id=f"{name}-{strategy}-{layout}"))
    return params


@pytest.mark.parametrize("name,strategy,load_balanced", _params())
def test_context_parallel_on_the_cudnn_wrapper(name, strategy, load_balanced):
    q, k, v, sinks, weights, kw = _inputs(OPTIONS[name])
    mesh = Mesh(np.array(jax.devices()[:D]), ("sp",))
    seq = P(None, "sp")
    lengths = {key: val for key, val in kw.items() if key.endswith("lengths")}
    flags = {key: val for key, val in kw.items() if not key.endswith("lengths")}

    def local(q, k, v, sinks, lengths):
        return cp.attention(q, k, v, sinks=sinks, axis_name="sp", strategy=strategy, load_balanced=load_balanced,
                            implementation=("cudnn", "xla"), **lengths, **flags)  # fmt: skip

    def sharded(q, k, v, sinks):
        if load_balanced:
            q, k, v = (cp.reorder(x, D) for x in (q, k, v))
        specs = (seq, seq, seq, None if sinks is None else P(), {key: P() for key in lengths})
        out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=seq)(q, k, v, sinks, lengths)
        return cp.restore(out, D) if load_balanced else out

    def whole(q, k, v, sinks):
        f32 = lambda x: x.astype(jnp.float32)
        return attnlib.attention(f32(q), f32(k), f32(v), sinks=sinks, implementation="xla", **kw)

    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)

    def out_and_grads(f):  # one compiled program: the output and the gradients of <weights, output>
        def loss(*a):
            out = f(*a)
            return jnp.sum(out.astype(jnp.float32) * weights), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(q, k, v, sinks)
        return out, grads

    with jax.default_matmul_precision("highest"):
        out, grads = out_and_grads(sharded)
        expected, expected_grads = out_and_grads(whole)
    assert any(label.startswith("sdpa_fwd") for label in CALLS), "no sub-block ran on the cuDNN wrapper"
    assert any(label.startswith("sdpa_bwd") for label in CALLS), "no sub-block's gradient ran on the cuDNN wrapper"
    tol = 5 * BF16_EPS
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=tol, rtol=tol)
    for got, want in zip(grads, expected_grads, strict=True):
        want = np.asarray(want, np.float32)
        scale = max(1.0, float(np.max(np.abs(want))))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=8 * BF16_EPS * scale, rtol=8 * BF16_EPS)
