"""`attnlib.PallasTpu` (splash attention) against the float64 reference, its declines and its dispatch.

On CPU the kernels run in Pallas interpret mode (`PallasTpu(interpret=True)`): the same kernels, block tables,
padding, segment ids and backward as on a TPU, executed by XLA:CPU. The `tpu`-marked tests run the same feature
groups on a real TPU, through `PallasTpu()` and through automatic dispatch (`implementation=None`, which `explain`
must report as `pallas_tpu`); their reference is computed on the host in NumPy float64 (a TPU's default matmul
precision is far below float32). Run them in one process: `python -m pytest -q -m tpu tests -p no:cacheprovider`.

Sizes are odd and distinct (and no multiple of 128: every case pads `T`, `S` and the head dims), small because
interpret mode is slow.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    GRAD_TOL,
    LSE_TOL,
    normal,
    on_a_simulated_tpu,
    OUT_TOL,
    rng,
    segment_ids_from_runs,
    to_f64,
    Tol,
)
from reference import reference_attention, reference_attention_vjp, visibility

import attnlib
from attnlib._src.backends.pallas_tpu import blocks
from attnlib._src.backends.pallas_tpu.implementation import TYPED_VARYING


@dataclasses.dataclass(frozen=True)
class Case:
    """One feature group: `batch`, sizes and the keyword arguments of `attnlib.attention` (arrays as NumPy)."""

    t: int = 37
    s: int = 53
    n: int = 6
    k: int = 2
    h: int = 8
    hv: int | None = None  # the value head dim: `h` unless given (MLA)
    batch: tuple[int, ...] = (2,)
    thd: bool = False
    kwargs: tuple = ()


def _seg(runs_per_row, total):
    return np.stack([segment_ids_from_runs(runs, total) for runs in runs_per_row])


def _sinks(n):
    """`[n]` sink logits of the size of the scores, so that the sink takes a visible share of every row."""
    return (1.3 * rng(13).standard_normal(n) + 0.4).astype(np.float32)


CASES = {
    "dense": Case(),
    "causal_top_left": Case(kwargs=(("is_causal", True),)),
    # T > S bottom-right: the first T - S rows see nothing (out 0, lse -inf).
    "causal_bottom_right": Case(t=53, s=37, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right"))),
    "window_two_sided": Case(kwargs=(("local_window_size", (5, 3)),)),
    "window_causal_bottom_right": Case(
        kwargs=(("local_window_size", (4, 2)), ("is_causal", True), ("diagonal_alignment", "bottom_right"))
    ),
    "segments_causal": Case(
        t=41, s=41,
        kwargs=(("q_segment_ids", _seg([[(3, 11), (1, 20), (2, 7)], [(5, 30), (2, 9)]], 41)), ("is_causal", True)),
    ),  # fmt: skip
    "segments_cross": Case(
        t=29, s=43,
        kwargs=(
            ("q_segment_ids", _seg([[(1, 10), (2, 15)], [(4, 29)]], 29)),
            ("kv_segment_ids", _seg([[(2, 20), (1, 13)], [(4, 9), (6, 30)]], 43)),
        ),
    ),
    "thd_causal": Case(
        t=47, s=47, batch=(), thd=True,
        kwargs=(("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)), ("is_causal", True)),
    ),  # fmt: skip
    "lengths_with_empty_rows": Case(
        kwargs=(
            ("query_seq_lengths", np.asarray([30, 0], np.int32)),
            ("key_value_seq_lengths", np.asarray([0, 41], np.int32)),
            ("is_causal", True),
        )
    ),
    "mqa": Case(n=5, k=1, kwargs=(("is_causal", True),)),
    "soft_cap_gqa": Case(n=6, k=3, kwargs=(("logits_soft_cap", 1.5), ("scale", 0.9))),
    "array_scale": Case(kwargs=(("scale", np.float32(0.41)),)),
    "head_dim_136": Case(h=136, n=2, k=1, kwargs=(("is_causal", True),)),
    # MLA: the query/key and value head dims pad to different lane counts (256 and 128, as DeepSeek's 192 / 128).
    "mla_causal_bottom_right": Case(
        t=41, s=53, n=4, k=2, h=136, hv=40, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right"))
    ),
    "mla_segments_sinks": Case(
        t=29, s=43, n=4, k=1, h=24, hv=136,
        kwargs=(
            ("q_segment_ids", _seg([[(1, 10), (2, 15)], [(4, 29)]], 29)),
            ("kv_segment_ids", _seg([[(2, 20), (1, 13)], [(4, 9), (6, 30)]], 43)),
            ("sinks", _sinks(4)),
        ),
    ),
    "sinks_dense": Case(kwargs=(("sinks", _sinks(6)),)),
    # T > S bottom-right: the first T - S rows see only the sink (out 0, lse = sink).
    "sinks_causal_bottom_right": Case(
        t=53, s=37, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right"), ("sinks", _sinks(6)))
    ),
    "sinks_segments_cross": Case(
        t=29, s=43,
        kwargs=(
            ("q_segment_ids", _seg([[(1, 10), (2, 15)], [(4, 29)]], 29)),
            ("kv_segment_ids", _seg([[(2, 20), (1, 13)], [(4, 9), (6, 30)]], 43)),
            ("sinks", _sinks(6)),
        ),
    ),
    "sinks_lengths_with_empty_rows": Case(
        kwargs=(
            ("query_seq_lengths", np.asarray([30, 0], np.int32)),
            ("key_value_seq_lengths", np.asarray([0, 41], np.int32)),
            ("is_causal", True),
            ("sinks", _sinks(6)),
        )
    ),
    "sinks_thd_causal": Case(
        t=47, s=47, batch=(), thd=True,
        kwargs=(("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)), ("is_causal", True), ("sinks", _sinks(6))),
    ),  # fmt: skip
    "sinks_gqa_window": Case(n=6, k=3, kwargs=(("local_window_size", (5, 3)), ("sinks", _sinks(6)))),
    "sinks_soft_cap_mqa": Case(n=5, k=1, kwargs=(("logits_soft_cap", 1.5), ("scale", 0.9), ("sinks", _sinks(5)))),
}


def _arrays(case: Case, dtype):
    r = rng(7)
    lead = case.batch
    q = normal(r, lead + (case.t, case.n, case.h), dtype)
    k = normal(r, lead + (case.s, case.k, case.h), dtype)
    v = normal(r, lead + (case.s, case.k, case.h if case.hv is None else case.hv), dtype)
    return q, k, v


def _kwargs(case: Case):
    kw = dict(case.kwargs)
    return {n: (jnp.asarray(x) if isinstance(x, np.ndarray | np.generic) else x) for n, x in kw.items()}


def _run(case: Case, dtype, implementation):
    """`(out, lse, (dq, dk, dv[, dsinks]), d_out, d_lse)` of one case: the VJP of `(out, lse)` with random
    cotangents (w.r.t. the sinks too when the case has them)."""
    q, k, v = _arrays(case, dtype)
    kw = _kwargs(case)
    sinks = kw.pop("sinks", None)

    def f(q, k, v, *sinks):
        kw_sinks = dict(sinks=sinks[0]) if sinks else {}
        return attnlib.attention(q, k, v, implementation=implementation, return_residual=True, **kw, **kw_sinks)

    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    (out, lse), vjp = jax.vjp(jax.jit(f), *primals)
    r = rng(11)
    d_out = normal(r, out.shape, dtype)
    d_lse = normal(r, lse.shape, jnp.float32)
    grads = jax.jit(vjp)((d_out, d_lse))
    return (q, k, v), out, lse, grads, d_out, d_lse


def _reference(case: Case, q, k, v, d_out, d_lse):
    """`(kw, args, ref_out, ref_lse, ref_grads)`: the float64 reference of one case's call and of its VJP (NumPy `kw`,
    float64 `args = (q, k, v)`)."""
    kw = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in _kwargs(case).items()}
    if "scale" in kw and isinstance(kw["scale"], np.ndarray):
        kw["scale"] = float(kw["scale"])
    if "cu_seqlens_q" in kw:
        kw.setdefault("cu_seqlens_kv", kw["cu_seqlens_q"])  # the reference spells the shared key structure out
    args = [to_f64(x) for x in (q, k, v)]
    ref_out, ref_lse = reference_attention(*args, **kw)
    empty = np.isinf(ref_lse)
    ref_grads = reference_attention_vjp(*args, d_out=to_f64(d_out), d_lse=np.where(empty, 0.0, to_f64(d_lse)), **kw)
    return kw, args, ref_out, ref_lse, ref_grads


def _check(case: Case, dtype, implementation, tolerance_dtype=None):
    """One case against the float64 reference, with `tolerance_dtype`'s tolerance (default: `dtype`'s)."""
    tol = dtype if tolerance_dtype is None else tolerance_dtype
    (q, k, v), out, lse, grads, d_out, d_lse = _run(case, dtype, implementation)
    kw, args, ref_out, ref_lse, ref_grads = _reference(case, q, k, v, d_out, d_lse)
    assert_out_close(out, ref_out, tol)
    assert_lse_close(lse, ref_lse, tol)
    empty = np.isinf(ref_lse)
    assert len(grads) == (3 if "sinks" not in kw else 4)
    for name, g in zip(("query", "key", "value", "sinks"), grads):
        assert g.dtype == (dtype if name != "sinks" else kw["sinks"].dtype)
        assert_grad_close(g, ref_grads[name], tol, what=f"d{name}")
    if empty.any():
        assert (np.asarray(to_f64(out))[empty] == 0).all(), "a row that sees nothing has a non-zero output"
        assert (np.asarray(to_f64(grads[0]))[empty] == 0).all(), "a row that sees nothing has a query gradient"
    if "sinks" in kw:
        # Rows that see no key but the sink: out exactly 0, lse = sink, no query gradient.
        only_sink = _key_empty_rows(args, kw)
        assert_lse_close(np.where(only_sink, lse, 0.0), np.where(only_sink, kw["sinks"], 0.0), tol)
        assert (np.asarray(to_f64(out))[only_sink] == 0).all(), "a row seeing only the sink has a non-zero output"
        assert (np.asarray(to_f64(grads[0]))[only_sink] == 0).all(), "a row seeing only the sink has a query gradient"
    return empty


def _key_empty_rows(args, kw):
    """Bool, the shape of `lse`: the rows that see no key (the reference's `lse` without the sinks is -inf)."""
    kw = {n: x for n, x in kw.items() if n != "sinks"}
    return np.isinf(reference_attention(*args, **kw)[1])


INTERPRET = attnlib.PallasTpu(interpret=True)


# `full` (CPU time: interpret mode traces every kernel), with what the fast tier still runs: "causal_top_left" in
# `test_user_block_sizes_pad_to_their_blocks` (the same case and check, with a caller's blocks), "segments_causal" in
# `test_max_segments_bound_is_served_exactly` (the same case, kernels and check), "sinks_dense" as sinks on every
# other feature group here (dense: "sinks_gqa_window"; every key visible: `test_forward_with_lse_dropped`).
FULL_FLOAT32 = ("causal_top_left", "segments_causal", "sinks_dense", "mla_segments_sinks")


def _params(names, full):
    return [pytest.param(n, marks=(pytest.mark.full,) if n in full else ()) for n in names]


@pytest.mark.parametrize("name", _params(CASES, FULL_FLOAT32))
def test_interpret_matches_reference_float32(name):
    _check(CASES[name], jnp.float32, INTERPRET)


# Fast tier: bfloat16 with sinks, causal bottom-right (rows that see only the sink), and with segments; bfloat16 on
# "causal_bottom_right" (the same masks without sinks) and "soft_cap_gqa" (float32 in the fast tier) are `full`.
@pytest.mark.parametrize(
    "name",
    _params(["causal_bottom_right", "segments_cross", "soft_cap_gqa", "sinks_causal_bottom_right"],
            ("causal_bottom_right", "soft_cap_gqa")),
)  # fmt: skip
def test_interpret_matches_reference_bfloat16(name):
    _check(CASES[name], jnp.bfloat16, INTERPRET)


def _case_kwargs_f64(case: Case):
    kw = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in _kwargs(case).items()}
    if "cu_seqlens_q" in kw:
        kw.setdefault("cu_seqlens_kv", kw["cu_seqlens_q"])
    return [to_f64(x) for x in _arrays(case, jnp.float32)], kw


def test_the_empty_rows_are_exercised():
    """The cases meant to have rows that see nothing do (so the fix-up of splash's empty rows is tested), and the
    sinks cases meant to have rows that see only the sink do."""
    for name in ("causal_bottom_right", "lengths_with_empty_rows", "segments_cross"):
        args, kw = _case_kwargs_f64(CASES[name])
        assert np.isinf(reference_attention(*args, **kw)[1]).any(), name
    for name in ("sinks_causal_bottom_right", "sinks_lengths_with_empty_rows", "sinks_segments_cross"):
        args, kw = _case_kwargs_f64(CASES[name])
        assert not np.isinf(reference_attention(*args, **kw)[1]).any(), name
        assert _key_empty_rows(args, kw).any(), name


LSE_DROPPED = {
    "causal_top_left": (CASES["causal_top_left"], False),
    "causal_top_left_sinks": (Case(kwargs=(("is_causal", True), ("sinks", _sinks(6)))), False),
    "dense_padded_keys_sinks": (CASES["sinks_dense"], True),
    "causal_bottom_right_sinks": (CASES["sinks_causal_bottom_right"], True),
    "segments_cross_sinks": (CASES["sinks_segments_cross"], True),
}


@pytest.mark.parametrize("name", list(LSE_DROPPED))
def test_forward_with_lse_dropped(name, monkeypatch):
    """`lse` dropped: rows that all see a key (and no padded key) run splash without residuals, sinks or not;
    rows that may see nothing, or padded keys to hide, keep the `lse` (with a sink alone: out 0)."""
    from attnlib._src.backends.pallas_tpu import splash

    layouts = []
    layout = splash.layout
    monkeypatch.setattr(splash, "layout", lambda *a: layouts.append(layout(*a)) or layouts[-1])
    case, lse_needed = LSE_DROPPED[name]
    q, k, v = _arrays(case, jnp.float32)
    kw = _kwargs(case)
    out = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **kw))(q, k, v)
    assert [lay.kernel.lse_needed for lay in layouts] == [lse_needed]
    assert [lay.kernel.empty_rows for lay in layouts] == [lse_needed]  # the call drops `lse`: only rows decide
    args, kw64 = _case_kwargs_f64(case)
    assert_out_close(out, reference_attention(*args, **kw64)[0], jnp.float32)


ROWS_FROM_IDS = {
    "segments_causal": True,  # self-attention over packed rows: every query with a segment sees itself
    "thd_causal": True,
    "segments_cross": False,  # keys with their own segments: a query's segment may have no key
    "sinks_segments_cross": False,
    "lengths_with_empty_rows": False,
    "causal_bottom_right": False,  # no segments: the band decides
}


@pytest.mark.parametrize("name", list(ROWS_FROM_IDS))
def test_rows_without_keys_come_from_the_ids_where_they_say_it(name, monkeypatch):
    """Self-attention over one sequence structure, with the diagonal in the band and no sinks: the rows that see no
    key are the queries without a segment, found from the ids (the log-sum-exp of a forward whose `lse` nothing else
    reads is then dead: no relayout of it on a TPU under full remat). Other structures find them in the `lse`."""
    from attnlib._src.backends.pallas_tpu import splash

    layouts = []
    layout = splash.layout
    monkeypatch.setattr(splash, "layout", lambda *a: layouts.append(layout(*a)) or layouts[-1])
    case = CASES[name]
    q, k, v = _arrays(case, jnp.float32)
    kw = _kwargs(case)
    jax.eval_shape(lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **kw), q, k, v)
    assert [lay.kernel.empty_rows_from_ids for lay in layouts] == [ROWS_FROM_IDS[name]]


def test_user_block_sizes_pad_to_their_blocks():
    """A caller's `BlockSizes` (backward blocks unset): lengths pad to multiples of its blocks; same numbers."""
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

    chosen = BlockSizes(block_q=256, block_kv=128)
    assert blocks.padded_lengths(37, 53, chosen) == (256, 128)
    _check(CASES["causal_top_left"], jnp.float32, attnlib.PallasTpu(block_sizes=chosen, interpret=True))


def test_block_table():
    assert blocks.padded_lengths(37, 600, None) == (128, 640)
    table = blocks.default_block_sizes(1536, 640)
    assert (table.block_q, table.block_kv, table.block_kv_compute) == (512, 128, 128)
    assert (table.block_q_dkv, table.block_kv_dkv, table.block_q_dq, table.block_kv_dq) == (512, 128, 512, 128)
    assert blocks.default_block_sizes(768, 2048).block_q == 256


@pytest.mark.parametrize(
    "bad, error",
    [(dict(block_sizes=(128, 128)), TypeError), (dict(interpret=1), TypeError)],
)
def test_bad_options_are_named(bad, error):
    with pytest.raises(error, match=f"`{next(iter(bad))}`"):
        attnlib.PallasTpu(**bad)


def test_bad_block_size_is_named():
    from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

    with pytest.raises(ValueError, match="multiples of 128"):
        attnlib.PallasTpu(block_sizes=BlockSizes(block_q=100, block_kv=128))


# ------------------------------------------------------------------------------------------------------------------
# declines


def _qkv(t=37, s=53, n=6, k=2, h=8, hv=8, dtype=jnp.float32):
    r = rng(3)
    return normal(r, (2, t, n, h), dtype), normal(r, (2, s, k, h), dtype), normal(r, (2, s, k, hv), dtype)


DECLINES = {
    "float16": (dict(dtype=jnp.float16), "float16 inputs"),
    "head_dim": (dict(h=264, hv=264), "H=264"),
    "value_head_dim": (dict(hv=264), "Hv=264"),
    "fp8": (dict(fp8="current"), "FP8"),
}
"""What neither splash nor attnlib's flex kernel serves."""

FLEX_SERVES = {
    "bias": (dict(bias=jnp.zeros((2, 6, 37, 53))), "`bias`"),
    "mask": (dict(mask=jnp.ones((37, 53), bool)), "`mask` arrays"),
    "dropout": (dict(dropout_rate=0.1, dropout_key=jax.random.key(0)), "dropout"),
    "score_mod": (dict(score_mod=lambda s, b, h, i, j: s * 0.5), "`score_mod`"),
    "deterministic": (dict(deterministic_backward=True), "deterministic_backward"),
    "causal_separate_kv_segments": (
        dict(t=41, s=41, is_causal=True, q_segment_ids=jnp.ones((2, 41), jnp.int32),
             kv_segment_ids=jnp.ones((2, 41), jnp.int32)),
        "`kv_segment_ids` or `cu_seqlens_kv`",
    ),  # fmt: skip
    "bottom_right_lengths": (
        dict(is_causal=True, diagonal_alignment="bottom_right", key_value_seq_lengths=jnp.asarray([5, 9], jnp.int32)),
        "bottom-right aligned causal mask or window with padding lengths",
    ),
}
"""What splash declines and attnlib's flex kernel serves (tests/test_pallas_tpu_flex.py checks the numbers)."""


@pytest.mark.parametrize("name", list(FLEX_SERVES))
def test_splash_declines_and_the_flex_kernel_serves(name):
    kw, match = FLEX_SERVES[name]
    kw = dict(kw)
    sizes = {n: kw.pop(n) for n in ("t", "s", "n", "k", "h", "hv", "dtype") if n in kw}
    q, k, v = _qkv(**sizes)
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **kw)
    assert explanation.implementation == "pallas_tpu"
    assert explanation.kernel.startswith("runs attnlib's flex kernel (splash declined: "), explanation.kernel
    assert match in explanation.kernel
    assert "attnlib's flex kernel" in str(explanation)


def _decline_call(name):
    kw, match = DECLINES[name]
    kw = dict(kw)
    sizes = {n: kw.pop(n) for n in ("t", "s", "n", "k", "h", "hv", "dtype") if n in kw}
    return _qkv(**sizes), kw, match


@pytest.mark.parametrize("name", list(DECLINES))
def test_declines_with_a_reason(name):
    (q, k, v), kw, match = _decline_call(name)
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **kw)
    assert explanation.implementation is None
    assert match in explanation.declined["pallas_tpu"]
    with pytest.raises(NotImplementedError, match=r"pallas_tpu: .*" + _escape(match)):
        attnlib.attention(q, k, v, implementation=INTERPRET, **kw)
    # a sequence falls back to the next implementation (jitted: one compile, not one per operation)
    out = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=(INTERPRET, "xla"), **kw))(q, k, v)
    assert out.shape == q.shape[:-1] + (v.shape[-1],)


def _escape(text):
    import re

    return re.escape(text)


@pytest.mark.skipif(any(d.platform == "tpu" for d in jax.devices()), reason="checks a machine without a TPU")
def test_without_a_tpu_it_declines_and_automatic_dispatch_never_picks_it():
    q, k, v = _qkv()
    named = attnlib.explain(q, k, v, is_causal=True, implementation="pallas_tpu")
    assert named.declined == {"pallas_tpu": "no TPU visible to JAX"}
    with pytest.raises(NotImplementedError, match="no TPU visible to JAX"):
        attnlib.attention(q, k, v, implementation="pallas_tpu")
    automatic = attnlib.explain(q, k, v, is_causal=True)
    assert automatic.implementation != "pallas_tpu"
    assert automatic.declined["pallas_tpu"] == "no TPU visible to JAX"
    assert automatic.requested == ("cudnn", "pallas_tpu", "xla_chunked", "xla")


@pytest.mark.parametrize("check_vma", [False, True])
def test_inside_shard_map(check_vma, caplog):
    """Inside `jax.shard_map(check_vma=False)` splash serves the call; with `check_vma=True` (the default) this JAX's
    Pallas kernels cannot type their outputs' variation, so pallas_tpu declines with the reason (logged) and the next
    implementation serves."""
    import logging

    # On the CPU, as the other host tests (a GPU's float32 products would miss the tolerance).
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:1])
    q, k, v = _qkv()
    spec = jax.P("x")

    def body(q, k, v):
        return attnlib.attention(q, k, v, is_causal=True, implementation=(INTERPRET, "xla"))

    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=check_vma))
    with caplog.at_level(logging.INFO, logger="attnlib"):
        put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))  # noqa: E731
        out = sharded(put(q), put(k), put(v))
    declined = [r.getMessage() for r in caplog.records if TYPED_VARYING in r.getMessage()]
    assert bool(declined) == check_vma, declined
    expected = attnlib.attention(q, k, v, is_causal=True, implementation="xla")
    assert_out_close(out, np.asarray(expected, np.float64), jnp.float32)


def test_max_segments_bound_is_served_exactly():
    """Splash's segment ids have no bound: a row with more segments than `max_segments_per_row` still gets exact
    numbers (the contract only forbids silently wrong ones)."""
    case = CASES["segments_causal"]
    kw = dict(case.kwargs) | {"max_segments_per_row": 1}
    _check(dataclasses.replace(case, kwargs=tuple(kw.items())), jnp.float32, INTERPRET)


# ------------------------------------------------------------------------------------------------------------------
# on a TPU

@pytest.mark.tpu
@pytest.mark.parametrize("name", list(CASES))
def test_tpu_matches_reference_bfloat16(name):
    _check(CASES[name], jnp.bfloat16, attnlib.PallasTpu())


def _textbook_float32(q, k, v, visible, scale, soft_cap):
    """Attention written out in float32 with full-precision products, evaluated where JAX runs (the TPU): `(out
    [B, T, N, Hv], lse [B, N, T])` from `q [B, T, N, H]`, `k`, `v [B, S, K, H|Hv]` and the reference's boolean
    visibility `[B, N, T, S]` (rows that see nothing: out 0, lse -inf, zero gradients)."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, -1e30)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.where(visible, jnp.exp(s - m), 0.0)
    seen = visible.any(axis=-1)
    total = jnp.where(seen, e.sum(axis=-1), 1.0)
    lse = jnp.where(seen, m[..., 0] + jnp.log(total), -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", e / total[..., None], v, precision=hi)
    return out, lse


def _textbook_flash_grads_float32(q, k, v, visible, scale, soft_cap, d_out, d_lse):
    """The gradients `(dq, dk, dv)` of `_textbook_float32`, written the way a flash backward computes them (float32,
    full-precision products): probabilities recomputed from the `lse` (`p = exp(s - lse)`), so the device's `log`
    enters them as well as its `exp`; `D = rowsum(dO · O) - dlse`, `dS = P (dP - D)`, through the soft cap."""
    out, lse = _textbook_float32(q, k, v, visible, scale, soft_cap)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    hi = jax.lax.Precision.HIGHEST
    raw = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * scale
    s = raw if soft_cap is None else soft_cap * jnp.tanh(raw / soft_cap)
    seen = jnp.isfinite(lse)[..., None]
    p = jnp.where(visible & seen, jnp.exp(s - jnp.where(seen, lse[..., None], 0.0)), 0.0)
    d_out, out = d_out.astype(jnp.float32), out.astype(jnp.float32)
    dv = jnp.einsum("bnts,btnh->bsnh", p, d_out, precision=hi)
    dp = jnp.einsum("btnh,bsnh->bnts", d_out, v, precision=hi)
    row = jnp.transpose(jnp.sum(d_out * out, axis=-1), (0, 2, 1)) - d_lse  # [B, N, T]
    ds = p * (dp - row[..., None])
    if soft_cap is not None:
        ds = ds * (1.0 - jnp.square(s / soft_cap))
    dq = jnp.einsum("bnts,bsnh->btnh", ds, k, precision=hi) * scale
    dk = jnp.einsum("bnts,btnh->bsnh", ds, q, precision=hi) * scale
    fold = lambda x: jnp.sum(jnp.reshape(x, (*x.shape[:2], x.shape[2] // group, group, x.shape[3])), axis=3)
    return dq, fold(dk), fold(dv)


def _assert_tpu_float32_close(case: Case, implementation):
    """attnlib's float32 `(out, lse, dq, dk, dv)` against the float64 reference, allowed float32's host tolerance
    plus twice the largest error of `_textbook_float32` on the same device: what the device's float32 arithmetic
    (its `exp`, `log`, `tanh`) costs any implementation there. For the gradients, the larger error of its two
    backward forms: JAX's autodiff of it, and the flash form (`_textbook_flash_grads_float32`)."""
    (q, k, v), out, lse, grads, d_out, d_lse = _run(case, jnp.float32, implementation)
    kw, args, ref_out, ref_lse, ref_grads = _reference(case, q, k, v, d_out, d_lse)
    empty = np.isinf(ref_lse)
    visible = jnp.asarray(visibility(*args, **kw))
    scale = kw.get("scale", 1.0 / np.sqrt(case.h))
    textbook = lambda q, k, v: _textbook_float32(q, k, v, visible, float(scale), kw.get("logits_soft_cap"))
    (tb_out, tb_lse), tb_vjp = jax.vjp(jax.jit(textbook), q, k, v)
    tb_lse = jnp.transpose(tb_lse, (0, 2, 1))  # [B, T, N], as attnlib returns it
    assert tb_lse.shape == lse.shape == ref_lse.shape
    tb_d_lse = jnp.transpose(jnp.where(empty, 0.0, d_lse), (0, 2, 1))
    tb_grads = jax.jit(tb_vjp)((d_out, tb_d_lse))
    flash = lambda q, k, v, d_out, d_lse: _textbook_flash_grads_float32(
        q, k, v, visible, float(scale), kw.get("logits_soft_cap"), d_out, d_lse
    )
    flash_grads = jax.jit(flash)(q, k, v, d_out, tb_d_lse)

    def check(actual, tbs, expected, tol, what, by_max=False):
        e = np.asarray(expected, np.float64)
        fin = np.isfinite(e)
        tb_err = 0.0
        for tb in tbs if isinstance(tbs, tuple) else (tbs,):
            tb = np.asarray(tb, np.float64)
            assert np.array_equal(np.isfinite(tb), fin), f"textbook {what}: non-finite where the reference is not"
            tb_err = max(tb_err, float(np.max(np.abs(tb[fin] - e[fin]), initial=0.0)))
        device = tb_err / max(1.0, float(np.abs(e[fin]).max(initial=0.0))) if by_max else tb_err
        assert_close(actual, expected, Tol(tol.atol + 2 * device, tol.rtol), what=what, scale_atol_by_max=by_max)
        device_terms[what] = device

    device_terms = {}

    check(out, tb_out, ref_out, OUT_TOL[np.dtype(jnp.float32)], "out")
    check(lse, tb_lse, ref_lse, LSE_TOL[np.dtype(jnp.float32)], "lse")
    for name, g, tb, tb_flash in zip(("query", "key", "value"), grads, tb_grads, flash_grads, strict=True):
        assert g.dtype == jnp.float32
        check(g, (tb, tb_flash), ref_grads[name], GRAD_TOL[np.dtype(jnp.float32)], f"d{name}", by_max=True)
    return device_terms


# Fast tier: "soft_cap_gqa" (the device's `tanh` too); "causal_bottom_right" is `full`.
@pytest.mark.parametrize("name", _params(["causal_bottom_right", "soft_cap_gqa"], ("causal_bottom_right",)))
def test_float32_device_bound_on_cpu_is_the_host_tolerance(name):
    """On a CPU the textbook formula is float32-exact, so `_assert_tpu_float32_close` is the host tolerance: interpret
    mode (float32 kept) passes it, and both textbook forms are float32-exact here (what they add on a TPU is the
    device's, not a slip of theirs)."""
    device_terms = _assert_tpu_float32_close(CASES[name], INTERPRET)
    assert max(device_terms.values()) < 2e-6, device_terms


FLOAT32_CASES = ["dense", "causal_bottom_right", "segments_cross", "soft_cap_gqa"]


@pytest.mark.tpu
@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_tpu_float32_at_the_default_precision_runs_fused(name):
    """JAX's convention on TPUs: a float32 matrix product runs at the default precision (one bfloat16 pass) unless
    the user asks for more, as `jnp.matmul` and jax.nn do. So float32 runs on splash there, with the tolerance of
    the precision asked (bfloat16's) against float64; jax.nn's float32 call errs as much (docs/semantics.md)."""
    _check(CASES[name], jnp.float32, attnlib.PallasTpu(), tolerance_dtype=jnp.bfloat16)


@pytest.mark.tpu
@pytest.mark.parametrize("precision", ["highest", "float32"])
@pytest.mark.parametrize("name", FLOAT32_CASES)
def test_tpu_float32_under_highest_precision_runs_the_flex_kernel(name, precision):
    """Under `jax.default_matmul_precision("highest")` splash (one bfloat16 pass) cannot give what is asked, so
    float32 runs on attnlib's flex kernel there, with full-precision products (explain names it). A TPU's float32
    `exp` and `log` are not a CPU's (on a v5e the plain-JAX fallback's `lse` was off by up to 1.1e-4 against
    float64, beyond the host tolerance that a CPU meets): the bound adds what float32 costs on the device itself,
    measured by the textbook formula run there (`_assert_tpu_float32_close`)."""
    case = CASES[name]
    q, k, v = _arrays(case, jnp.float32)
    with jax.default_matmul_precision(precision):
        explanation = attnlib.explain(q, k, v, implementation=attnlib.PallasTpu(), **_kwargs(case))
        assert explanation.implementation == "pallas_tpu"  # attnlib's flex kernel, full-precision products
        assert f"float32 inputs under jax.default_matmul_precision('{precision}')" in explanation.kernel
        _assert_tpu_float32_close(case, attnlib.PallasTpu())


def test_float32_on_a_tpu_follows_the_precision_asked(monkeypatch):
    on_a_simulated_tpu(monkeypatch)
    q, k, v = _arrays(CASES["dense"], jnp.float32)
    forced = (attnlib.PallasTpu(), "xla")
    assert attnlib.explain(q, k, v, implementation=forced).implementation == "pallas_tpu"
    with jax.default_matmul_precision("bfloat16"):  # the default, named
        assert attnlib.explain(q, k, v, implementation=forced).implementation == "pallas_tpu"
    for precision in ("highest", "float32", "high", "tensorfloat32"):
        with jax.default_matmul_precision(precision):
            explanation = attnlib.explain(q, k, v, implementation=forced)
        # splash declines; attnlib's flex kernel serves it with full-precision products
        assert explanation.implementation == "pallas_tpu"
        assert f"jax.default_matmul_precision('{precision}')" in explanation.kernel
    assert attnlib.explain(q, k, v, implementation=forced).kernel is None  # the default precision: splash
    with jax.default_matmul_precision("highest"):  # interpret mode routes as a TPU does
        assert "flex kernel" in attnlib.explain(q, k, v, implementation=INTERPRET).kernel
    jax.config.update("jax_default_matmul_precision", "highest")  # the config, not only the context manager
    try:
        assert "flex kernel" in attnlib.explain(q, k, v, implementation=forced).kernel
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    q, k, v = _arrays(CASES["dense"], jnp.bfloat16)
    with jax.default_matmul_precision("highest"):  # bfloat16 products are exact in float32: nothing more to ask
        assert attnlib.explain(q, k, v, implementation=attnlib.PallasTpu()).implementation == "pallas_tpu"


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_float32_off_a_tpu_is_unchanged_by_the_precision_setting(implementation):
    """On CPU (and GPU) the plain-JAX implementations run float32 products at full precision whatever is asked."""
    q, k, v = _arrays(CASES["causal_bottom_right"], jnp.float32)
    kw = _kwargs(CASES["causal_bottom_right"])
    f = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=implementation, **kw))
    default = f(q, k, v)
    with jax.default_matmul_precision("highest"):
        highest = f(q, k, v)
    np.testing.assert_array_equal(default, highest)


@pytest.mark.tpu
@pytest.mark.parametrize("name", ["dense", "causal_bottom_right", "thd_causal", "lengths_with_empty_rows", "mqa"])
def test_tpu_automatic_dispatch_leaves_short_sequences_to_xla_chunked(name):
    case = CASES[name]
    q, k, v = _arrays(case, jnp.bfloat16)
    explanation = attnlib.explain(q, k, v, **_kwargs(case))
    assert explanation.implementation == "xla_chunked"
    assert explanation.declined["pallas_tpu"].startswith("automatic dispatch leaves sequences of at most 512")
    _check(case, jnp.bfloat16, None)


@pytest.mark.tpu
@pytest.mark.parametrize("implementation", [None, attnlib.PallasTpu()], ids=["automatic", "named"])
def test_tpu_head_dim_64_long_sequence(implementation):
    """A realistic shape: head dim 64 (padded to 128 lanes), T = S = 1000 (padded to 1024, 512-blocks); automatic
    dispatch picks pallas_tpu."""
    case = Case(t=1000, s=1000, n=4, k=2, h=64, batch=(1,), kwargs=(("is_causal", True),))
    q, k, v = _arrays(case, jnp.bfloat16)
    assert attnlib.explain(q, k, v, **_kwargs(case)).implementation == "pallas_tpu"
    _check(case, jnp.bfloat16, implementation)


def test_automatic_dispatch_on_a_tpu_leaves_short_sequences_to_xla_chunked(monkeypatch):
    on_a_simulated_tpu(monkeypatch)
    for case, automatic in ((Case(t=513, s=600), "pallas_tpu"), (CASES["dense"], "xla_chunked")):
        q, k, v = _arrays(case, jnp.bfloat16)
        explanation = attnlib.explain(q, k, v)
        assert explanation.implementation == automatic
        if automatic == "xla_chunked":
            assert explanation.declined["pallas_tpu"] == (
                "automatic dispatch leaves sequences of at most 512 tokens (T=37, S=53) to xla_chunked, faster "
                "there on a TPU v5e; name pallas_tpu to force it"
            )
        named = attnlib.explain(q, k, v, implementation=(attnlib.PallasTpu(), "xla_chunked"))
        assert named.implementation == "pallas_tpu"


# ------------------------------------------------------------------------------------------------------------------
# layers: they call `attnlib.attention`, so the implementation passes through unchanged


def test_equinox_layer_runs_pallas_tpu():
    eqx = pytest.importorskip("equinox")
    import attnlib.equinox as aeqx

    x = normal(rng(5), (29, 24))
    layer = lambda impl: aeqx.MultiheadAttention(3, 24, is_causal=True, implementation=impl, key=jax.random.key(0))
    fused, plain = layer(INTERPRET), layer("xla")
    assert fused.implementation is INTERPRET
    call = eqx.filter_jit(lambda m: m(x, x, x))  # one compile per layer, not one per operation
    assert_out_close(call(fused), np.asarray(call(plain), np.float64), jnp.float32)


def test_haiku_layer_runs_pallas_tpu():
    hk = pytest.importorskip("haiku")
    import attnlib.haiku as ahk

    x = normal(rng(6), (2, 29, 24))

    def apply(impl):
        init = hk.initializers.VarianceScaling(1.0)
        layer = lambda: ahk.MultiHeadAttention(3, 8, model_size=24, is_causal=True, implementation=impl, w_init=init)
        f = hk.transform(lambda x: layer()(x, x, x))
        params = jax.jit(f.init)(jax.random.key(0), x)  # jitted: one compile each, not one per operation
        return jax.jit(f.apply)(params, None, x)

    assert_out_close(apply(INTERPRET), np.asarray(apply("xla"), np.float64), jnp.float32)
