"""`attnlib.attention` under plain `jit` over a TPU slice, compiled ahead of time with libtpu and no TPU attached.

A program placed on a deviceless `v5e:2x4` (and `v5e:4x4`) slice (`jax.experimental.topologies`, as MaxText's
`train_compile` checks a program for a slice), q `[8, T, 32, H]`, k/v `[8, S, 8, H]` split `P("data", None,
"model")`, in each way JAX lets a program show (or not show) its mesh:

- `explicit`: a mesh with explicit axes under `jax.set_mesh`, the operands' types carrying their specs;
- `set_mesh`: `jax.set_mesh` with automatic axes (the mesh known, the layout not);
- `plain`: a plain `Mesh` and `NamedSharding` arguments (the operands' types carry the mesh, no spec);
- `unseen`: `jax.jit(..., in_shardings=...)` on unsharded abstract arguments: nothing shows the mesh at trace time.

The first three compile fused: Mosaic kernels on each chip's batch and heads (`bf16[4, 8, ...]` and the like, never
the global `[8, 32, ...]`), with no all-gather. The last compiles too, through Pallas's HLO interpreter, with one
warning naming the ways to the fused path. The programs are forward and `value_and_grad` of the feature cases: splash
(causal GQA, a window, segment ids) and attnlib's flex kernel (MLA, `score_mod`, `mask_mod`, a bias with its
gradient, a boolean mask, dropout); the paged decode and the ragged serving step have their own cases. Nothing runs.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_a_simulated_tpu
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import attnlib


pytestmark = pytest.mark.tpu_compile

MOSAIC = "tpu_custom_call"
B, T, S, N, K = 8, 1024, 1152, 32, 8
HEADS = P("data", None, "model", None)


def _slice(topology: str) -> np.ndarray:
    from jax.experimental import topologies

    with pytest.MonkeyPatch.context() as env:
        env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is used: pytest-xdist workers may share libtpu
        devices = topologies.get_topology_desc(topology, "tpu").devices
    return np.asarray(devices).reshape(2, -1) if topology == "v5e:2x4" else np.asarray(devices).reshape(4, 4)


@pytest.fixture(scope="module", params=["v5e:2x4"])
def slice_devices(request) -> np.ndarray:
    return _slice(request.param)


@pytest.fixture(autouse=True)
def compile_for_a_tpu(monkeypatch):
    on_a_simulated_tpu(monkeypatch)


def _bias(_):
    return jnp.zeros((1, N, T, S), jnp.bfloat16)


def _alibi(score, batch, head, q_idx, kv_idx):
    return score - 0.01 * ((head + 1) * jnp.abs(q_idx - kv_idx)).astype(score.dtype)


def _prefix_lm(batch, head, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 128)


CASES = {
    # name: (head dims (H, Hv), keyword arguments; "bias" / "mask" / segment ids are built per call)
    "causal_gqa": ((128, 128), dict(is_causal=True)),
    "window": ((128, 128), dict(local_window_size=(256, 0))),
    "segment_ids": ((128, 128), dict(is_causal=True, segments=True)),
    "mla": ((192, 128), dict(is_causal=True)),
    "score_mod": ((128, 128), dict(is_causal=True, score_mod=_alibi)),
    "mask_mod": ((128, 128), dict(mask_mod=_prefix_lm)),
    "bias_gradient": ((128, 128), dict(bias=True)),
    "boolean_mask": ((128, 128), dict(mask=True)),
    "dropout": ((128, 128), dict(is_causal=True, dropout_rate=0.1)),
}
SPLASH = {"causal_gqa", "window", "segment_ids"}


def _program(name: str, gradient: bool):
    """`(fn, abstract operands)`: the case's call (or the gradients of a loss on it) over q, k, v (and the bias)."""
    (H, Hv), kw = CASES[name]
    kw = dict(kw)
    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, Hv)]
    if kw.pop("bias", False):
        shapes.append((1, N, T, S))
    extra = {}
    if kw.pop("segments", False):
        extra["q_segment_ids"] = lambda: jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // 300 + 1, (B, T))
        extra["kv_segment_ids"] = lambda: jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) // 300 + 1, (B, S))
    if kw.pop("mask", False):
        extra["mask"] = lambda: jnp.tril(jnp.ones((T, S), bool), k=S - T)[None, None]
    if "dropout_rate" in kw:
        extra["dropout_key"] = lambda: jax.random.key(0)

    def call(q, k, v, *bias):
        made = {key: make() for key, make in extra.items()}
        out = attnlib.attention(q, k, v, *bias, implementation=attnlib.PallasTpu(), **kw, **made)
        return out

    if not gradient:
        return call, shapes
    loss = lambda *xs: jnp.sum(call(*xs).astype(jnp.float32))  # noqa: E731
    return jax.value_and_grad(loss, argnums=tuple(range(len(shapes)))), shapes


def _spec(shape) -> P:
    return HEADS if len(shape) == 4 and shape[0] == B else P(None, "model") if len(shape) == 4 else P()


def _compile(mode: str, devices: np.ndarray, fn, shapes):
    """The compiled program of `fn` on the slice `devices` (a `data` x `model` mesh) in `mode`."""
    types = (AxisType.Explicit,) * 2 if mode == "explicit" else (AxisType.Auto,) * 2
    mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=types)
    shardings = [NamedSharding(mesh, _spec(s)) for s in shapes]
    if mode == "unseen":
        abstract = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        jitted = jax.jit(fn, in_shardings=tuple(shardings))
    else:
        abstract = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sh) for s, sh in zip(shapes, shardings)]
        jitted = jax.jit(fn)
    with jax.default_device(devices.flat[0]):
        if mode in ("explicit", "set_mesh"):
            with jax.set_mesh(mesh):
                return jitted.trace(*abstract).lower().compile()
        return jitted.trace(*abstract).lower().compile()


def _all_gathers(text: str) -> int:
    return len(re.findall(r"\ball-gather(?:-start)?\(", text))


def _mosaic_calls(text: str) -> list[str]:
    return [line for line in text.splitlines() if MOSAIC in line and "custom-call(" in line]


def _assert_fused_on_shards(text: str, name: str) -> None:
    calls = _mosaic_calls(text)
    assert calls, "no Mosaic kernel in the compiled program"
    assert _all_gathers(text) == 0, [line for line in text.splitlines() if "all-gather" in line][:4]
    for line in calls:  # each chip's batch (8 / 2) and heads: never the global batch with every head
        assert not re.search(rf"\[{B},{N},", line) and not re.search(rf"\[{B},{K},", line), line[:300]


@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "value_and_grad"])
@pytest.mark.parametrize("mode", ["explicit", "set_mesh", "plain"])
@pytest.mark.parametrize("name", list(CASES))
def test_feature_compiles_fused_on_a_v5e_slice(name, mode, gradient, slice_devices):
    if name not in SPLASH and mode != "explicit" and not gradient:
        pytest.skip("the flex kernel's automatic-axes forward is covered by its value_and_grad program")
    fn, shapes = _program(name, gradient)
    text = _compile(mode, slice_devices, fn, shapes).as_text()
    _assert_fused_on_shards(text, name)


@pytest.mark.parametrize("name", ["causal_gqa", "score_mod"])
def test_unseen_mesh_compiles_through_the_interpreter_with_one_warning(name, slice_devices, caplog):
    fn, shapes = _program(name, gradient=True)
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        text = _compile("unseen", slice_devices, fn, shapes).as_text()
    assert not _mosaic_calls(text)
    warned = [r.getMessage() for r in caplog.records if "HLO interpreter" in r.getMessage()]
    assert warned and "jax.set_mesh" in warned[0], warned


def test_a_v5e_4x4_slice_compiles_fused():
    devices = _slice("v5e:4x4")
    for name in ("causal_gqa", "bias_gradient"):
        fn, shapes = _program(name, gradient=True)
        _assert_fused_on_shards(_compile("explicit", devices, fn, shapes).as_text(), name)
