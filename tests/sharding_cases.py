"""Sharded inputs under `jit` on 8 simulated CPU devices: the real cuDNN graph call partitioned by attnlib's rule.

Not collected by a plain `pytest` run: `tests/test_sharding.py` runs this file in a subprocess with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX starts). Run it directly with:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/sharding_cases.py

`implementation="cudnn"` runs through the real `jax.ffi.ffi_call` of `attnlib_cudnn_graph` inside attnlib's
`custom_partitioning` (`cpu_graph.py`: a test-only CPU handler runs each call with the emulated graph of its spec),
so the compiled program is the one XLA partitions on GPUs. Every case compiles the forward and the gradients with
batch over a `data` axis and heads over a `model` axis (mesh 4 x 2), counts the all-gathers in the compiled HLO
(none), and compares out, lse and every gradient with the unsharded call at the dtype's tolerances (`helpers.py`).

The same cases (and an FP8 forward) run again with JAX's explicit sharding (`AxisType.Explicit` axes under
`jax.set_mesh`, `test_explicit_axes_*`): the results must also carry the operands' shardings in their types. Before
the cuDNN implementation ran its layout work under `jax.sharding.auto_axes` (`mesh_visibility.with_automatic_axes`),
the graph calls still partitioned, but their results (a `jax.ffi.ffi_call`'s) were typed replicated: forward-only
programs all-gathered out and lse onto every device, and gradients failed to trace (the custom VJP's cotangent of lse
typed replicated, its reference lse split).
"""

import contextlib
import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close

import attnlib
import attnlib.equinox
import attnlib.haiku
from attnlib._src import logs
from attnlib._src.backends.cudnn import partitioning


# The CPU model of the graph runs JAX inside the handler: with asynchronous CPU dispatch its work would queue behind
# the very program that waits for it (read when the CPU backend starts: before anything asks for devices).
jax.config.update("jax_cpu_enable_async_dispatch", False)

if jax.device_count() < 8:
    raise RuntimeError(
        f"tests/sharding_cases.py needs 8 devices, got {jax.device_count()}: run it with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_sharding.py does)."
    )

import cpu_graph  # noqa: E402 (after the dispatch setting)


P = jax.sharding.PartitionSpec
DTYPE = jnp.bfloat16
MESH_SHAPE = (4, 2)


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def explicit_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(MESH_SHAPE, ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def spec_of(x: jax.Array) -> tuple:
    """The partition spec in `x`'s type, one entry per dim (None: whole)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return tuple(e or None for e in spec + (None,) * (x.ndim - len(spec)))


@pytest.fixture(autouse=True)
def real_graph_call(monkeypatch):
    cpu_graph.install(monkeypatch)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    B: int = 4
    T: int = 7
    S: int = 11
    N: int = 6
    K: int = 2
    H: int = 16
    Hv: int = 8
    sinks: bool = False
    lengths: bool = False
    bias: tuple[int, int] | None = None  # (batch dim, head dim) of a [b, n, T, S] bias
    layout: str = "dense"  # "dense", "thd" (cu_seqlens), "segments" (packed rows), "paged"
    split: P = P("data", None, "model", None)
    grads: bool = True


CASES = {
    c.name: c
    for c in [
        Case("causal", {"is_causal": True}),
        Case("gqa_window_sinks", {"local_window_size": (3, 2)}, N=10, K=2, sinks=True),
        Case("mqa_causal_sinks", {"is_causal": True}, N=4, K=1, sinks=True),
        Case("padding_lengths", {"is_causal": True}, lengths=True),
        Case("bias_shared_over_batch", {}, bias=(1, 6)),
        Case("bias_shared_over_heads", {"is_causal": True}, bias=(4, 1)),
        Case("soft_cap_modifier", {"logits_soft_cap": 4.0, "is_causal": True}),
        Case("bottom_right", {"is_causal": True, "diagonal_alignment": "bottom_right"}, lengths=True),
        # THD and packed rows: one ragged graph over packed tokens, whose split is the heads (partitioning.py)
        Case("thd_heads", {"is_causal": True}, layout="thd", split=P(None, "model", None)),
        Case("segments_heads", {"is_causal": True}, layout="segments", B=2, T=12, S=12,
             split=P(None, None, "model", None)),
        Case("paged", {"is_causal": True, "diagonal_alignment": "bottom_right"}, T=3, layout="paged", grads=False),
    ]
}


def make_inputs(case: Case, seed: int = 0) -> tuple[dict, dict]:
    """(differentiable arrays, the rest) of a case."""
    r = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape), DTYPE)  # noqa: E731
    B, T, S = case.B, case.T, case.S
    if case.layout == "thd":
        diff = {"query": arr(13, case.N, case.H), "key": arr(17, case.K, case.H), "value": arr(17, case.K, case.Hv)}
        rest = {"cu_seqlens_q": jnp.asarray([0, 5, 5, 13], jnp.int32), "cu_seqlens_kv": jnp.asarray([0, 9, 11, 17],
                jnp.int32), "max_seqlen_q": 8, "max_seqlen_kv": 9}  # fmt: skip
    else:
        diff = {"query": arr(B, T, case.N, case.H), "key": arr(B, S, case.K, case.H),
                "value": arr(B, S, case.K, case.Hv)}  # fmt: skip
        rest = {}
    if case.layout == "segments":
        rest["q_segment_ids"] = jnp.asarray([[1] * 5 + [2] * 7, [3] * 9 + [0] * 3], jnp.int32)
        rest["max_segments_per_row"] = 2
    if case.layout == "paged":
        page, pages_per_seq, pool = 4, 3, 13
        table = r.permutation(pool)[: B * pages_per_seq].reshape(B, pages_per_seq)
        diff = {"query": diff["query"], "key": arr(pool, page, case.K, case.H), "value": arr(pool, page, case.K,
                case.Hv)}  # fmt: skip
        rest["page_table"] = jnp.asarray(table, jnp.int32)
        rest["key_value_seq_lengths"] = jnp.asarray([11, 4, 9, 12], jnp.int32)
    if case.sinks:
        diff["sinks"] = jnp.asarray(r.standard_normal(case.N), jnp.float32)
    if case.lengths:
        rest["query_seq_lengths"] = jnp.asarray([7, 3, 0, 5], jnp.int32)
        rest["key_value_seq_lengths"] = jnp.asarray([11, 2, 6, 9], jnp.int32)
    if case.bias is not None:
        diff["bias"] = arr(case.bias[0], case.bias[1], T, S)
    q = diff["query"]
    rest["d_out"] = jnp.asarray(r.standard_normal(q.shape[:-1] + (case.Hv,)), jnp.float32)
    rest["d_lse"] = jnp.asarray(r.standard_normal(q.shape[:-1]), jnp.float32)
    return diff, rest


STATIC = ("max_seqlen_q", "max_seqlen_kv", "max_segments_per_row")


def loss_fn(case: Case, static: dict):
    """`(sum(out * d_out) + sum(finite lse * d_lse), (out, lse))` of `attnlib.attention`."""

    def loss(diff, rest):
        kwargs = {k: v for k, v in rest.items() if k not in ("d_out", "d_lse")}
        out, lse = attnlib.attention(
            diff["query"], diff["key"], diff["value"], bias=diff.get("bias"), sinks=diff.get("sinks"),
            implementation="cudnn", return_residual=True, **case.kwargs, **kwargs, **static,
        )  # fmt: skip
        total = jnp.sum(out.astype(jnp.float32) * rest["d_out"])
        total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * rest["d_lse"])
        return total, (out, lse)

    return loss


def program(case: Case):
    """The jitted forward (out, lse) or, for differentiable layouts, value-and-gradients of a case."""
    diff, rest = make_inputs(case)
    static = {k: rest.pop(k) for k in STATIC if k in rest}
    loss = loss_fn(case, static)
    fn = jax.value_and_grad(loss, has_aux=True) if case.grads else (lambda d, r: loss(d, r)[1])
    return jax.jit(fn), diff, rest


def sharding_of(case: Case, name: str, x: jax.Array, m: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
    """Batch over `data`, heads over `model`, as the case's query split says; everything else follows its dims."""
    data, model = case.split[0], case.split[-2]
    heads_dim = {"query": -2, "key": -2, "value": -2, "d_out": -2, "d_lse": -1, "sinks": 0}
    spec = [None] * x.ndim
    if name in ("key", "value") and case.layout == "paged":
        spec[2] = model  # the page pool: heads only
    elif name in heads_dim and x.shape[heads_dim[name]] % MESH_SHAPE[1] == 0:  # MQA: the one kv head stays whole
        spec[heads_dim[name] % x.ndim] = model
    batched = ("query", "key", "value", "d_out", "d_lse", "query_seq_lengths", "key_value_seq_lengths",
               "page_table", "q_segment_ids")  # fmt: skip
    if data is not None and case.layout != "thd" and name in batched and not (case.layout == "paged" and name in (
            "key", "value")):  # fmt: skip
        spec[0] = data
    if name == "bias":
        spec[0] = data if x.shape[0] == case.B else None
        spec[1] = model if x.shape[1] == case.N else None
    return jax.sharding.NamedSharding(m, P(*spec))


def place(case: Case, tree: dict, m) -> dict:
    return {k: jax.device_put(v, sharding_of(case, k, v, m)) for k, v in tree.items()}


def all_gathers(compiled_text: str) -> int:
    return len(re.findall(r"\ball-gather(?:-start)?\(", compiled_text))


def compare(case: Case, actual, expected) -> None:
    if case.grads:
        (_, (out, lse)), grads = actual
        (_, (out_ref, lse_ref)), grads_ref = expected
        for name in grads_ref:
            assert_grad_close(grads[name], grads_ref[name], grads_ref[name].dtype, what=f"d{name}")
    else:
        (out, lse), (out_ref, lse_ref) = actual, expected
    assert_out_close(out, out_ref, DTYPE)
    assert_lse_close(lse, lse_ref, DTYPE)


FAST = {"gqa_window_sinks", "padding_lengths", "bias_shared_over_batch", "soft_cap_modifier", "thd_heads",
        "segments_heads", "paged"}  # fmt: skip
"""The cases of the fast tier: one per layout and per kind of operand the rule splits; the rest are `full`."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else (pytest.mark.full,)) for n in CASES])
def test_sharded_equals_unsharded_without_all_gathers(name):
    case = CASES[name]
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    m = mesh()
    diff_s, rest_s = place(case, diff, m), place(case, rest, m)
    compiled = fn.lower(diff_s, rest_s).compile()
    assert all_gathers(compiled.as_text()) == 0, compiled.as_text()
    compare(case, compiled(diff_s, rest_s), expected)


def test_all_gathers_without_the_rule(monkeypatch):
    """The same program with the graph call unpartitioned (no rule): XLA replicates its operands."""
    case = CASES["gqa_window_sinks"]
    fn, diff, rest = program(case)
    m = mesh()
    diff_s, rest_s = place(case, diff, m), place(case, rest, m)
    assert all_gathers(fn.lower(diff_s, rest_s).compile().as_text()) == 0

    def unpartitioned(spec, entry, operands, tokens, raw, entry_of):
        return raw(spec, entry, *operands, tokens=tokens)

    monkeypatch.setattr(partitioning, "call", unpartitioned)
    fn, _, _ = program(case)
    assert all_gathers(fn.lower(diff_s, rest_s).compile().as_text()) >= 3  # q, k, v at least


def test_sequence_split_is_resharded_with_one_log_line(caplog):
    case = dataclasses.replace(CASES["causal"], T=8, split=P(None, "model", None, None))
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    m = mesh()
    sequence = jax.sharding.NamedSharding(m, P("data", "model", None, None))
    diff_s = dict(diff, query=jax.device_put(diff["query"], sequence))
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        compiled = fn.lower(diff_s, rest).compile()
    messages = [r.getMessage() for r in caplog.records if "gathers" in r.getMessage()]
    assert len(messages) == 1, messages  # the forward's and the backward's calls: one line
    assert "Q dim 1 (t) over ['model']" in messages[0] and "attnlib.context_parallel" in messages[0], messages
    compare(case, compiled(diff_s, rest), expected)


def test_dropout_call_is_kept_whole_with_one_log_line(monkeypatch, caplog):
    """A cuDNN dropout call is never split (a shard would draw another slice of cuDNN's mask): on the 4 x 2 mesh XLA
    gathers q, k and v, every graph is built for the global batch and heads, and one warning says why; the same call
    on one device says nothing."""
    monkeypatch.setattr(logs, "_logged", set())  # logged once per process: forget earlier tests' messages
    built = []
    monkeypatch.setattr(cpu_graph, "entry_for", lambda spec, real=cpu_graph.entry_for: built.append(spec) or real(spec))
    dropout = {"is_causal": True, "dropout_rate": 0.25, "dropout_key": jax.random.key(3)}
    case = dataclasses.replace(CASES["causal"], kwargs=dropout)
    fn, diff, rest = program(case)
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        fn.lower(place(case, diff, one), place(case, rest, one)).compile()
        assert not [r for r in caplog.records if "dropout" in r.getMessage()]
        m = mesh()
        compiled = fn.lower(place(case, diff, m), place(case, rest, m)).compile()
    assert all_gathers(compiled.as_text()) >= 3  # q, k, v at least
    assert {(s.direction, s.b, s.n, s.k) for s in built} == {("fwd", 4, 6, 2), ("bwd", 4, 6, 2)}, built
    messages = [r.getMessage() for r in caplog.records if "dropout" in r.getMessage()]
    assert len(messages) == 1, messages  # the forward's and the backward's calls: one line
    assert "Q dim 0 (b) over ['data']" in messages[0] and "xla_chunked" in messages[0], messages
    assert "context_parallel" not in messages[0], messages  # no sequence dim gathered (and it declines dropout)


def test_one_device_mesh_runs_the_unpartitioned_call():
    case = CASES["causal"]
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    one = jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])
    diff_s, rest_s = place(case, diff, one), place(case, rest, one)
    text = fn.lower(diff_s, rest_s).compile().as_text()
    assert "CustomSPMDPartitioning" not in text and text.count("attnlib_cudnn_graph") >= 2
    compare(case, fn(diff_s, rest_s), expected)


def test_local_graphs_have_the_local_batch_and_heads(monkeypatch):
    """Each shard's graph is built for its own batch (B / 4) and heads (N / 2, K / 2)."""
    built = []
    monkeypatch.setattr(cpu_graph, "entry_for", lambda spec, real=cpu_graph.entry_for: built.append(spec) or real(spec))
    case = CASES["causal"]
    fn, diff, rest = program(case)
    m = mesh()
    fn.lower(place(case, diff, m), place(case, rest, m)).compile()
    local = {(s.direction, s.b, s.n, s.k) for s in built}
    assert {("fwd", 1, 3, 1), ("bwd", 1, 3, 1)} <= local, local


# ------------------------------------------------------------------------------------------------------------------
# Layers: heads over the model axis (weights split by output / input features), batch over the data axis


AXES = [pytest.param(False, id="automatic"), pytest.param(True, id="explicit", marks=pytest.mark.full)]
"""The layers under automatic axes (fast tier) and explicit ones (`jax.set_mesh`; full tier)."""


def _layer_tp_check(apply, params, x, param_sharding, m, explicit=False):
    expected = jax.jit(apply)(params, x)
    with jax.set_mesh(m) if explicit else contextlib.nullcontext():
        params_s = jax.tree.map(lambda p, s: jax.device_put(p, s), params, param_sharding)
        x_s = jax.device_put(x, jax.sharding.NamedSharding(m, P("data", None, None)))
        compiled = jax.jit(apply).lower(params_s, x_s).compile()
        assert all_gathers(compiled.as_text()) == 0, compiled.as_text()
        out = compiled(params_s, x_s)
    if explicit:
        assert spec_of(out) == ("data", None, None), jax.typeof(out)
    assert_out_close(out, expected, DTYPE)


@pytest.mark.parametrize("explicit", AXES)
def test_equinox_layer_heads_over_model_axis(explicit):
    import equinox as eqx

    layer = attnlib.equinox.MultiheadAttention(
        num_heads=6, query_size=24, qk_size=16, vo_size=8, num_kv_heads=2, is_causal=True, implementation="cudnn",
        dtype=DTYPE, key=jax.random.key(0),
    )  # fmt: skip
    params, static = eqx.partition(layer, eqx.is_array)
    m = explicit_mesh() if explicit else mesh()

    def spec_of(path, p):
        name = jax.tree_util.keystr(path)
        if "output_proj" in name:
            return jax.sharding.NamedSharding(m, P(None, "model") if p.ndim == 2 else P())
        return jax.sharding.NamedSharding(m, P("model", None) if p.ndim == 2 else P("model"))

    shardings = jax.tree_util.tree_map_with_path(spec_of, params)

    def apply(params, x):
        model = eqx.combine(params, static)
        return jax.vmap(lambda s: model(s, s, s))(x)

    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 7, 24)), DTYPE)
    _layer_tp_check(apply, params, x, shardings, m, explicit)


@pytest.mark.parametrize("explicit", AXES)
def test_haiku_layer_heads_over_model_axis(explicit):
    import haiku as hk

    def forward(x):
        layer = attnlib.haiku.MultiHeadAttention(
            num_heads=6, key_size=16, value_size=8, model_size=24, num_kv_heads=2, is_causal=True,
            w_init=hk.initializers.VarianceScaling(1.0), implementation="cudnn",
        )  # fmt: skip
        return layer(x, x, x)

    model = hk.without_apply_rng(hk.transform(forward))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 7, 24)), DTYPE)
    params = jax.tree.map(lambda p: p.astype(DTYPE), model.init(jax.random.key(0), x))
    m = explicit_mesh() if explicit else mesh()

    def spec_of(path, p):
        name = jax.tree_util.keystr(path)
        if "linear" in name:
            return jax.sharding.NamedSharding(m, P("model", None) if p.ndim == 2 else P())
        return jax.sharding.NamedSharding(m, P(None, "model") if p.ndim == 2 else P("model"))

    _layer_tp_check(model.apply, params, x, jax.tree_util.tree_map_with_path(spec_of, params), m, explicit)


# ------------------------------------------------------------------------------------------------------------------
# Explicit axes ("sharding in types": `AxisType.Explicit` under `jax.set_mesh`): the same programs, the operands'
# shardings in their types. The results must carry them (out the query's spec with its head dim whole, lse the
# query's without its head dim, each gradient its primal's), compile with no all-gather, and equal the unsharded call.


def placed_spec(case: Case, name: str, x: jax.Array, m: jax.sharding.Mesh) -> tuple:
    spec = tuple(sharding_of(case, name, x, m).spec)
    return spec + (None,) * (x.ndim - len(spec))


def check_types(case: Case, actual, diff: dict, m: jax.sharding.Mesh) -> None:
    """`out` typed like the query (head dim whole), `lse` like the query without its head dim, each gradient like its
    primal."""
    if case.grads:
        (_, (out, lse)), grads = actual
        for name, g in grads.items():
            assert spec_of(g) == placed_spec(case, name, diff[name], m), (name, jax.typeof(g))
    else:
        out, lse = actual
    q_spec = placed_spec(case, "query", diff["query"], m)
    assert spec_of(out) == q_spec[:-1] + (None,), jax.typeof(out)
    assert spec_of(lse) == q_spec[:-1], jax.typeof(lse)


def fp8_graphs(monkeypatch) -> None:
    """The CPU model runs FP8 forward graphs too (`test_fp8_cudnn_emulated.emulate_fp8`; 16-bit graphs as before)."""
    from test_fp8_cudnn_emulated import emulate_fp8

    monkeypatch.setattr(cpu_graph, "emulate_graph", emulate_fp8)


EXPLICIT_CASES = {
    **CASES,
    "fp8_forward": Case("fp8_forward", {"fp8": "current", "is_causal": True}, Hv=16, grads=False),  # FP8: H == Hv
}

EXPLICIT_FAST = {"gqa_window_sinks", "padding_lengths", "thd_heads", "fp8_forward"}
"""The fast tier under explicit axes: GQA groups with sinks, per-batch lengths, a ragged graph's heads and the FP8
graph; the rest are `full`."""


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in EXPLICIT_FAST else (pytest.mark.full,)) for n in EXPLICIT_CASES]
)
def test_explicit_axes_keep_the_shardings_without_all_gathers(name, monkeypatch):
    """Under explicit axes each graph runs on its shard (built for the local batch and heads), no operand is
    gathered, the results carry the operands' shardings, and they equal the unsharded call's."""
    case = EXPLICIT_CASES[name]
    if case.kwargs.get("fp8"):
        fp8_graphs(monkeypatch)
    built = []
    monkeypatch.setattr(cpu_graph, "entry_for", lambda spec, real=cpu_graph.entry_for: built.append(spec) or real(spec))
    fn, diff, rest = program(case)
    expected = fn(diff, rest)
    m = explicit_mesh()
    with jax.set_mesh(m):
        diff_s, rest_s = place(case, diff, m), place(case, rest, m)
        built.clear()
        compiled = fn.lower(diff_s, rest_s).compile()
        assert all_gathers(compiled.as_text()) == 0, compiled.as_text()
        actual = compiled(diff_s, rest_s)
    check_types(case, actual, diff, m)
    compare(case, actual, expected)
    q_heads = diff["query"].shape[-2]
    local_heads = q_heads // 2 if case.K % 2 == 0 or q_heads % 2 == 0 else q_heads
    assert any(s.n == local_heads and s.n < q_heads for s in built), [(s.direction, s.b, s.n, s.k) for s in built]


def test_explicit_axes_dropout_call_is_kept_whole(monkeypatch, caplog):
    """A cuDNN dropout call is not split under explicit axes either: XLA gathers its operands (the unsharded call's
    mask on every device, logged once), and the results still carry the operands' shardings."""
    monkeypatch.setattr(logs, "_logged", set())
    built = []
    monkeypatch.setattr(cpu_graph, "entry_for", lambda spec, real=cpu_graph.entry_for: built.append(spec) or real(spec))
    dropout = {"is_causal": True, "dropout_rate": 0.25, "dropout_key": jax.random.key(3)}
    case = dataclasses.replace(CASES["causal"], kwargs=dropout)
    fn, diff, rest = program(case)
    m = explicit_mesh()
    with jax.set_mesh(m), caplog.at_level(logging.WARNING, logger="attnlib"):
        diff_s, rest_s = place(case, diff, m), place(case, rest, m)
        compiled = fn.lower(diff_s, rest_s).compile()
        # The CPU model draws no mask: run for the result types only, and wait for it (a program still running when
        # the process exits aborts it).
        actual = jax.block_until_ready(compiled(diff_s, rest_s))
    assert all_gathers(compiled.as_text()) >= 3  # q, k, v at least
    assert {(s.direction, s.b, s.n, s.k) for s in built} == {("fwd", 4, 6, 2), ("bwd", 4, 6, 2)}, built
    messages = [r.getMessage() for r in caplog.records if "dropout" in r.getMessage()]
    assert len(messages) == 1 and "Q dim 0 (b) over ['data']" in messages[0], messages
    check_types(case, actual, diff, m)
