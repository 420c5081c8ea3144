"""Context-parallel cases on 8 simulated CPU devices.

Not collected by a plain `pytest` run (the name does not match `test_*.py`): `tests/test_context_parallel.py` runs
this file in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8`, because the flag must be set
before JAX initialises its CPU backend and other test files in the main pytest process initialise it first. Run it
directly with:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/cp_cases.py

Every case runs `attnlib.context_parallel.attention` inside `shard_map` (the inputs laid out with `reorder` when
load-balanced, the outputs and gradients `restore`d) and compares the output, `lse` where returned, and the
gradients of `query`, `key`, `value` and `sinks` with single-device `attnlib.attention` on the whole sequence,
in float32 with the project's float32 tolerances (`helpers.py`).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close

import attnlib
from attnlib import context_parallel as cp


if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/cp_cases.py needs 8 devices, got {jax.device_count()}: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_context_parallel.py does)."
    )

P = jax.sharding.PartitionSpec
AXIS = "sp"


def mesh_of(num_devices: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), (AXIS,))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    T: int = 48
    S: int = 48
    N: int = 4
    K: int = 2
    H: int = 8
    Hv: int = 8
    segments: bool = False
    lengths: bool = False
    sinks: bool = False
    return_residual: bool = False


CASES = {
    c.name: c
    for c in [
        Case("noncausal_mha", {}, N=2, K=2),
        Case("causal", {"is_causal": True}),
        Case("gqa_mla_sinks_softcap", {"is_causal": True, "logits_soft_cap": 3.0}, N=4, K=1, Hv=4, sinks=True),
        Case("window_causal", {"is_causal": True, "local_window_size": (9, 0)}),
        Case("window_two_sided", {"local_window_size": (5, 3)}),
        Case("segments", {"is_causal": True}, segments=True),
        Case("lengths", {"is_causal": True}, lengths=True),
        Case("bottom_right_cross", {"is_causal": True, "diagonal_alignment": "bottom_right"}, T=32, S=48),
        # more queries than keys: on the first ring step some devices have nothing to compute
        Case("bottom_right_more_queries", {"is_causal": True, "diagonal_alignment": "bottom_right"}, T=48, S=32),
        Case(
            "everything",
            {"is_causal": True, "local_window_size": (13, 0)},
            segments=True, lengths=True, sinks=True, return_residual=True,
        ),  # fmt: skip
    ]
}

PARAMS = [(4, s, lb, name) for name in CASES for s in ("ring", "all_gather") for lb in (False, True)]
PARAMS += [(d, s, lb, name) for d in (2, 8) for name in ("causal", "everything")
           for s in ("ring", "all_gather") for lb in (False, True)]  # fmt: skip
# The fast tier: every case once on 4 devices, alternating ring (load-balanced) and all-gather (contiguous), and the
# two other device counts once each on the cheapest case ("causal": 8 devices is the longest ring, 8 steps; the
# "everything" case already runs on 4 devices here, ring and load-balanced in `test_bfloat16`); the rest of the
# matrix is `full`. Moved to `full` (CPU time): all-gather's "causal", "window_causal" and "segments" on 4 devices,
# which "everything" combines (causal, a causal window, segments, lengths, sinks) on all-gather contiguous here, and
# on all-gather load-balanced over a data-parallel mesh (`test_batch_and_sequence_sharded`); "causal" on all-gather
# still runs alone on 2 devices.
COMBINED_IN_EVERYTHING = ("causal", "window_causal", "segments")
FAST = {(4, "ring", True, n) if i % 2 == 0 else (4, "all_gather", False, n) for i, n in enumerate(CASES)
        if i % 2 == 0 or n not in COMBINED_IN_EVERYTHING}  # fmt: skip
FAST |= {(8, "ring", True, "causal"), (2, "all_gather", True, "causal")}


def make_inputs(case: Case, seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    B = 2
    f32 = lambda *shape: jnp.asarray(r.standard_normal(shape).astype(np.float32))
    x = {
        "query": f32(B, case.T, case.N, case.H),
        "key": f32(B, case.S, case.K, case.H),
        "value": f32(B, case.S, case.K, case.Hv),
        "d_out": f32(B, case.T, case.N, case.Hv),
        "d_lse": f32(B, case.T, case.N),
    }
    if case.sinks:
        x["sinks"] = f32(case.N)
    if case.segments:
        # row 0: three segments and trailing padding (id 0); row 1: two segments, one spanning most shards
        assert case.T == case.S == 48
        row0 = [1] * 11 + [2] * 20 + [3] * 13 + [0] * 4
        row1 = [5] * 31 + [7] * 17
        x["q_segment_ids"] = jnp.asarray([row0, row1], jnp.int32)
    if case.lengths:
        # one row cut mid-shard, one row with no query at all (out 0, lse -inf, zero gradients, no NaN)
        x["query_seq_lengths"] = jnp.asarray([37, 0], jnp.int32)
        x["key_value_seq_lengths"] = jnp.asarray([29, 40], jnp.int32)
    return x


DIFF = ("query", "key", "value", "sinks")
SEQ_AXIS = {"query": -3, "key": -3, "value": -3, "d_out": -3, "d_lse": -2, "q_segment_ids": -1}
REPLICATED = ("sinks", "query_seq_lengths", "key_value_seq_lengths")


def loss_and_outputs(fn, diff, rest, case):
    """`sum(out * d_out) (+ sum(lse * d_lse) over finite lse)`; returns (loss, (out, lse))."""

    def loss(diff):
        res = fn(diff, rest)
        out, lse = res if case.return_residual else (res, None)
        total = jnp.sum(out.astype(jnp.float32) * rest["d_out"])
        if lse is not None:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * rest["d_lse"])
        return total, (out, lse)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)


@functools.cache
def reference_of(name: str):
    """Single-device `attnlib.attention` on the whole sequence: the same for every mesh, strategy and layout."""
    case = CASES[name]
    return reference(case, make_inputs(case))


def reference(case: Case, x: dict):
    diff = {k: x[k] for k in DIFF if k in x}
    rest = {k: v for k, v in x.items() if k not in diff}

    def fn(diff, rest):
        extra = {k: v for k, v in rest.items() if not k.startswith("d_")}
        return attnlib.attention(
            diff["query"], diff["key"], diff["value"], sinks=diff.get("sinks"),
            return_residual=case.return_residual, **extra, **case.kwargs,
        )  # fmt: skip

    (_, (out, lse)), grads = loss_and_outputs(fn, diff, rest, case)
    return out, lse, grads


def context_parallel(
    case: Case, x: dict, num_devices: int, strategy: str, load_balanced: bool, data_parallel: int = 1,
    check_vma: bool = True,
):
    """Run the case on `num_devices` sequence shards (times `data_parallel` batch shards over axis "dp"), inside
    `jax.shard_map(..., check_vma=check_vma)`."""
    D = num_devices
    lay = lambda k, a: cp.reorder(a, D, SEQ_AXIS[k]) if load_balanced and k in SEQ_AXIS else a
    back = lambda k, a: cp.restore(a, D, SEQ_AXIS[k]) if load_balanced and k in SEQ_AXIS else a
    x = {k: lay(k, a) for k, a in x.items()}
    diff = {k: x[k] for k in DIFF if k in x}
    rest = {k: v for k, v in x.items() if k not in diff}
    dp = "dp" if data_parallel > 1 else None
    batch = lambda k: P(dp) if k in ("query_seq_lengths", "key_value_seq_lengths") else P()
    spec = lambda k: batch(k) if k in REPLICATED else P(dp, *([None] * (x[k].ndim + SEQ_AXIS[k] - 1)), AXIS)
    if data_parallel > 1:
        devices = np.array(jax.devices()[: D * data_parallel]).reshape(data_parallel, D)
        mesh = jax.sharding.Mesh(devices, ("dp", AXIS))
    else:
        mesh = mesh_of(D)

    def body(diff, extra):
        return cp.attention(
            diff["query"], diff["key"], diff["value"], sinks=diff.get("sinks"), axis_name=AXIS,
            strategy=strategy, load_balanced=load_balanced, return_residual=case.return_residual,
            **extra, **case.kwargs,
        )  # fmt: skip

    def fn(diff, rest):
        extra = {k: v for k, v in rest.items() if not k.startswith("d_")}
        out_specs = (spec("query"), P(dp, AXIS, None)) if case.return_residual else spec("query")
        sharded = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=({k: spec(k) for k in diff}, {k: spec(k) for k in extra}),
            out_specs=out_specs,
            check_vma=check_vma,
        )
        return sharded(diff, extra)

    (_, (out, lse)), grads = loss_and_outputs(fn, diff, rest, case)
    out = back("d_out", out)
    lse = None if lse is None else back("d_lse", lse)
    grads = {k: back(k, g) for k, g in grads.items()}
    return out, lse, grads


@pytest.mark.parametrize(
    "num_devices,strategy,load_balanced,name",
    [pytest.param(*p, marks=() if p in FAST else (pytest.mark.full,),
                  id=f"D{p[0]}-{p[1]}-{'lb' if p[2] else 'contiguous'}-{p[3]}") for p in PARAMS],
)  # fmt: skip
def test_matches_single_device(num_devices, strategy, load_balanced, name):
    case = CASES[name]
    x = make_inputs(case)
    out_ref, lse_ref, grads_ref = reference_of(name)
    out, lse, grads = context_parallel(case, x, num_devices, strategy, load_balanced)
    assert_out_close(out, out_ref, jnp.float32)
    if case.return_residual:
        assert_lse_close(lse, lse_ref, jnp.float32)
    assert set(grads) == set(grads_ref)
    for k in grads_ref:
        assert_grad_close(grads[k], grads_ref[k], jnp.float32, what=f"d{k}")
    if case.lengths:
        # the row with no valid query: exact zeros, forward and backward
        assert np.all(np.asarray(out[1]) == 0.0)
        assert np.all(np.asarray(grads["query"][1]) == 0.0)


# Fast tier: all_gather (the ring strategy runs the same "everything" case load-balanced in `test_bfloat16`, and on
# a data-parallel mesh in the full tier).
@pytest.mark.parametrize("strategy", [pytest.param("ring", marks=pytest.mark.full), "all_gather"])
def test_batch_and_sequence_sharded(strategy):
    """A 2 x 4 mesh: batch over "dp", sequence over "sp" (load-balanced); sinks replicated over both."""
    case = CASES["everything"]
    out_ref, lse_ref, grads_ref = reference_of(case.name)
    out, lse, grads = context_parallel(case, make_inputs(case), 4, strategy, True, data_parallel=2)
    assert_out_close(out, out_ref, jnp.float32)
    assert_lse_close(lse, lse_ref, jnp.float32)
    for k in grads_ref:
        assert_grad_close(grads[k], grads_ref[k], jnp.float32, what=f"d{k}")


# Fast tier: ring (all_gather runs in float32 on every case above; bfloat16 with all_gather is `full`).
@pytest.mark.parametrize("strategy", ["ring", pytest.param("all_gather", marks=pytest.mark.full)])
def test_bfloat16(strategy):
    """bfloat16 inputs: output in bfloat16, float32 `lse`, within the project's bfloat16 tolerances."""
    case = CASES["everything"]
    x = {k: a.astype(jnp.bfloat16) if k in ("query", "key", "value") else a for k, a in make_inputs(case).items()}
    out_ref, lse_ref, grads_ref = reference(case, x)
    out, lse, grads = context_parallel(case, x, 4, strategy, True)
    assert out.dtype == jnp.bfloat16
    assert_out_close(out, out_ref, jnp.bfloat16)
    assert_lse_close(lse, lse_ref, jnp.bfloat16)
    for k in grads_ref:
        assert grads[k].dtype == grads_ref[k].dtype
        assert_grad_close(grads[k], grads_ref[k], jnp.bfloat16, what=f"d{k}")


# Fast tier: "causal" on the ring with `check_vma=False` (splash serves the steps), on a ring of 2 devices (a diagonal
# and an off-diagonal step, each in interpret mode: 4 devices took 2.5x the CPU time); the full tier runs every case
# on 4. `check_vma=True` (pallas_tpu declines inside `shard_map`, `xla` serves) is `full` here; the fast tier checks
# that decline in `test_pallas_tpu.py::test_inside_shard_map`.
@pytest.mark.parametrize("check_vma", [False, pytest.param(True, marks=pytest.mark.full)], ids=["no_vma", "vma"])
@pytest.mark.parametrize(
    "name,strategy",
    [pytest.param(n, s, marks=() if (n, s) == ("causal", "ring") else (pytest.mark.full,))
     for n in ("causal", "window_causal", "lengths", "bottom_right_cross", "segments", "gqa_mla_sinks_softcap")
     for s in ("ring", "all_gather")],
)  # fmt: skip
def test_pallas_tpu_serves_the_steps(name, strategy, check_vma, monkeypatch):
    """`implementation=(PallasTpu(interpret=True), "xla")` composes per step inside `shard_map(check_vma=False)`:
    splash (in interpret mode) serves the steps it can (the others are logged and run on `xla`), and the result
    equals single-device attention. With `check_vma=True` pallas_tpu declines every step (its kernels cannot type
    their outputs' variation) and `xla` serves them, with the same result. (Steps of packed rows carry a mask array,
    and MLA steps have `Hv != H`, which splash declines: attnlib's flex kernel runs them.)"""
    served = []
    serve = attnlib.PallasTpu.attention

    def counted(self, config, inputs, context):
        served.append(config.q_len)
        return serve(self, config, inputs, context)

    monkeypatch.setattr(attnlib.PallasTpu, "attention", counted)
    base = CASES[name]
    implementation = (attnlib.PallasTpu(interpret=True), "xla")
    case = dataclasses.replace(base, kwargs=base.kwargs | {"implementation": implementation})
    out_ref, lse_ref, grads_ref = reference_of(name)
    fast = (name, strategy, check_vma) == ("causal", "ring", False)
    out, lse, grads = context_parallel(case, make_inputs(case), 2 if fast else 4, strategy, True, check_vma=check_vma)
    assert bool(served) == (not check_vma), (check_vma, served)
    assert_out_close(out, out_ref, jnp.float32)
    if case.return_residual:
        assert_lse_close(lse, lse_ref, jnp.float32)
    for k in grads_ref:
        assert_grad_close(grads[k], grads_ref[k], jnp.float32, what=f"d{k}")


# ------------------------------------------------------------------------------------------------------------------
# Memory and schedule: inspect the compiled per-device program.

_SHAPE = re.compile(r"\b(?:f32|f16|bf16|s32|pred|u32|s8|u8)\[([0-9,]*)\]")


def _compiled_grad(strategy: str, load_balanced: bool, kwargs: dict, D: int = 8, S: int = 80):
    """Compiled forward+backward of a CP call on global `[2, S, 4, 8]` inputs sharded over `D` devices."""
    q = jnp.ones((2, S, 4, 8), jnp.float32)
    k = jnp.ones((2, S, 2, 8), jnp.float32)
    spec = P(None, AXIS)
    f = jax.shard_map(
        lambda q, k, v: cp.attention(
            q, k, v, axis_name=AXIS, strategy=strategy, load_balanced=load_balanced, **kwargs
        ),
        mesh=mesh_of(D), in_specs=(spec, spec, spec), out_specs=spec,
    )  # fmt: skip
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), argnums=(0, 1, 2)))
    return g.lower(q, k, k).compile()


def _buffers(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in m.group(1).split(",") if d) for m in _SHAPE.finditer(text)]


def _full_sequence_buffers(text: str, S: int, full_kv_elements: int) -> list[tuple[int, ...]]:
    """Shapes with the global sequence length as a dim, or at least as many elements as the whole key array."""
    return [s for s in _buffers(text) if S in s or int(np.prod(s, dtype=np.int64)) >= full_kv_elements]


# Fast tier: the contiguous layout (ring vs all_gather buffers and collectives); the load-balanced layout is `full`.
@pytest.mark.parametrize(
    "load_balanced", [False, pytest.param(True, marks=pytest.mark.full)], ids=["contiguous", "lb"]
)
def test_ring_never_materialises_the_full_sequence(load_balanced):
    """Forward + backward per-device programs on 4 devices: ring buffers are O(S / D), all_gather's are not."""
    D, S = 4, 48  # no other dim of the problem (2, 4, 2, 8, local 12, chunks 6) equals S
    full_kv = 2 * S * 2 * 8  # elements of the whole key array; local scores are 2*4*12*12 < full_kv
    kwargs = {"is_causal": True}
    ring = _compiled_grad("ring", load_balanced, kwargs, D=D, S=S)
    gathered = _compiled_grad("all_gather", load_balanced, kwargs, D=D, S=S)
    # the inspection does see full-sequence buffers where they exist (all_gather) ...
    assert _full_sequence_buffers(gathered.as_text(), S, full_kv), "the check cannot see the all-gathered keys"
    # ... and the ring program has none
    assert _buffers(ring.as_text()), "no buffer shapes parsed from the compiled program"
    assert _full_sequence_buffers(ring.as_text(), S, full_kv) == []
    assert ring.memory_analysis().temp_size_in_bytes < gathered.memory_analysis().temp_size_in_bytes
    # all_gather: K and V gathered, dK and dV reduce-scattered back (the transpose of all_gather); ring: neither
    assert _collectives(gathered.as_text(), "all-gather") == 2
    assert _collectives(gathered.as_text(), "reduce-scatter") == 2
    assert _collectives(ring.as_text(), "all-gather") == _collectives(ring.as_text(), "reduce-scatter") == 0
    assert _collectives(ring.as_text(), "collective-permute") > 0


def _collectives(text: str, op: str) -> int:
    return len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))


def _collective_permutes(text: str) -> int:
    return _collectives(text, "collective-permute")


def test_ring_skips_steps_outside_the_window():
    """D=8, 6 local tokens: a causal window of 5 reaches only the previous shard, so 1 of 7 transfers remains."""
    full = _collective_permutes(_compiled_grad("ring", False, {"is_causal": True}, S=48).as_text())
    windowed = _collective_permutes(
        _compiled_grad("ring", False, {"is_causal": True, "local_window_size": (5, 0)}, S=48).as_text()
    )
    assert full > 0
    assert windowed < full
    # forward: k, v sent once; backward: k, v once, dk/dv once, dk/dv home once -> far fewer than 7 steps' worth
    assert windowed * 3 <= full
