"""Sharded inputs under `jit` on 8 simulated CPU devices: splash's calls and the paged kernels' calls (`pallas_tpu`)
partitioned by attnlib's rule.

Not collected by a plain `pytest` run: `tests/test_pallas_tpu_sharding.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX starts). Run it directly with:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/tpu_sharding_cases.py

`attnlib.PallasTpu(interpret=True)` runs the splash kernels in Pallas interpret mode inside attnlib's
`custom_partitioning` (`attnlib/_src/backends/pallas_tpu/partitioning.py`). Every case compiles the forward and the
gradients (through `out` and the returned `lse`) with batch over a `data` axis and heads over a `model` axis (mesh
4 x 2), counts the all-gathers in the compiled HLO (none), and compares out, lse and every gradient with the
unsharded call at the dtype's tolerances (`helpers.py`). Sizes are tiny: interpret mode is slow.

Serving on a mesh: the paged decode kernel runs in interpret mode too (Pallas's HLO interpreter, which partitions);
JAX's ragged paged-attention kernel cannot run in either of JAX 0.10.2's interpreters, so a serving step on a
`"combined"` cache split over its key/value heads (append, then attend to a mixed prefill + decode batch) runs with a
plain-JAX stand-in in the kernel's place, which records the shapes each shard's call is traced with.
"""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close, on_a_simulated_tpu

import attnlib
from attnlib._src.backends.pallas_tpu import partitioning


if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/tpu_sharding_cases.py needs 8 devices, got {jax.device_count()}: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_pallas_tpu_sharding.py does)."
    )


P = jax.sharding.PartitionSpec
DTYPE = jnp.float32
MESH_SHAPE = (4, 2)
IMPL = attnlib.PallasTpu(interpret=True)


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    B: int = 4
    T: int = 7
    S: int = 11
    N: int = 4
    K: int = 2
    H: int = 8
    lengths: bool = False
    segments: bool = False
    sinks: bool = False
    bias: bool = False  # attnlib's flex kernel: a per-example, per-head bias (with its gradient)
    alibi: bool = False  # attnlib's flex kernel: a `score_mod` with a per-head `score_mod_args` (with its gradient)


CASES = {
    c.name: c
    for c in [
        Case("gqa_causal", {"is_causal": True}, N=8, K=2),
        Case("gqa_sinks", {"is_causal": True}, N=8, K=2, T=11, S=7, sinks=True),
        Case("gqa_window", {"local_window_size": (3, 2)}, N=8, K=4),
        Case("segments", {"is_causal": True}, T=12, S=12, segments=True),
        Case("lengths", {"is_causal": True}, lengths=True),
        Case("mqa_groups_split", {"is_causal": True}, N=4, K=1),
        Case("flex_bias_window", {"local_window_size": (3, 2)}, N=8, K=2, T=12, S=10, bias=True),
        Case("flex_alibi_segments", {"is_causal": True}, T=12, S=12, segments=True, alibi=True),
        Case("flex_dropout", {"is_causal": True, "dropout_rate": 0.3, "dropout_key": jax.random.key(4)}, N=8, K=2),
    ]
}

FLEX_IMPL = attnlib.PallasTpu(interpret=True, flex_blocks=(8, 8))
"""attnlib's flex kernel (where splash declines) with small tiles, so that each shard runs several."""


def alibi(score, batch, head, q_idx, kv_idx, slope):
    """ALiBi, plus terms in the batch row and head (global indices on every shard)."""
    shift = 0.1 * batch.astype(jnp.float32) - 0.05 * head.astype(jnp.float32)
    return score + slope * (kv_idx - q_idx).astype(jnp.float32) + shift


def make_inputs(case: Case, seed: int = 0) -> tuple[dict, dict]:
    """(differentiable arrays, the rest) of a case."""
    r = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape), DTYPE)  # noqa: E731
    B, T, S = case.B, case.T, case.S
    diff = {"query": arr(B, T, case.N, case.H), "key": arr(B, S, case.K, case.H), "value": arr(B, S, case.K, case.H)}
    rest = {}
    if case.sinks:
        diff["sinks"] = jnp.asarray(r.standard_normal(case.N), jnp.float32)
    if case.bias:
        diff["bias"] = arr(B, case.N, T, S)
    if case.alibi:
        diff["slopes"] = arr(case.N, 1, 1)
    if case.segments:
        rest["q_segment_ids"] = jnp.asarray([[1] * 5 + [2] * 7, [3] * 9 + [0] * 3] * 2, jnp.int32)
    if case.lengths:
        rest["query_seq_lengths"] = jnp.asarray([7, 3, 0, 5], jnp.int32)
        rest["key_value_seq_lengths"] = jnp.asarray([11, 2, 6, 9], jnp.int32)
    rest["d_out"] = arr(B, T, case.N, case.H)
    rest["d_lse"] = arr(B, T, case.N)
    return diff, rest


def program(case: Case):
    """The jitted value-and-gradients of `sum(out * d_out) + sum(finite lse * d_lse)`, with `(out, lse)`."""

    def loss(diff, rest):
        kwargs = {k: v for k, v in rest.items() if k not in ("d_out", "d_lse")}
        if case.alibi:
            kwargs.update(score_mod=alibi, score_mod_args=(diff["slopes"],))
        flex = case.bias or case.alibi or "dropout_rate" in case.kwargs
        out, lse = attnlib.attention(
            diff["query"], diff["key"], diff["value"], diff.get("bias"), implementation=FLEX_IMPL if flex else IMPL,
            return_residual=True, **case.kwargs, sinks=diff.get("sinks"), **kwargs,
        )  # fmt: skip
        total = jnp.sum(out * rest["d_out"]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * rest["d_lse"])
        return total, (out, lse)

    diff, rest = make_inputs(case)
    return jax.jit(jax.value_and_grad(loss, has_aux=True)), diff, rest


def sharding_of(name: str, x: jax.Array, m: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Batch over `data`; heads over `model` where they divide (MQA: the one kv head stays whole)."""
    spec: list = [None] * x.ndim
    spec[0] = "data"
    heads = {"query": 2, "key": 2, "value": 2, "d_out": 2, "d_lse": 2, "bias": 1}
    if name == "sinks":  # `[N]`: heads over `model`, no batch
        return jax.sharding.NamedSharding(m, P("model"))
    if name == "slopes":  # `[N, 1, 1]`: replicated
        return jax.sharding.NamedSharding(m, P())
    if name in heads and x.shape[heads[name]] % MESH_SHAPE[1] == 0:
        spec[heads[name]] = "model"
    return jax.sharding.NamedSharding(m, P(*spec))


def place(tree: dict, m) -> dict:
    return {k: jax.device_put(v, sharding_of(k, v, m)) for k, v in tree.items()}


def all_gathers(compiled_text: str) -> int:
    return len(re.findall(r"\ball-gather(?:-start)?\(", compiled_text))


def compare(actual, expected) -> None:
    (_, (out, lse)), grads = actual
    (_, (out_ref, lse_ref)), grads_ref = expected
    assert_out_close(out, out_ref, DTYPE)
    assert_lse_close(lse, lse_ref, DTYPE)
    for name in grads_ref:
        assert_grad_close(grads[name], grads_ref[name], DTYPE, what=f"d{name}")


FAST = {"gqa_sinks", "segments", "flex_bias_window", "flex_alibi_segments", "flex_dropout"}
"""The cases of the fast tier; the rest are `full`. `gqa_sinks` is GQA and causal (T > S) with sinks split over
`model`; the causal GQA case with T < S (`gqa_causal`) also runs in the fast tier, resharded, in
`test_sequence_split_is_resharded_with_one_log_line`."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else (pytest.mark.full,)) for n in CASES])
def test_sharded_equals_unsharded_without_all_gathers(name):
    case = CASES[name]
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    m = mesh()
    diff_s, rest_s = place(diff, m), place(rest, m)
    compiled = fn.lower(diff_s, rest_s).compile()
    text = compiled.as_text()
    assert all_gathers(text) == 0, text
    compare(compiled(diff_s, rest_s), expected)


@pytest.mark.full
def test_all_gathers_without_the_rule(monkeypatch):
    """The same program with splash's calls unpartitioned (no rule): XLA gathers their operands."""
    case = CASES["gqa_causal"]
    m = mesh()
    monkeypatch.setattr(partitioning, "call", lambda fn, signature, operands: fn(*operands))
    fn, diff, rest = program(case)
    diff_s, rest_s = place(diff, m), place(rest, m)
    assert all_gathers(fn.lower(diff_s, rest_s).compile().as_text()) >= 3  # q, k, v at least


def test_sequence_split_is_resharded_with_one_log_line(caplog):
    case = dataclasses.replace(CASES["gqa_causal"], T=8)
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    m = mesh()
    sequence = jax.sharding.NamedSharding(m, P("data", "model", None, None))
    diff_s = dict(diff, query=jax.device_put(diff["query"], sequence))
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        compiled = fn.lower(diff_s, rest).compile()
    messages = [r.getMessage() for r in caplog.records if "gathers" in r.getMessage()]
    assert len(messages) == 1, messages  # the forward's and the backward's calls: one line
    assert "pallas_tpu" in messages[0] and "q dim 2 (t) over ['model']" in messages[0], messages
    compare(compiled(diff_s, rest), expected)


def _paged_decode(monkeypatch) -> tuple[jax.Array, jax.Array, list]:
    """`(unsharded out, sharded out, the query shapes the kernel's stand-in was traced with)` of a decode under `jit`
    with batch over `data`, query heads and the pools' key/value heads over `model`; asserts no all-gather."""
    from helpers import paged_decode_stand_in

    from attnlib._src.backends.pallas_tpu import paged

    traced: list = []
    on_a_simulated_tpu(monkeypatch)
    monkeypatch.setattr(paged, "decode_kernel", paged_decode_stand_in(traced))
    r = np.random.default_rng(3)
    B, N, K, H, pages, page_size, per_seq = 4, 8, 2, 24, 19, 16, 2
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    q, k_pool, v_pool = arr(B, 1, N, H), arr(pages, page_size, K, H), arr(pages, page_size, K, H)
    table = jnp.asarray(r.permutation(pages)[: B * per_seq].reshape(B, per_seq), jnp.int32)
    lengths = jnp.asarray([5, 24, 0, 17], jnp.int32)
    fn = jax.jit(
        lambda q, k, v, table, lengths: attnlib.attention(
            q, k, v, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
            diagonal_alignment="bottom_right", logits_soft_cap=3.0, implementation=attnlib.PallasTpu(),
        )  # fmt: skip
    )
    expected = fn(q, k_pool, v_pool, table, lengths)
    m = mesh()
    put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(m, P(*spec)))  # noqa: E731
    args = (
        put(q, "data", None, "model"), put(k_pool, None, None, "model"), put(v_pool, None, None, "model"),
        put(table, "data"), put(lengths, "data"),
    )  # fmt: skip
    compiled = fn.lower(*args).compile()
    assert all_gathers(compiled.as_text()) == 0, compiled.as_text()
    return expected, compiled(*args), traced


def test_paged_decode_partitions_over_batch_and_heads(monkeypatch):
    """The paged decode call under `jit`: each shard runs the kernel on its own batch row and its 4 of the 8 query
    heads (the local shape the kernel is traced with), no all-gather, equal to the unsharded call. The call as on a
    TPU (`PallasTpu()`, not interpret mode), with a plain-JAX stand-in with the kernel's contract in the kernel's
    place (`tests/test_pallas_tpu_paged.py` checks the stand-in against the kernel); the kernel itself, interpreted:
    `test_paged_decode_in_interpret_mode_partitions`."""
    expected, sharded, traced = _paged_decode(monkeypatch)
    assert (1, 4, 128) in traced, traced
    np.testing.assert_array_equal(np.asarray(sharded, np.float32), np.asarray(expected, np.float32))


def test_paged_decode_without_the_rule_runs_whole(monkeypatch):
    """With the call unpartitioned, the stand-in is traced with the whole batch and all heads only: the local shapes
    above come from attnlib's rule."""
    monkeypatch.setattr(partitioning, "call", lambda fn, signature, operands: fn(*operands))
    _, _, traced = _paged_decode(monkeypatch)
    assert set(traced) == {(4, 8, 128)}, traced


def test_paged_decode_in_interpret_mode_partitions(monkeypatch):
    """JAX's paged-attention kernel itself, in interpret mode (Pallas's HLO interpreter: no callbacks, so the call
    partitions as on a TPU), under `jit` with batch over `data` and heads over `model`: each shard's kernel runs on
    its batch rows and heads, no all-gather, the same numbers as the unsharded call."""
    from attnlib._src.backends.pallas_tpu import paged

    traced: list = []
    kernel = paged.decode_kernel

    def recorded(query, *args, **kwargs):
        traced.append(query.shape)
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(paged, "decode_kernel", recorded)
    r = np.random.default_rng(5)
    B, N, K, H, pages, page_size, per_seq = 4, 4, 2, 24, 13, 8, 3
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    q, k_pool, v_pool = arr(B, 1, N, H), arr(pages, page_size, K, H), arr(pages, page_size, K, H)
    table = jnp.asarray(r.permutation(pages)[: B * per_seq].reshape(B, per_seq), jnp.int32)
    lengths = jnp.asarray([5, 24, 0, 17], jnp.int32)
    fn = jax.jit(
        lambda q, k, v, table, lengths: attnlib.attention(
            q, k, v, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
            diagonal_alignment="bottom_right", implementation=IMPL,
        )  # fmt: skip
    )
    expected = fn(q, k_pool, v_pool, table, lengths)
    m = mesh()
    put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(m, P(*spec)))  # noqa: E731
    args = (
        put(q, "data", None, "model"), put(k_pool, None, None, "model"), put(v_pool, None, None, "model"),
        put(table, "data"), put(lengths, "data"),
    )  # fmt: skip
    traced.clear()
    compiled = fn.lower(*args).compile()
    assert all_gathers(compiled.as_text()) == 0, compiled.as_text()
    assert (1, 2, 128) in traced, traced  # one batch row and 2 of the 4 query heads per shard
    np.testing.assert_array_equal(np.asarray(compiled(*args), np.float32), np.asarray(expected, np.float32))


# ------------------------------------------------------------------------------------------------------------------
# serving on a mesh: a ragged step (prefill chunks and decodes) on a "combined" cache split over its key/value heads


@dataclasses.dataclass(frozen=True)
class Serving:
    """A cache of `prefix` tokens per sequence, then one step: `chunk[b]` new tokens per sequence appended and
    queried (packed THD, rows past the last sequence are padding)."""

    name: str
    N: int = 8
    K: int = 2
    H: int = 40
    prefix: tuple[int, ...] = (5, 17, 0, 9)
    chunk: tuple[int, ...] = (3, 1, 6, 0)
    padding_rows: int = 2
    page_size: int = 16
    num_pages: int = 11
    pages_per_seq: int = 2


SERVING = {
    s.name: s
    for s in [
        Serving("gqa"),  # 2 of the 8 query heads' groups, 1 of the 2 key/value heads (its key and value) per shard
        Serving("mqa", N=4, K=1),  # one key/value head: the groups split, every shard reads the whole pool
        Serving("untileable", N=24, K=24, H=8),  # 12 kv heads a shard: the kernel cannot tile them, heads whole
    ]
}


def serving_inputs(case: Serving):
    """`(cache, q [T, N, H], k_new, v_new [T, K, H], cu_seqlens [B + 1])`: the cache holds the prefix."""
    r = np.random.default_rng(11)
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    B, T = len(case.prefix), sum(case.chunk) + case.padding_rows
    cache = attnlib.PagedKVCache.create(
        B, case.num_pages, case.page_size, case.K, case.H, max_pages_per_seq=case.pages_per_seq, layout="combined"
    )
    width = max(case.prefix)
    cache = cache.append(arr(B, width, case.K, case.H), arr(B, width, case.K, case.H),
                         lengths=jnp.asarray(case.prefix, jnp.int32))  # fmt: skip
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(case.chunk)]), jnp.int32)
    return cache, arr(T, case.N, case.H), arr(T, case.K, case.H), arr(T, case.K, case.H), cu


def serving_step(cache, q, k_new, v_new, cu):
    """One serving step: append the step's keys and values, then attend (each sequence's new queries see its
    cache, bottom-right causal)."""
    cache = cache.append(k_new, v_new, cu_seqlens=cu)
    return cache.attend(q, cu_seqlens_q=cu, implementation=attnlib.PallasTpu()), cache


def shard_cache(cache, m: jax.sharding.Mesh, kv_heads: int):
    """The cache with its pools split over `model` along their key/value-head axis (axis 2 of a 4-d pool: `2K`
    combined, or `K`) where the key/value heads divide, everything else replicated; chosen per leaf by its shape,
    whatever the cache's field names."""

    def sharding(x):
        split = x.ndim == 4 and kv_heads % MESH_SHAPE[1] == 0
        return jax.sharding.NamedSharding(m, P(None, None, "model") if split else P())

    return jax.tree.map(lambda x: jax.device_put(x, sharding(x)), cache)


def _serving_on_a_mesh(monkeypatch, case: Serving):
    """`(unsharded out, sharded out and cache, compiled text, the (q, pool) shapes the kernel was traced with: the
    unsharded call's, and each shard's where the call is partitioned)` of `serving_step` under `jit`, with the query
    heads, the new keys and values and the pools split over `model`.

    JAX 0.10.2's interpreters cannot run the ragged kernel (TPU interpret mode: it reshapes a VMEM ref; the HLO
    interpreter fails discharging one of its ref stores: `'TypedInt' object has no attribute 'shape'`), so a
    plain-JAX stand-in with the kernel's contract (`helpers.ragged_paged_stand_in`, checked against the reference in
    `tests/test_paged_serving.py`) takes its place, on a simulated TPU (`PallasTpu()`)."""
    from helpers import ragged_paged_stand_in

    from attnlib._src.backends.pallas_tpu import ragged

    traced: list = []
    stand_in = ragged_paged_stand_in()

    def recorded(q, pool, *args, **kwargs):
        traced.append((q.shape, pool.shape))
        return stand_in(q, pool, *args, **kwargs)

    on_a_simulated_tpu(monkeypatch)
    monkeypatch.setattr(ragged, "ragged_kernel", recorded)
    cache, q, k_new, v_new, cu = serving_inputs(case)
    fn = jax.jit(lambda *args: serving_step(*args))  # a new function: traced again, with this test's patches
    expected, _ = fn(cache, q, k_new, v_new, cu)
    m = mesh()
    heads = jax.sharding.NamedSharding(m, P(None, "model") if case.K % MESH_SHAPE[1] == 0 else P())
    q_heads = jax.sharding.NamedSharding(m, P(None, "model"))
    args = (shard_cache(cache, m, case.K), jax.device_put(q, q_heads), jax.device_put(k_new, heads),
            jax.device_put(v_new, heads), cu)  # fmt: skip
    compiled = fn.lower(*args).compile()
    out, new_cache = compiled(*args)
    return expected, out, new_cache, compiled.as_text(), traced


def test_ragged_serving_step_splits_the_heads(monkeypatch):
    """Tensor parallelism: each shard's kernel call reads its 4 query heads and its key/value head's pair of pool
    slots (`[P, page, 2, D']`), the step (append included) has no all-gather, the cache stays split, and the output
    equals the unsharded step's."""
    expected, out, cache, text, traced = _serving_on_a_mesh(monkeypatch, SERVING["gqa"])
    T = expected.shape[0]
    assert ((T, 4, 128), (11, 16, 2, 128)) in traced, traced
    assert all_gathers(text) == 0, text
    assert out.sharding.spec == P(None, "model")
    (pool,) = [x for x in jax.tree.leaves(cache) if x.ndim == 4]
    assert pool.sharding.spec == P(None, None, "model")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


@pytest.mark.full
def test_ragged_serving_step_with_one_kv_head_splits_the_groups(monkeypatch):
    expected, out, _, text, traced = _serving_on_a_mesh(monkeypatch, SERVING["mqa"])
    assert ((expected.shape[0], 2, 128), (11, 16, 2, 128)) in traced, traced
    assert all_gathers(text) == 0, text
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_ragged_heads_the_kernel_cannot_tile_stay_whole(monkeypatch, caplog):
    """24 key/value heads over 2 shards would give each 12, which the kernel cannot tile (`ragged._kv_heads_tile`):
    the call runs on all heads, XLA gathers the split operands, one warning says so, and the output is right."""
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        expected, out, _, text, traced = _serving_on_a_mesh(monkeypatch, SERVING["untileable"])
    assert {shapes[0][1] for shapes in traced} == {24}, traced
    messages = [r.getMessage() for r in caplog.records if "ragged paged-attention" in r.getMessage()]
    assert len(messages) == 1 and "combined_pool dim 2 (k pair) over ['model']" in messages[0], messages
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_ragged_serving_step_without_the_rule_runs_whole(monkeypatch):
    """With the call unpartitioned, the kernel's stand-in is traced with all heads and the whole pool only: the local
    shapes above come from attnlib's rule. (XLA splits the plain-JAX stand-in by itself; the Mosaic kernel's call it
    would gather, as `test_all_gathers_without_the_rule` shows for splash.)"""
    monkeypatch.setattr(partitioning, "call", lambda fn, signature, operands, kv_heads_ok=None: fn(*operands))
    expected, out, _, _, traced = _serving_on_a_mesh(monkeypatch, SERVING["gqa"])
    assert {shapes for shapes in traced} == {((expected.shape[0], 8, 128), (11, 16, 4, 128))}, traced
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


# ------------------------------------------------------------------------------------------------------------------
# The ways a program shows its mesh (`mesh_call`, `unseen_mesh`): each equal to the unsharded call


MODES = ("explicit", "callbacks_unreached", "unseen")
"""`explicit`: a mesh with explicit axes under `jax.set_mesh` (every kernel call a `shard_map` with the caller's
layout); `callbacks_unreached`: a plain mesh and `NamedSharding` arguments on a platform whose compiler never calls
`custom_partitioning` back (a TPU: here the CPU made one of them), so each call is a `shard_map` with attnlib's own
layout; `unseen`: `jit(..., in_shardings=...)` on unsharded arguments there, so each call is lowered through Pallas's
HLO interpreter."""


def _on_jax_0_12(mode: str) -> tuple:
    """JAX 0.12: `unseen_mesh` is not reached (`unseen_mesh.REACHABLE`), and under explicit axes the caller's mesh
    reaches the kernels' `custom_partitioning` callbacks on CPU devices (not yet adapted)."""
    if jax.__version_info__ < (0, 12) or mode == "callbacks_unreached":
        return ()
    return (pytest.mark.xfail(strict=False, reason=f"{mode} on JAX 0.12: " + (_on_jax_0_12.__doc__ or "")),)


EACH_WAY_FAST = {("gqa_sinks", "explicit"), ("flex_alibi_segments", "callbacks_unreached"), ("flex_dropout", "unseen")}
"""One case of each way in the fast tier (splash, the flex kernel with a gradient through `score_mod_args`, dropout);
the rest are `full`."""


@pytest.mark.parametrize(
    "name, mode",
    [
        pytest.param(n, m, marks=(() if (n, m) in EACH_WAY_FAST else (pytest.mark.full,)) + _on_jax_0_12(m))
        for n in ("gqa_sinks", "mqa_groups_split", "flex_alibi_segments", "flex_dropout")
        for m in MODES
    ],
)
def test_each_way_of_showing_the_mesh_equals_the_unsharded_call(name, mode, monkeypatch, caplog):
    from attnlib._src import logs
    from attnlib._src.backends.pallas_tpu import mesh_call

    monkeypatch.setattr(logs, "_logged", set())  # the warning is logged once per process: forget earlier cases'
    case = CASES[name]
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    if mode == "explicit":
        m = jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
        with jax.set_mesh(m):
            diff_s, rest_s = place(diff, m), place(rest, m)
            compiled = fn.lower(diff_s, rest_s).compile()
            actual = compiled(diff_s, rest_s)
        (_, (out, lse)), _ = actual
        q_spec = tuple(sharding_of("query", diff["query"], m).spec)
        assert tuple(jax.typeof(out).sharding.spec) == q_spec[:3] + (None,)
        assert tuple(jax.typeof(lse).sharding.spec) == q_spec[:3]
    else:
        monkeypatch.setattr(mesh_call, "PLATFORMS_WITHOUT_CALLBACKS", ("tpu", "cpu"))
        m = mesh()
        if mode == "callbacks_unreached":
            diff_s, rest_s = place(diff, m), place(rest, m)
            compiled = fn.lower(diff_s, rest_s).compile()
        else:
            shardings = ({k: sharding_of(k, v, m) for k, v in diff.items()},
                         {k: sharding_of(k, v, m) for k, v in rest.items()})  # fmt: skip
            jitted = jax.jit(fn.__wrapped__ if hasattr(fn, "__wrapped__") else fn, in_shardings=shardings)
            diff_s, rest_s = diff, rest
            with caplog.at_level(logging.WARNING, logger="attnlib"):
                compiled = jitted.lower(diff, rest).compile()
            assert any("HLO interpreter" in r.getMessage() for r in caplog.records)
        actual = compiled(diff_s, rest_s)
    text = compiled.as_text()
    if mode != "unseen":  # at most a per-head parameter's gradient (ALiBi's slopes), never q, k, v or their gradients
        gathered = [int(np.prod([int(d) for d in shape.split(",") if d])) for shape in re.findall(
            r"= \w+\[([\d,]*)\][^ ]* all-gather(?:-start)?\(", text)]  # fmt: skip
        assert all(size <= case.N for size in gathered), gathered
    compare(actual, expected)
