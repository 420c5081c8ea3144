"""Context parallelism on attnlib's Pallas TPU kernels, in interpret mode on 8 simulated CPU devices.

Not collected by a plain `pytest` run (the name does not match `test_*.py`): `tests/test_context_parallel_tpu.py`
runs this file in a subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set
before JAX starts). Run it directly with:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/cp_tpu_cases.py

Every case runs `attnlib.context_parallel.attention` inside `jax.shard_map(..., check_vma=False)` over a 2 x 4
mesh (batch over `dp`, sequence over `sp`) with `implementation=attnlib.PallasTpu(interpret=True)` alone, so every
per-step call runs a Pallas kernel (splash where it serves the step, attnlib's flex kernel where it declines; no
plain-JAX fallback), and compares the output, `lse` and the gradients of query, key and value (through `out` and
`lse`) with the unsharded call on the same kernels and with the float64 reference (`tests/reference.py`), in float32
at the tolerances of `tests/helpers.py`. Sizes are odd where the layout allows: the load-balanced layout cuts the
sequence into `2 * 4` chunks, so `T = S = 120` gives chunks of 15 tokens (splash and the flex kernel pad them to
their blocks).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cp_cases import Case, context_parallel, loss_and_outputs
from helpers import assert_grad_close, assert_lse_close, assert_out_close, to_f64
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.backends.pallas_tpu import implementation as pallas_tpu


if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/cp_tpu_cases.py needs 8 devices, got {jax.device_count()}: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_context_parallel_tpu.py does)."
    )

SP, DP = 4, 2
"""Sequence shards (the `sp` axis) and batch shards (`dp`): 8 devices."""

IMPL = attnlib.PallasTpu(interpret=True, flex_blocks=(16, 16))
"""Splash where it serves a step, attnlib's flex kernel (16 x 16 tiles: several per step) where splash declines."""
FLEX = attnlib.PallasTpu(interpret=True, flex_blocks=(16, 16), kernel="flex")
"""Every step on the flex kernel."""


@dataclasses.dataclass(frozen=True)
class TpuCase:
    name: str
    kwargs: dict
    kernels: frozenset  # the kernels the per-step calls must run on: "splash", "flex"
    implementation: attnlib.PallasTpu = IMPL
    T: int = 120
    S: int = 120
    N: int = 6
    K: int = 2
    H: int = 24
    segments: bool = False
    lengths: bool = False


CASES = {
    c.name: c
    for c in [
        # GQA (3 query heads per key/value head), causal: splash serves every step (the diagonal as top-left and
        # bottom-right causal calls, the rest as full calls).
        TpuCase("causal_gqa", {"is_causal": True}, frozenset({"splash"})),
        # a causal window of 37 tokens: some steps are skipped, the rest splash's windows
        TpuCase("window_gqa", {"is_causal": True, "local_window_size": (37, 0)}, frozenset({"splash"})),
        # a two-sided window, MQA
        TpuCase("two_sided_window_mqa", {"local_window_size": (21, 9)}, frozenset({"splash"}), K=1),
        # padding lengths (global), one row cut mid-shard: local prefix lengths on splash
        TpuCase("lengths_causal", {"is_causal": True}, frozenset({"splash"}), lengths=True),
        # packed rows: every step carries a boolean mask from global segment ids and positions, which splash declines
        # and the flex kernel serves (a mask array operand)
        TpuCase("segments_causal", {"is_causal": True}, frozenset({"flex"}), segments=True),
        # every step on the flex kernel (its band on the call's own positions)
        TpuCase("flex_causal_gqa", {"is_causal": True}, frozenset({"flex"}), FLEX),
    ]
}

PARAMS = [(name, s, lb) for name in CASES for s in ("ring", "all_gather") for lb in (True, False)]
FAST = {("causal_gqa", "ring", True), ("window_gqa", "all_gather", False), ("segments_causal", "ring", True)}
"""The fast tier: splash on the load-balanced ring, splash's windows on all-gather (contiguous), the flex kernel on
packed rows (ring, load-balanced); the rest of the matrix is `full`."""


def make_inputs(case: TpuCase, seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    B = DP
    f32 = lambda *shape: jnp.asarray(r.standard_normal(shape).astype(np.float32))
    x = {
        "query": f32(B, case.T, case.N, case.H),
        "key": f32(B, case.S, case.K, case.H),
        "value": f32(B, case.S, case.K, case.H),
        "d_out": f32(B, case.T, case.N, case.H),
        "d_lse": f32(B, case.T, case.N),
    }
    if case.segments:  # row 0: three segments and trailing padding (id 0); row 1: one segment across most shards
        T = case.T
        row0 = [1] * 29 + [2] * 50 + [3] * (T - 29 - 50 - 7) + [0] * 7
        row1 = [5] * (T - 17) + [7] * 17
        x["q_segment_ids"] = jnp.asarray([row0, row1], jnp.int32)
    if case.lengths:
        x["query_seq_lengths"] = jnp.asarray([97, case.T], jnp.int32)
        x["key_value_seq_lengths"] = jnp.asarray([83, case.S - 3], jnp.int32)
    return x


def _cp_case(case: TpuCase) -> Case:
    return Case(case.name, {**case.kwargs, "implementation": case.implementation}, return_residual=True)


def _unsharded(case: TpuCase, x: dict):
    """`(out, lse, grads)` of the unsharded call on the same kernels (one device)."""
    diff = {k: x[k] for k in ("query", "key", "value")}
    rest = {k: v for k, v in x.items() if k not in diff}

    def fn(diff, rest):
        extra = {k: v for k, v in rest.items() if not k.startswith("d_")}
        return attnlib.attention(
            diff["query"], diff["key"], diff["value"], implementation=case.implementation, return_residual=True,
            **extra, **case.kwargs,
        )  # fmt: skip

    (_, (out, lse)), grads = loss_and_outputs(fn, diff, rest, _cp_case(case))
    return out, lse, grads


def _float64(case: TpuCase, x: dict):
    """The float64 reference: `(out, lse, grads)` (the `lse` cotangent only where a row sees a key, as the loss)."""
    kw = {k: np.asarray(v) for k, v in x.items() if k not in ("query", "key", "value", "d_out", "d_lse")}
    kw |= case.kwargs
    args = [to_f64(x[k]) for k in ("query", "key", "value")]
    out, lse = reference_attention(*args, **kw)
    d_lse = np.where(np.isinf(lse), 0.0, to_f64(x["d_lse"]))
    grads = reference_attention_vjp(*args, d_out=to_f64(x["d_out"]), d_lse=d_lse, **kw)
    return out, lse, grads


@pytest.fixture
def kernels_run(monkeypatch) -> set:
    """The kernels the traced per-step calls run on ("splash", "flex")."""
    ran = set()
    runs_flex = pallas_tpu.PallasTpu._runs_flex

    def recorded(self, config):
        why = runs_flex(self, config)
        ran.add("splash" if why is None else "flex")
        return why

    monkeypatch.setattr(pallas_tpu.PallasTpu, "_runs_flex", recorded)
    return ran


@pytest.mark.parametrize(
    "name,strategy,load_balanced",
    [pytest.param(*p, marks=() if p in FAST else (pytest.mark.full,),
                  id=f"{p[0]}-{p[1]}-{'lb' if p[2] else 'contiguous'}") for p in PARAMS],
)  # fmt: skip
def test_matches_unsharded_and_float64(name, strategy, load_balanced, kernels_run):
    case = CASES[name]
    x = make_inputs(case)
    out, lse, grads = context_parallel(
        _cp_case(case), x, SP, strategy, load_balanced, data_parallel=DP, check_vma=False
    )
    assert kernels_run == case.kernels, kernels_run
    kernels_run.clear()
    out_1, lse_1, grads_1 = _unsharded(case, x)
    assert kernels_run <= case.kernels | {"splash"}, kernels_run  # (the unsharded call may run splash)
    out_64, lse_64, grads_64 = _float64(case, x)
    for expected, lse_expected in ((out_1, lse_1), (out_64, lse_64)):
        assert_out_close(out, expected, jnp.float32)
        assert_lse_close(lse, lse_expected, jnp.float32)
    for k in ("query", "key", "value"):
        assert_grad_close(grads[k], grads_1[k], jnp.float32, what=f"d{k} (unsharded)")
        assert_grad_close(grads[k], grads_64[k], jnp.float32, what=f"d{k} (float64)")
    empty = np.isinf(lse_64)
    if empty.any():  # rows that see no key: exactly 0 and -inf, no NaN
        assert np.all(np.asarray(out)[empty] == 0.0) and np.all(np.isneginf(np.asarray(lse)[empty]))
