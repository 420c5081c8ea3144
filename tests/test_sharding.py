"""Sharded inputs under `jit` (data, tensor and FSDP parallelism): the 8-device cases, and the rule's pure parts.

`test_eight_device_cases` runs `tests/sharding_cases.py` in a subprocess with 8 simulated CPU devices (the flag must
be set before JAX starts): the real cuDNN graph call, partitioned by attnlib's rule and run by a test-only CPU
handler, against the unsharded call, with no all-gather, under automatic axes and under explicit ones (the results
typed with the operands' shardings). The rest runs here: the Shardy rule and the per-shard spec.
"""

import dataclasses

import pytest
from helpers import run_pytest_on_simulated_devices

from attnlib._src.backends.cudnn import ffi, partitioning
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid


needs_extension = pytest.mark.skipif(
    ffi.unavailable_reason() is not None,
    reason=f"the 8-device cases run the native extension's CPU handler: {ffi.unavailable_reason()}",
)


@needs_extension
def test_eight_device_cases():
    run_pytest_on_simulated_devices("sharding_cases.py", 8)


@needs_extension
@pytest.mark.full
def test_eight_device_cases_full_matrix():
    run_pytest_on_simulated_devices("sharding_cases.py", 8, tier="full")


SPEC = GraphSpec(direction="fwd", dtype="bfloat16", b=4, t=7, s=11, n=6, k=2, h=16, hv=8, scale=0.25)


class FakeMesh:
    shape = {"data": 4, "model": 2, "pipe": 3}


def _rule_of(spec: GraphSpec):
    in_dims = [partitioning._dims(spec, u, spec.shape(u, (13, 17))[0]) for u in spec.in_uids()]
    out_dims = [partitioning._dims(spec, u, spec.shape(u, (13, 17))[0]) for u in spec.out_uids()]
    return partitioning._rule(spec, in_dims, out_dims)


def test_dense_rule_names_batch_and_grouped_heads():
    rule, replicated, sizes = _rule_of(dataclasses.replace(SPEC, padding=True, sinks=True, bias_b=1, bias_n=6))
    assert rule == "b t (k g) h, b s k h, b s k hv, u0 (k g) t s, b, b, (k g) -> b t (k g) hv, b (k g) t"
    assert replicated == ("t", "h", "s", "hv") and sizes == {"g": 3}


def test_ragged_rule_splits_heads_only():
    spec = dataclasses.replace(SPEC, ragged=True, padding=True, direction="bwd")
    rule, replicated, _ = _rule_of(spec)
    assert "b" not in rule.replace("rb", "").split() and "(k g)" in rule
    assert set(replicated) == {"tq", "h", "tkv", "hv", "rb", "t"}


@pytest.mark.parametrize(
    "q_axes, n, k, want",
    [
        ((("data",), (), ("model",), ()), 6, 2, (("data",), ("model",), ("model",))),
        ((("data",), (), ("model",), ()), 4, 1, (("data",), ("model",), ())),  # MQA: the groups split, kv whole
        ((("data",), (), ("model",), ()), 6, 3, (("data",), (), ())),  # 3 kv heads over 2: heads stay whole
        (((), (), ("model", "pipe"), ()), 12, 2, ((), ("model", "pipe"), ("model",))),  # kv major, group minor
        (((), (), ("pipe", "model"), ()), 12, 2, ((), (), ())),  # 3 does not divide 2 kv heads: whole
        ((("pipe",), (), (), ()), 6, 2, ((), (), ())),  # batch 4 over 3: whole
    ],
)
def test_choose_split(q_axes, n, k, want):
    split = partitioning.choose_split(dataclasses.replace(SPEC, n=n, k=k), FakeMesh(), q_axes)
    assert (split.batch, split.heads, split.kv_heads) == want


def test_local_spec_divides_batch_heads_bias_and_modifier_args():
    spec = dataclasses.replace(SPEC, bias_b=4, bias_n=1)
    local = partitioning.local_spec(spec, FakeMesh(), partitioning.Split(("data",), ("model",), ("model",)))
    assert (local.b, local.n, local.k, local.bias_b, local.bias_n) == (1, 3, 1, 1, 1)
    assert local.shape(Uid.Q) == ((1, 7, 3, 16), "bfloat16")


def test_a_runtime_scale_is_replicated():
    """A traced `scale` reaches the graph as a `[1, 1, 1, 1]` input that every shard reads whole."""
    rule, _, _ = _rule_of(dataclasses.replace(SPEC, scale=None))
    operands = rule.split(" -> ")[0].split(", ")
    assert len(operands) == 4 and operands[0].startswith("b t (k g)")
    assert all(factor.startswith("u") for factor in operands[3].split()), operands[3]
