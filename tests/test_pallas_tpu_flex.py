"""attnlib's own Pallas TPU kernel ("flex": `pallas_tpu` where splash declines) against the float64 reference.

On CPU the kernels run in Pallas interpret mode (`PallasTpu(interpret=True)`), with small blocks
(`flex_blocks=(16, 16)`) so that every case has several query and key blocks (and skipped tiles). Each case checks
`out`, `lse` and the VJP of both with random cotangents with respect to query, key, value and every differentiable
extra (bias, sinks, float `score_mod_args`, an array scale). One case per feature runs in the fast tier; the
combinations are `full`; the `tpu`-marked versions run the same cases on a TPU (with 128-blocks); the v5e compile
tests are in `tests/test_pallas_tpu_compile.py`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close, normal, rng, segment_ids_from_runs, to_f64
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.dropout import dropout_keep_mask


INTERPRET = attnlib.PallasTpu(interpret=True, flex_blocks=(16, 16))


@dataclasses.dataclass(frozen=True)
class Case:
    """Sizes and `attnlib.attention` keyword arguments (arrays as NumPy); `extras` are differentiated too."""

    t: int = 37
    s: int = 53
    n: int = 6
    k: int = 2
    h: int = 8
    hv: int | None = None
    batch: tuple[int, ...] = (2,)
    kwargs: tuple = ()
    extras: tuple = ()  # names of kwargs that are differentiated (bias, sinks, scale, score_mod_args)


def _seg(runs_per_row, total):
    return np.stack([segment_ids_from_runs(runs, total) for runs in runs_per_row])


def _f32(shape, seed):
    return (rng(seed).standard_normal(shape)).astype(np.float32)


def alibi(score, batch, head, q_idx, kv_idx, slope):
    return score + slope * (kv_idx - q_idx).astype(jnp.float32)


def prefix_lm(batch, head, q_idx, kv_idx, *args):
    return (kv_idx <= q_idx) | (kv_idx < 7)


def tanh_cap(score, batch, head, q_idx, kv_idx):
    return 2.0 * jnp.tanh(score / 2.0) + 0.1 * head.astype(jnp.float32)


def nested_ops(score, batch, head, q_idx, kv_idx):
    """Nested calls (`custom_jvp` relu / logaddexp, `jit` clip / where), integer `//` and `%`, sigmoid."""
    distance = jnp.clip((q_idx - kv_idx).astype(jnp.float32), -6.0, 6.0)
    bucket = ((q_idx // 5) % 3).astype(jnp.float32)
    s = jnp.logaddexp(score, 0.3 * bucket) + 0.2 * jax.nn.relu(distance) - jax.nn.sigmoid(score)
    return jnp.where(kv_idx % 7 == 3, -jnp.inf, s)


def by_sequence(score, batch, head, q_idx, kv_idx):
    return score + 0.3 * batch.astype(jnp.float32) - 0.1 * head.astype(jnp.float32)


def recent_keys(batch, head, q_idx, kv_idx):
    return kv_idx >= q_idx - 4 - batch


def per_pair(score, batch, head, q_idx, kv_idx, table, doc_q, doc_k):
    return jnp.where(doc_q == doc_k, score * table, score - 1.0)


def same_doc(batch, head, q_idx, kv_idx, table, doc_q, doc_k):
    return doc_q == doc_k


SEG_CAUSAL = _seg([[(3, 11), (1, 20), (2, 6)], [(5, 30), (2, 7)]], 37)
DOCS = np.stack([np.repeat(np.arange(4), 10)[:37], np.repeat(np.arange(3), 13)[:37]]).astype(np.int32)
DOCS_K = np.stack([np.repeat(np.arange(4), 14)[:53], np.repeat(np.arange(3), 18)[:53]]).astype(np.int32)

CASES = {
    # priority 1: the core kernel
    "dense_gqa": Case(),
    "causal_top_left": Case(kwargs=(("is_causal", True),)),
    "causal_bottom_right_empty_rows": Case(
        t=53, s=37, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right"))
    ),
    "window_two_sided": Case(kwargs=(("local_window_size", (5, 3)),)),
    "lengths_causal": Case(
        kwargs=(
            ("query_seq_lengths", np.asarray([30, 0], np.int32)),
            ("key_value_seq_lengths", np.asarray([0, 41], np.int32)),
            ("is_causal", True),
        )
    ),
    "segments_causal": Case(t=37, s=37, kwargs=(("q_segment_ids", SEG_CAUSAL), ("is_causal", True))),
    "thd_window": Case(
        t=47,
        s=47,
        batch=(),
        kwargs=(("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)), ("local_window_size", (4, 2))),
    ),
    "sinks_soft_cap_mqa": Case(
        n=5, k=1, kwargs=(("logits_soft_cap", 1.5), ("scale", 0.9), ("sinks", _f32(5, 13) + 0.4)), extras=("sinks",)
    ),
    "array_scale": Case(kwargs=(("scale", np.float32(0.41)), ("is_causal", True)), extras=("scale",)),
    # priority 2: modifiers
    "score_mod_alibi": Case(
        kwargs=(("score_mod", alibi), ("score_mod_args", (_f32((6, 1, 1), 3) * 0.3,)), ("is_causal", True)),
        extras=("score_mod_args",),
    ),
    "mask_mod_prefix_lm": Case(kwargs=(("mask_mod", prefix_lm),)),
    "score_mod_tanh": Case(kwargs=(("score_mod", tanh_cap),)),
    "score_mod_nested_ops": Case(kwargs=(("score_mod", nested_ops), ("is_causal", True))),
    "modifiers_with_args": Case(
        t=37,
        s=53,
        kwargs=(
            ("score_mod", per_pair),
            ("mask_mod", same_doc),
            ("score_mod_args", (_f32((6, 37, 53), 5), DOCS[:, None, :, None], DOCS_K[:, None, None, :])),
        ),
        extras=("score_mod_args",),
    ),
    "thd_modifiers_by_sequence": Case(
        t=47, s=47, batch=(),
        kwargs=(("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)), ("score_mod", by_sequence),
                ("mask_mod", recent_keys), ("diagonal_alignment", "bottom_right")),
    ),  # fmt: skip
    # priority 3: bias and mask arrays
    "bias_heads": Case(kwargs=(("bias", _f32((1, 6, 37, 53), 21)), ("is_causal", True)), extras=("bias",)),
    "bias_keys_only": Case(kwargs=(("bias", _f32((2, 1, 1, 53), 22)),), extras=("bias",)),
    "bias_mha": Case(n=3, k=3, kwargs=(("bias", _f32((1, 3, 37, 53), 23)),), extras=("bias",)),
    # A bfloat16 bias: NumPy's issubdtype does not count bfloat16 as a float (it was stored as int32 once).
    "bias_bfloat16": Case(
        n=3, k=3, kwargs=(("bias", _f32((2, 3, 37, 53), 24).astype(jnp.bfloat16)),), extras=("bias",)
    ),
    # A bias with no broadcast dim: its gradient is written in place, and the tiles the causal mask and the lengths
    # skip must read 0.
    "bias_in_place_skipped_tiles": Case(
        kwargs=(("bias", _f32((2, 6, 37, 53), 25)), ("is_causal", True),
                ("key_value_seq_lengths", np.asarray([29, 53], np.int32))),
        extras=("bias",),
    ),  # fmt: skip
    "mask_array": Case(kwargs=(("mask", rng(4).random((2, 1, 37, 53)) > 0.3),)),
    # priority 4: MLA
    "mla": Case(h=24, hv=16, kwargs=(("is_causal", True),)),
    # priority 7: per-row offsets splash declines
    "bottom_right_lengths": Case(
        kwargs=(
            ("is_causal", True),
            ("diagonal_alignment", "bottom_right"),
            ("key_value_seq_lengths", np.asarray([29, 53], np.int32)),
            ("query_seq_lengths", np.asarray([37, 11], np.int32)),
        )
    ),
    "kv_segments_own_structure": Case(
        t=37,
        s=37,
        kwargs=(
            ("q_segment_ids", SEG_CAUSAL),
            ("kv_segment_ids", _seg([[(3, 5), (1, 25), (2, 7)], [(5, 20), (2, 17)]], 37)),
            ("is_causal", True),
        ),
    ),
    "thd_kv_own_structure": Case(
        t=40,
        s=50,
        batch=(),
        kwargs=(
            ("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)),
            ("cu_seqlens_kv", np.asarray([0, 20, 22, 45], np.int32)),
            ("is_causal", True),
            ("diagonal_alignment", "bottom_right"),
        ),
    ),
}

FAST = ("dense_gqa", "causal_bottom_right_empty_rows", "lengths_causal", "thd_window", "sinks_soft_cap_mqa",
        "array_scale", "score_mod_alibi", "score_mod_nested_ops", "mask_mod_prefix_lm", "modifiers_with_args",
        "thd_modifiers_by_sequence", "bias_heads", "bias_mha", "bias_bfloat16", "bias_in_place_skipped_tiles",
        "mask_array", "mla", "bottom_right_lengths",
        "kv_segments_own_structure")  # fmt: skip

COMBINATIONS = {
    "score_mod_segments_sinks": Case(
        t=37,
        s=37,
        kwargs=(
            ("q_segment_ids", SEG_CAUSAL),
            ("is_causal", True),
            ("score_mod", alibi),
            ("score_mod_args", (_f32((6, 1, 1), 3) * 0.3,)),
            ("sinks", _f32(6, 13)),
        ),
        extras=("score_mod_args", "sinks"),
    ),
    "bias_window_thd": Case(
        t=47,
        s=47,
        batch=(),
        kwargs=(
            ("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)),
            ("local_window_size", (6, 0)),
            ("bias", _f32((6, 47, 47), 8)),
        ),
        extras=("bias",),
    ),
    "mask_mod_gqa_causal_bottom_right": Case(
        t=29, s=53, kwargs=(("mask_mod", prefix_lm), ("is_causal", True), ("diagonal_alignment", "bottom_right"))
    ),
    "mla_sinks_soft_cap_lengths": Case(
        h=24,
        hv=40,
        kwargs=(
            ("logits_soft_cap", 2.0),
            ("sinks", _f32(6, 2)),
            ("key_value_seq_lengths", np.asarray([50, 17], np.int32)),
        ),
        extras=("sinks",),
    ),
    "bias_score_mod_mask": Case(
        kwargs=(("bias", _f32((2, 6, 1, 53), 9)), ("score_mod", tanh_cap), ("mask", rng(5).random((37, 53)) > 0.2)),
        extras=("bias",),
    ),
    "score_mod_query_args_mqa": Case(
        n=3,
        k=1,
        kwargs=(
            ("score_mod", per_pair),
            ("mask_mod", same_doc),
            ("score_mod_args", (_f32((2, 1, 37, 1), 5), DOCS[:, None, :, None], DOCS_K[:, None, None, :])),
        ),
        extras=("score_mod_args",),
    ),
}


def _kwargs(case: Case) -> dict:
    conv = lambda x: jnp.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else x
    out = {}
    for n, x in case.kwargs:
        out[n] = tuple(conv(a) for a in x) if n == "score_mod_args" else conv(x)
    return out


def _arrays(case: Case, dtype):
    r = rng(7)
    hv = case.h if case.hv is None else case.hv
    q = normal(r, case.batch + (case.t, case.n, case.h), dtype)
    k = normal(r, case.batch + (case.s, case.k, case.h), dtype)
    v = normal(r, case.batch + (case.s, case.k, hv), dtype)
    return q, k, v


def _split(case: Case, kw: dict):
    """`(fixed kwargs, names, primals)`: the differentiated extras taken out (float score_mod_args only)."""
    kw = dict(kw)
    names, primals = [], []
    for name in case.extras:
        if name == "score_mod_args":
            args = kw.pop(name)
            floats = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating)]
            names.append((name, tuple(args), floats))
            primals.append(tuple(args[i] for i in floats))
        else:
            names.append((name, None, None))
            primals.append(kw.pop(name))
    return kw, names, primals


def with_extras(kw: dict, names, extras) -> dict:
    """`kw` with the differentiated arrays `extras` (`_split`'s `names`) put back in their places."""
    full = dict(kw)
    for (name, args, floats), x in zip(names, extras, strict=True):
        if name == "score_mod_args":
            args = list(args)
            for i, a in zip(floats, x, strict=True):
                args[i] = a
            x = tuple(args)
        full[name] = x
    return full


def _run(case: Case, dtype, implementation, **more):
    q, k, v = _arrays(case, dtype)
    kw, names, extras = _split(case, {**_kwargs(case), **more})

    def f(q, k, v, *extras):
        full = with_extras(kw, names, extras)
        return attnlib.attention(q, k, v, implementation=implementation, return_residual=True, **full)

    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, *extras)
    r = rng(11)
    d_out = normal(r, out.shape, dtype)
    d_lse = normal(r, lse.shape, jnp.float32)
    grads = jax.jit(vjp)((d_out, d_lse))
    return (q, k, v), out, lse, grads, d_out, d_lse


def _reference_kwargs(case: Case, **more) -> dict:
    kw = {}
    for n, x in {**_kwargs(case), **more}.items():
        if n in ("dropout_key", "deterministic_backward"):
            continue
        if n == "score_mod_args":
            kw[n] = tuple(to_f64(np.asarray(a)) for a in x)
        elif isinstance(x, jax.Array):
            kw[n] = to_f64(np.asarray(x))
        else:
            kw[n] = x
    if isinstance(kw.get("scale"), np.ndarray):
        kw["scale"] = float(kw["scale"])
    if "cu_seqlens_q" in kw:
        kw.setdefault("cu_seqlens_kv", kw["cu_seqlens_q"])
    return kw


def _check(case: Case, dtype, implementation, ref_more=None, **more):
    (q, k, v), out, lse, grads, d_out, d_lse = _run(case, dtype, implementation, **more)
    kw = _reference_kwargs(case, **more, **(ref_more or {}))
    args = [to_f64(x) for x in (q, k, v)]
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    ref_out, ref_lse = reference_attention(*args, bias, mask, **kw)
    assert_out_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    empty = np.isinf(ref_lse)
    ref = reference_attention_vjp(*args, bias, mask, d_out=to_f64(d_out), d_lse=np.where(empty, 0.0, to_f64(d_lse)),
                                  **kw)  # fmt: skip
    for name, g in zip(("query", "key", "value"), grads[:3]):
        assert g.dtype == dtype
        assert_grad_close(g, ref[name], dtype, what=f"d{name}")
    for name, g in zip(case.extras, grads[3:]):
        if name == "score_mod_args":
            floats = [i for i, a in enumerate(kw[name]) if np.issubdtype(np.asarray(a).dtype, np.floating)]
            for i, gi in zip(floats, g, strict=True):
                assert_grad_close(gi, ref["score_mod_args"][i], dtype, what=f"d score_mod_args[{i}]")
        elif name == "scale":
            pass  # the reference takes a float scale; the array scale's gradient is checked against xla below
        else:  # returned in the array's dtype: a bfloat16 bias gets a bfloat16 gradient (its tolerance)
            coarser = g.dtype if jnp.finfo(g.dtype).nmant < jnp.finfo(dtype).nmant else dtype
            assert_grad_close(g, ref[name], coarser, what=f"d{name}")
    if empty.any():
        assert (np.asarray(to_f64(out))[empty] == 0).all(), "a row that sees nothing has a non-zero output"
    return grads


def _params(names, fast):
    return [pytest.param(n, marks=() if n in fast else (pytest.mark.full,)) for n in names]


def test_the_cases_run_on_the_flex_kernel():
    """Splash declines each case (or not: the core ones run on splash by default) and the flex kernel serves it;
    explain names it."""
    for name, case in {**CASES, **COMBINATIONS}.items():
        q, k, v = _arrays(case, jnp.float32)
        explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **_kwargs(case))
        assert explanation.implementation == "pallas_tpu", (name, explanation)


@pytest.mark.parametrize("name", _params(CASES, FAST))
def test_flex_matches_reference_float32(name, monkeypatch):
    _force_flex(monkeypatch)
    _check(CASES[name], jnp.float32, INTERPRET)


@pytest.mark.parametrize("name", _params(COMBINATIONS, ()))
def test_flex_combinations_match_reference_float32(name, monkeypatch):
    _force_flex(monkeypatch)
    _check(COMBINATIONS[name], jnp.float32, INTERPRET)


@pytest.mark.parametrize("name", _params(["causal_top_left", "score_mod_alibi", "bias_heads", "mla"], ("bias_heads",)))
def test_flex_matches_reference_bfloat16(name, monkeypatch):
    _force_flex(monkeypatch)
    _check(CASES[name], jnp.bfloat16, INTERPRET)


def _force_flex(monkeypatch):
    """Route every dense call to the flex kernel (the core cases would otherwise run on splash)."""
    from attnlib._src.backends.pallas_tpu import implementation

    original = implementation.PallasTpu.splash_reason
    monkeypatch.setattr(
        implementation.PallasTpu,
        "splash_reason",
        lambda self, config: original(self, config) or "forced to the flex kernel by the test",
    )


# ------------------------------------------------------------------------------------------------------------------
# dropout, float32 at "highest", deterministic backward

DROPOUT = {
    "dense_causal": Case(kwargs=(("is_causal", True),)),
    "thd_sinks": Case(
        t=47, s=47, batch=(), kwargs=(("cu_seqlens_q", np.asarray([0, 12, 13, 40], np.int32)), ("sinks", _f32(6, 13)))
    ),
    # The written gradients (a bias in place, a score_mod_arg as partials) take dropout's scale per element.
    "bias_score_mod_soft_cap": Case(
        kwargs=(("bias", _f32((2, 6, 37, 53), 26)), ("score_mod", alibi), ("score_mod_args", (_f32((6, 1, 1), 4),)),
                ("logits_soft_cap", 2.5), ("is_causal", True)),
        extras=("bias", "score_mod_args"),
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", _params(DROPOUT, ("dense_causal",)))
def test_dropout_matches_reference_with_the_keep_mask(name):
    """The kernel draws attnlib's counter-hash keep mask per tile: the reference with that mask agrees (out, lse,
    gradients), and so does xla_chunked with the same key."""
    case, rate, key = DROPOUT[name], 0.3, jax.random.key(5)
    q, _, _ = _arrays(case, jnp.float32)
    B, T, N = (int(np.prod(case.batch)) if case.batch else 1), case.t, case.n
    keep = np.asarray(dropout_keep_mask(key, rate, (B, N, T, case.s)))
    more = dict(dropout_rate=rate, dropout_key=key)
    _check(case, jnp.float32, INTERPRET, ref_more=dict(dropout_keep=keep), **more)
    kw = {**_kwargs(case), **more}
    flex = attnlib.attention(*_arrays(case, jnp.float32), implementation=INTERPRET, **kw)
    chunked = attnlib.attention(*_arrays(case, jnp.float32), implementation="xla_chunked", **kw)
    np.testing.assert_allclose(flex, chunked, atol=2e-6, rtol=2e-6)


def test_float32_under_highest_runs_the_flex_kernel():
    """Under `jax.default_matmul_precision("highest")` splash (one bfloat16 pass on a TPU) declines float32 and the
    flex kernel serves it with full-precision products; float32's tolerance holds."""
    case = CASES["causal_top_left"]
    q, k, v = _arrays(case, jnp.float32)
    with jax.default_matmul_precision("highest"):
        explanation = attnlib.explain(q, k, v, implementation=attnlib.PallasTpu(interpret=True), **_kwargs(case))
        assert explanation.implementation == "pallas_tpu"
        assert explanation.kernel.startswith("runs attnlib's flex kernel (splash declined: float32 inputs under")
        _check(case, jnp.float32, INTERPRET)


def test_deterministic_backward_is_served_and_bitwise_reproducible():
    case = CASES["bias_heads"]
    q, k, v = _arrays(case, jnp.float32)
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, deterministic_backward=True)
    assert explanation.implementation == "pallas_tpu" and "flex kernel" in explanation.kernel
    first = _run(case, jnp.float32, INTERPRET, deterministic_backward=True)[3]
    second = _run(case, jnp.float32, INTERPRET, deterministic_backward=True)[3]
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)


def test_array_scale_gradient_matches_xla(monkeypatch):
    _force_flex(monkeypatch)
    case = CASES["array_scale"]
    flex = _run(case, jnp.float32, INTERPRET)
    xla = _run(case, jnp.float32, "xla")
    np.testing.assert_allclose(flex[3][3], xla[3][3], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------------
# block sparsity


def _maps(monkeypatch):
    """Record every block map the flex kernel builds."""
    from attnlib._src.backends.pallas_tpu.flex import block_map

    built = []
    original = block_map.from_tiles
    monkeypatch.setattr(block_map, "from_tiles", lambda *a, **kw: built.append(original(*a, **kw)) or built[-1])
    return built


def _pallas_grids(fn, *args):
    """The grids of the `pallas_call`s in the jaxpr of `fn`."""
    grids = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                grids.append(tuple(eqn.params["grid_mapping"].grid))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


def test_static_masks_skip_their_tiles_and_shrink_the_grid(monkeypatch):
    """A window of (5, 3) over 96 tokens in 16-token blocks: each query block visits at most 3 of the 6 key blocks
    (computed at trace time in NumPy), so the grids' inner axes are 3 long, and the numbers are the reference's."""
    _force_flex(monkeypatch)
    built = _maps(monkeypatch)
    case = Case(t=96, s=96, kwargs=(("local_window_size", (5, 3)),))
    q, k, v = _arrays(case, jnp.float32)
    fn = lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case))
    grids = _pallas_grids(fn, q, k, v)
    (bm,) = built
    assert not bm.per_batch and bm.width_k == 3 and bm.width_q == 3
    assert list(np.ravel(bm.kv_count)) == [2, 3, 3, 3, 3, 2]  # the diagonal block and its neighbours
    assert list(np.ravel(bm.kv_list)[3:6]) == [0, 1, 2]
    assert not bm.any_full and not np.any(bm.kv_full)  # a band 9 wide covers no 16 x 16 tile
    assert grids == [(2, 2, 6, 3)]
    _check(case, jnp.float32, INTERPRET)


def test_wholly_visible_tiles_run_unmasked(monkeypatch):
    """Causal over 64 x 80 keys (bottom-right) in 16-blocks: the tiles below the diagonal are flagged full (the
    kernels skip every mask there), the diagonal ones and the padded key block are not; the numbers are the
    reference's with both bodies."""
    _force_flex(monkeypatch)
    built = _maps(monkeypatch)
    case = Case(t=64, s=72, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right")))
    _check(case, jnp.float32, INTERPRET)
    bm = built[0]
    assert bm.any_full and bm.any_partial
    count, lists, full = np.ravel(bm.kv_count), np.reshape(bm.kv_list, (4, -1)), np.reshape(bm.kv_full, (4, -1))
    i, j = np.arange(64)[:, None] + 8, np.arange(80)[None, :]
    dense = (j <= i) & (j < 72)
    want = dense.reshape(4, 16, 5, 16).all(axis=(1, 3))
    for qi in range(4):
        assert list(full[qi, : count[qi]]) == [int(want[qi, kj]) for kj in lists[qi, : count[qi]]]
        assert not full[qi, count[qi] :].any()
    assert want.sum() == 6  # key block 0 for query blocks 1-3, block 1 for 2-3, block 2 for 3


def test_a_map_of_every_tile_needs_no_zeroed_gradients(monkeypatch):
    """A dense call with a `[B, N, T, S]` bias visits every tile: the dQ kernel writes the bias gradient in place with
    no zero-filled operand aliased to it (one less pass over `B·N·T·S`), and the gradient is the reference's."""
    built = _maps(monkeypatch)
    case = CASES["bias_bfloat16"]
    _check(case, jnp.float32, INTERPRET)
    assert built[0].every_tile
    q, k, v = _arrays(case, jnp.float32)
    bias = jnp.asarray(dict(case.kwargs)["bias"], jnp.float32)
    loss = lambda q, bias: jnp.sum(attnlib.attention(q, k, v, bias, implementation=INTERPRET))
    aliases = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call" and "dq" in str(eqn.params["name"]):
                aliases.append(eqn.params["input_output_aliases"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss, argnums=1))(q, bias).jaxpr)
    assert aliases == [()]


def test_a_mask_mod_without_arguments_is_evaluated_on_the_host(monkeypatch):
    """A causal `mask_mod`: the lower triangle of 4 x 4 tiles (10 of 16) is visited."""
    built = _maps(monkeypatch)
    case = Case(t=64, s=64, kwargs=(("mask_mod", lambda b, h, i, j: j <= i),))
    _run(case, jnp.float32, INTERPRET)
    bm = built[0]
    assert not bm.per_batch
    assert list(np.ravel(bm.kv_count)) == [1, 2, 3, 4] and int(np.sum(bm.q_count)) == 10


def test_a_long_mask_mod_is_mapped_on_the_host_block_by_block():
    """At 8k x 8k (67M evaluations, evaluated a band of query blocks at a time) the documents and prefix-LM
    `mask_mod`s give exactly the tiles they touch: the bench_tpu rows' shapes (blocks of 128 queries, 512 keys)."""
    from attnlib._src import modifiers
    from attnlib._src.backends.pallas_tpu.flex import block_map

    qi, kj = np.arange(64)[:, None], np.arange(16)[None, :]
    docs = modifiers.describe(None, lambda b, h, i, j: i // 512 == j // 512, ())
    tiles = block_map.static_mask_mod(docs, 2, 32, 8192, 8192, 0, 128, 512)
    np.testing.assert_array_equal(tiles.visits, qi // 4 == kj)
    np.testing.assert_array_equal(tiles.full, qi // 4 == kj)  # each visited tile lies inside one document
    prefix = modifiers.describe(None, lambda b, h, i, j: (j <= i) | (j < 1024), ())
    tiles = block_map.static_mask_mod(prefix, 2, 32, 8192, 8192, 0, 128, 512)
    np.testing.assert_array_equal(tiles.visits, (kj * 512 <= qi * 128 + 127) | (kj < 2))  # starts by the last query
    np.testing.assert_array_equal(tiles.full, (kj * 512 + 511 <= qi * 128) | (kj < 2))  # ends by the first
    # bottom-right (offset S - T) and ragged edges: 1000 queries over 1300 keys, blocks of 128 x 256
    tiles = block_map.static_mask_mod(prefix, 1, 1, 1000, 1300, 300, 128, 256)
    i, j = np.arange(1000)[:, None] + 300, np.arange(1300)[None, :]
    dense = np.zeros((1024, 1536), bool)
    dense[:1000, :1300] = (j <= i) | (j < 1024)
    np.testing.assert_array_equal(tiles.visits, dense.reshape(8, 128, 6, 256).any(axis=(1, 3)))
    padded = np.ones((1024, 1536), bool)  # the mask_mod's part of `full`: padding is `static_tiles`' business
    padded[:1000, :1300] = dense[:1000, :1300]
    np.testing.assert_array_equal(tiles.full, padded.reshape(8, 128, 6, 256).all(axis=(1, 3)))


def test_runtime_structure_reduces_the_map_on_the_device(monkeypatch):
    """Padding lengths: tiles past a row's lengths are skipped, per batch row, from a map reduced on the device
    (the grid keeps every key block; the lists end early)."""
    built = _maps(monkeypatch)
    case = Case(t=64, s=64, kwargs=(("key_value_seq_lengths", np.asarray([20, 64], np.int32)), ("is_causal", True),
                                    ("mask_mod", lambda b, h, i, j: j <= i)))  # fmt: skip
    q, k, v = _arrays(case, jnp.float32)
    attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case))  # eagerly: the map is concrete
    bm = built[0]
    assert bm.per_batch and bm.width_k == 4
    np.testing.assert_array_equal(np.reshape(bm.kv_count, (2, 4)), [[1, 2, 2, 2], [1, 2, 3, 4]])
    # full: below the diagonal and inside the row's keys (the second block of row 0 holds 4 of its 16 keys)
    want_full = [[[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]],
                 [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]]  # fmt: skip
    np.testing.assert_array_equal(np.reshape(bm.kv_full, (2, 4, 4)), want_full)
    _check(case, jnp.float32, INTERPRET)


# ------------------------------------------------------------------------------------------------------------------
# declines


FLEX_DECLINES = {
    "gather": (
        dict(score_mod=lambda s, b, h, i, j: s + jnp.asarray([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])[h]),
        "closed-over array",
    ),
    "float16": (dict(dtype=jnp.float16), "float16 inputs"),
    "head_dim": (dict(hv=300), "Hv=300"),
}


@pytest.mark.parametrize("name", list(FLEX_DECLINES))
def test_flex_declines_with_a_reason(name):
    kw, match = FLEX_DECLINES[name]
    kw = dict(kw)
    dtype, hv = kw.pop("dtype", jnp.float32), kw.pop("hv", 8)
    r = rng(3)
    q, k, v = normal(r, (2, 37, 6, 8), dtype), normal(r, (2, 53, 2, 8), dtype), normal(r, (2, 53, 2, hv), dtype)
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **kw)
    assert explanation.implementation is None
    reason = explanation.declined["pallas_tpu"]
    assert "attnlib's flex kernel: " in reason and match in reason.split("attnlib's flex kernel: ")[1], reason
    with pytest.raises(NotImplementedError, match="flex kernel"):
        attnlib.attention(q, k, v, implementation=INTERPRET, **kw)


def test_a_traced_closure_declines_and_falls_back():
    q, k, v = _arrays(Case(), jnp.float32)

    @jax.jit
    def f(q, k, v, t):
        out = attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * t, implementation=(INTERPRET, "xla"))
        return out

    out = f(q, k, v, jnp.float32(0.5))
    want = attnlib.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, implementation="xla")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_a_bfloat16_score_mod_arg_gets_its_gradient():
    """A bfloat16 `score_mod_args` array is a float: its gradient is computed (NumPy's `issubdtype` does not count
    bfloat16 as a float; the kernel once returned no gradient for it, a silent zero), as `xla` gives it."""
    case = CASES["score_mod_alibi"]
    q, k, v = _arrays(case, jnp.float32)
    slopes = jnp.asarray([0.1, -0.2, 0.3, 0.25, -0.15, 0.05], jnp.bfloat16)[:, None, None]
    alibi_16 = lambda s, b, h, i, j, slope: alibi(s, b, h, i, j, slope.astype(jnp.float32))  # noqa: E731

    def grad(implementation):
        def loss(m):
            out = attnlib.attention(q, k, v, is_causal=True, score_mod=alibi_16, score_mod_args=(m,),
                                    implementation=implementation)  # fmt: skip
            return jnp.sum(out)

        return jax.jit(jax.grad(loss))(slopes)

    got, want = grad(INTERPRET), grad("xla")
    assert got.dtype == jnp.bfloat16 and float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0
    assert_grad_close(got, np.asarray(want.astype(jnp.float32), np.float64), jnp.bfloat16, what="d slopes")


def test_the_kernel_option_picks_splash_or_the_flex_kernel():
    """`PallasTpu(kernel=...)`: "flex" runs the flex kernel on a call splash serves (and matches the reference),
    "splash" declines what splash cannot serve, naming it; "auto" is splash first."""
    case = CASES["causal_top_left"]
    q, k, v = _arrays(case, jnp.float32)
    flex = attnlib.PallasTpu(interpret=True, flex_blocks=(16, 16), kernel="flex")
    note = attnlib.explain(q, k, v, implementation=flex, **_kwargs(case)).kernel
    assert note == "runs attnlib's flex kernel (kernel='flex')"
    assert attnlib.explain(q, k, v, implementation=INTERPRET, **_kwargs(case)).kernel is None  # splash
    _check(case, jnp.float32, flex)
    splash_only = attnlib.PallasTpu(interpret=True, kernel="splash")
    explanation = attnlib.explain(q, k, v, bias=jnp.zeros(q.shape[:1] + (1, q.shape[1], k.shape[1])),
                                  implementation=(splash_only, "xla"))  # fmt: skip
    assert explanation.implementation == "xla"
    reason = explanation.declined["pallas_tpu"]
    assert reason == "`bias` is not supported: splash takes no additive bias (kernel='splash')"
    with pytest.raises(ValueError, match="`kernel` must be one of"):
        attnlib.PallasTpu(kernel="mosaic")


def test_bad_flex_blocks_are_named():
    with pytest.raises(ValueError, match="`flex_blocks`"):
        attnlib.PallasTpu(flex_blocks=(12, 16))


# ------------------------------------------------------------------------------------------------------------------
# on a TPU


@pytest.mark.tpu
@pytest.mark.parametrize("name", list(CASES) + list(COMBINATIONS))
def test_tpu_flex_matches_reference_bfloat16(name, monkeypatch):
    _force_flex(monkeypatch)
    _check({**CASES, **COMBINATIONS}[name], jnp.bfloat16, attnlib.PallasTpu())


@pytest.mark.tpu
@pytest.mark.parametrize("name", list(DROPOUT))
def test_tpu_flex_dropout(name):
    case, rate, key = DROPOUT[name], 0.3, jax.random.key(5)
    B = int(np.prod(case.batch)) if case.batch else 1
    keep = np.asarray(dropout_keep_mask(key, rate, (B, case.n, case.t, case.s)))
    _check(case, jnp.bfloat16, attnlib.PallasTpu(), ref_more=dict(dropout_keep=keep), dropout_rate=rate,
           dropout_key=key)  # fmt: skip


TPU_TILES = {  # several 128-key blocks, so that wholly visible tiles (the unmasked body) occur on the TPU too
    "causal_bottom_right": Case(t=300, s=460, kwargs=(("is_causal", True), ("diagonal_alignment", "bottom_right"))),
    "alibi_window": Case(
        t=384, s=384, kwargs=(("score_mod", alibi), ("score_mod_args", (_f32((6, 1, 1), 31),)),
                              ("local_window_size", (200, 0))), extras=("score_mod_args",),
    ),  # fmt: skip
    "documents_mask_mod": Case(
        t=384, s=512, kwargs=(("mask_mod", lambda b, h, i, j: i // 192 == j // 256),),
    ),
}


@pytest.mark.full
@pytest.mark.parametrize("name", list(TPU_TILES))
def test_tpu_sized_tiles_interpreted(name, monkeypatch):
    _force_flex(monkeypatch)
    _check(TPU_TILES[name], jnp.float32, attnlib.PallasTpu(interpret=True, flex_blocks=(32, 128)))


@pytest.mark.tpu
@pytest.mark.parametrize("name", list(TPU_TILES))
def test_tpu_flex_full_and_partial_tiles(name, monkeypatch):
    _force_flex(monkeypatch)
    _check(TPU_TILES[name], jnp.bfloat16, attnlib.PallasTpu(flex_blocks=(32, 128)))


# float32 under "highest" on a TPU (the flex kernel, with the device's own float32 costs in the bound):
# `tests/test_pallas_tpu.py::test_tpu_float32_under_highest_precision_runs_the_flex_kernel`.


# ------------------------------------------------------------------------------------------------------------------
# transformations and the caller's settings


def test_under_x64_and_strict_promotion(monkeypatch):
    """The caller's `jax_enable_x64` and strict promotion do not reach the kernels (`kernel_settings.as_written`)."""
    _force_flex(monkeypatch)
    case = CASES["score_mod_alibi"]
    q, k, v = _arrays(case, jnp.float32)
    kw = _kwargs(case)
    want = attnlib.attention(q, k, v, implementation="xla", **kw)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        got = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **kw))(q, k, v)
        grads = jax.grad(lambda q: jnp.sum(attnlib.attention(q, k, v, implementation=INTERPRET, **kw)))(q)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    want_grads = jax.grad(lambda q: jnp.sum(attnlib.attention(q, k, v, implementation="xla", **kw)))(q)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-4, atol=1e-4)


def test_vmap_and_grad(monkeypatch):
    _force_flex(monkeypatch)
    case = CASES["bias_keys_only"]
    q, k, v = _arrays(case, jnp.float32)
    bias = jnp.asarray(dict(case.kwargs)["bias"])

    def loss(impl):
        f = lambda q, k, v, bias: jnp.sum(attnlib.attention(q, k, v, bias, implementation=impl) ** 2)
        return jax.vmap(jax.grad(f, argnums=(0, 3)), in_axes=(0, 0, 0, None))

    got = loss(INTERPRET)(q[:, None], k[:, None], v[:, None], bias[:1])
    want = loss("xla")(q[:, None], k[:, None], v[:, None], bias[:1])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_mask_mod_with_arguments_is_reduced_on_the_device(monkeypatch):
    """Document ids through `score_mod_args`: the tiles between different documents are skipped (map on the
    device), and the numbers are the reference's."""
    built = _maps(monkeypatch)
    docs = np.repeat(np.arange(4), 16)[None].repeat(2, axis=0).astype(np.int32)  # 4 documents of 16 tokens
    args = (docs[:, None, :, None], docs[:, None, None, :])
    case = Case(t=64, s=64, kwargs=(("mask_mod", same_doc_only), ("score_mod_args", args)))
    q, k, v = _arrays(case, jnp.float32)
    attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case))
    bm = built[0]
    assert bm.per_batch
    np.testing.assert_array_equal(np.reshape(bm.kv_count, (2, 4)), [[1, 1, 1, 1], [1, 1, 1, 1]])
    _check(case, jnp.float32, INTERPRET)


def same_doc_only(batch, head, q_idx, kv_idx, doc_q, doc_k):
    return doc_q == doc_k


def test_max_logit_and_remat(monkeypatch):
    _force_flex(monkeypatch)
    case = CASES["bias_heads"]
    q, k, v = _arrays(case, jnp.float32)
    kw = _kwargs(case)
    out, max_logit = attnlib.attention(q, k, v, implementation=INTERPRET, return_max_logit=True, **kw)
    want, want_max = attnlib.attention(q, k, v, implementation="xla", return_max_logit=True, **kw)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(max_logit, want_max, rtol=2e-5, atol=2e-5)
    f = jax.checkpoint(lambda q: jnp.sum(attnlib.attention(q, k, v, implementation=INTERPRET, **kw) ** 2))
    g = jax.grad(lambda q: jnp.sum(attnlib.attention(q, k, v, implementation="xla", **kw) ** 2))
    np.testing.assert_allclose(jax.grad(f)(q), g(q), rtol=1e-4, atol=1e-4)


def test_automatic_dispatch_on_a_tpu_picks_the_flex_kernel(monkeypatch):
    """On a TPU (simulated: nothing runs) a long call with a bias runs on pallas_tpu's flex kernel; explain says so."""
    from helpers import on_a_simulated_tpu

    on_a_simulated_tpu(monkeypatch)
    q = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((1, 8, 1024, 1024), jnp.bfloat16)
    explanation = attnlib.explain(q, kv, kv, bias=bias, is_causal=True)
    assert explanation.implementation == "pallas_tpu"
    assert explanation.kernel == (
        "runs attnlib's flex kernel (splash declined: `bias` is not supported: splash takes no additive bias)"
    )
    assert str(explanation).startswith("attnlib would run: pallas_tpu, which runs attnlib's flex kernel")
    plain = attnlib.explain(q, kv, kv, is_causal=True)
    assert plain.implementation == "pallas_tpu" and plain.kernel is None  # splash


def test_skipped_tiles_are_neither_loaded_nor_computed(monkeypatch):
    """Keys that a `mask_mod` hides from every query hold NaN: a tile that read them would turn its rows' output (and
    gradients) into NaN (`0 · NaN`), so finite results equal to those with finite keys there show the tiles are
    skipped, forward and backward."""
    built = _maps(monkeypatch)
    case = Case(t=64, s=64, kwargs=(("mask_mod", lambda b, h, i, j: j < 32),))
    q, k, v = _arrays(case, jnp.float32)
    hide = lambda x: x.at[:, 32:].set(jnp.nan)
    f = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case)))
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)))
    out, grads = f(q, hide(k), hide(v)), g(q, hide(k), hide(v))
    assert list(np.ravel(built[0].kv_count)) == [2, 2, 2, 2]
    np.testing.assert_array_equal(out, f(q, k, v))
    for a, b in zip(grads, g(q, k, v), strict=True):
        np.testing.assert_array_equal(a[:, :32], b[:, :32])
    assert np.isfinite(np.asarray(grads[0])).all()


@pytest.mark.parametrize(
    "t, s, band, offset",
    [(37, 53, (5, 3), 0), (53, 37, (None, 0), -16), (40, 40, (7, None), 0), (29, 61, (2, -3), 32), (64, 64, None, 0)],
)
def test_static_tiles_match_the_elementwise_band(t, s, band, offset):
    """The host map from each tile's range of `j - i` equals `any` of the elementwise band over the tile, and its
    full tiles `all` of it."""
    from attnlib._src.backends.pallas_tpu.flex import block_map
    from attnlib._src.backends.pallas_tpu.flex.plan import Plan

    plan = Plan(B=1, K=1, G=1, T=t, S=s, block_q=8, block_k=16, head_dim=128, value_head_dim=128, dtype=np.float32,
                band=band, soft_cap=None, bias=None, mask=None, args=(), arg_grads=(), modifiers=None, thd=False,
                dropout_rate=0.0, sinks=False, precision=None, interpret=True)  # fmt: skip
    i = np.arange(plan.Tp)[:, None]
    j = np.arange(plan.Sp)[None, :]
    want = (i < t) & (j < s)
    if band is not None:
        d = j - (i + offset)
        want &= (d >= -band[0]) if band[0] is not None else True
        want &= (d <= band[1]) if band[1] is not None else True
    tiles = block_map.static_tiles(plan, offset, None)
    np.testing.assert_array_equal(tiles.visits[0], want.reshape(plan.nq, 8, plan.nk, 16).any(axis=(1, 3)))
    np.testing.assert_array_equal(tiles.full[0], want.reshape(plan.nq, 8, plan.nk, 16).all(axis=(1, 3)))


def test_a_mask_mod_left_to_the_kernel_leaves_no_tile_full():
    """A `mask_mod` the host did not evaluate (traced constants, or too large) runs in the kernel on every tile, so
    `static_tiles` flags no tile wholly visible (the unmasked body would skip it); evaluated, its full tiles show."""
    from attnlib._src import modifiers
    from attnlib._src.backends.pallas_tpu.flex import block_map
    from attnlib._src.backends.pallas_tpu.flex.plan import Plan

    causal = modifiers.describe(None, lambda b, h, i, j: j <= i, ())
    plan = Plan(B=1, K=1, G=1, T=64, S=64, block_q=16, block_k=16, head_dim=128, value_head_dim=128, dtype=np.float32,
                band=None, soft_cap=None, bias=None, mask=None, args=(), arg_grads=(), modifiers=causal, thd=False,
                dropout_rate=0.0, sinks=False, precision=None, interpret=True)  # fmt: skip
    left = block_map.static_tiles(plan, 0, None)
    assert left.visits.all() and not left.full.any()
    evaluated = block_map.static_tiles(plan, 0, block_map.static_mask_mod(causal, 1, 1, 64, 64, 0, 16, 16))
    qi, kj = np.arange(4)[:, None], np.arange(4)[None, :]
    np.testing.assert_array_equal(evaluated.visits[0], kj <= qi)
    np.testing.assert_array_equal(evaluated.full[0], kj < qi)
