"""Conformance: every plain-JAX implementation × dtype × feature against the float64 reference.

Each case checks, against `tests/reference.py`:
  * forward `out` (dtype = query dtype) and `lse` (float32, `return_residual=True`);
  * the VJP with a random output cotangent: gradients w.r.t. query, key, value, bias and sinks (not for paged KV,
    which the contract exempts);
  * rows with no visible key (and no sinks): `out` exactly 0, `lse` exactly -inf, query gradient exactly 0;
  * no NaN anywhere; bitwise determinism of a re-run.

`xla_chunked` runs twice: with its default key block and as `attnlib.XlaChunked(block_k=5)`, so that S = 17 (or 12
for paged) spans several blocks with a ragged last one.

`cudnn` runs the same cases in the dtypes it serves (bfloat16 over the whole table, float16 over `F16_FEATURES`), with
the same shared tolerances (those of the cuDNN suites, `test_cudnn_gpu.py`, are the same per dtype):
  * `cudnn-emulated`: on the CPU, with attnlib's whole cuDNN wrapper running over the CPU emulation of its graphs
    (`tests/cudnn_emulation.py`, as on an H200 with cuDNN 9.19);
  * `cudnn` (`-m gpu`): the real one.
A feature cuDNN declines is skipped with the reason `attnlib.explain` gives, and so is dropout (cuDNN draws its mask
with its own generator, docs/semantics.md, so the reference's mask does not apply). cuDNN's backward is bitwise
reproducible only with `deterministic_backward=True` (docs/semantics.md): the re-run checks its gradients only then.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import emulate_graph, install as install_cudnn_emulation
from helpers import (
    assert_finite,
    assert_grad_close,
    assert_lse_close,
    assert_matches_finite_differences,
    assert_out_close,
    B,
    bitwise_equal,
    DTYPE_IDS,
    DTYPES,
    HV,
    K,
    lengths,
    N,
    normal,
    qkv,
    S,
    segment_ids_from_runs,
    T,
    to_f64,
)
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.dropout import dropout_keep_mask


# ------------------------------------------------------------------------------------------------------------------
# implementations

SMALL_BLOCK_K = 5
IMPLS = ["xla", "xla_chunked", attnlib.XlaChunked(block_k=SMALL_BLOCK_K)]
IMPL_IDS = ["xla", "xla_chunked", f"xla_chunked-bk{SMALL_BLOCK_K}"]


@pytest.fixture(params=IMPLS, ids=IMPL_IDS)
def impl(request):
    return request.param


# cuDNN: `CUDNN_EMULATED` on the CPU emulation of its graphs, and the real one (`-m gpu`), in its 16-bit dtypes.
CUDNN_EMULATED = "cudnn-emulated"
CUDNN_PARAMS = [(CUDNN_EMULATED, ()), ("cudnn", (pytest.mark.gpu,))]
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


# ------------------------------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    arrays: dict  # every array argument (traced under jit): query, key, value, bias, mask, lengths, ids, ...
    static: dict  # python-valued keyword arguments
    grad: bool = True

    @property
    def diff_names(self):
        return [n for n in ("query", "key", "value", "bias", "sinks") if n in self.arrays] if self.grad else []


def make_case(query, key, value, *, grad=True, **kwargs):
    arrays = {"query": query, "key": key, "value": value}
    static = {}
    for name, x in kwargs.items():
        if x is None:
            continue
        if isinstance(x, jax.Array):
            arrays[name] = x
        else:
            static[name] = x
    return Case(arrays, static, grad)


def call_attention(impl, arrays, static, return_residual=True):
    a = dict(arrays)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    bias, mask = a.pop("bias", None), a.pop("mask", None)
    return attnlib.attention(
        q, k, v, bias, mask, implementation=impl, return_residual=return_residual, **a, **static
    )


def dropout_shape(case: Case) -> tuple[int, int, int, int]:
    """`(B, N, T, S)` of the library's keep mask (flattened *B; THD B = 1; paged S = pages_per_seq * page_size)."""
    q, k = case.arrays["query"], case.arrays["key"]
    if "cu_seqlens_q" in case.arrays:
        return (1, q.shape[-2], q.shape[0], k.shape[0])
    if "page_table" in case.arrays:
        pt = case.arrays["page_table"]
        return (pt.shape[0], q.shape[-2], q.shape[-3], pt.shape[1] * k.shape[1])
    return (math.prod(q.shape[:-3]), q.shape[-2], q.shape[-3], k.shape[-3])


def reference_kwargs(case: Case) -> dict:
    kw = {name: to_f64(x) for name, x in case.arrays.items() if name != "dropout_key"}
    kw.update(case.static)
    if case.static.get("dropout_rate", 0.0) > 0:
        kw["dropout_keep"] = np.asarray(
            dropout_keep_mask(case.arrays["dropout_key"], case.static["dropout_rate"], dropout_shape(case))
        )
    return kw


# Each builder takes (numpy Generator, dtype) and returns a Case. Sizes default to helpers' odd distinct
# B=2, T=13, S=17, N=6, K=2, H=8 (Hv=5 for MLA).


def _base(r, d, **kw):
    q, k, v = qkv(r, dtype=d)
    return make_case(q, k, v, **kw)


def _bias(shape):
    return lambda r, d: _base(r, d, bias=normal(r, shape, d))


def _bias_neg_inf(r, d):
    # an additive mask: -inf at ~30% of the entries, every row keeps at least one finite logit
    bias = r.standard_normal((B, N, T, S)).astype(np.float32)
    bias[r.random((B, N, T, S)) < 0.3] = -np.inf
    bias[..., 0] = 0.0
    return _base(r, d, bias=jnp.asarray(bias).astype(d))


def _mask_full(r, d):
    m = r.random((B, N, T, S)) < 0.7
    m[0, 1, 2, :] = False  # one fully masked row
    m[1, :, 5, :] = False  # one row masked on every head
    return _base(r, d, mask=jnp.asarray(m))


def _mask_ts(r, d):
    m = r.random((T, S)) < 0.6
    m[4, :] = False
    return _base(r, d, mask=jnp.asarray(m))


def _qkv_ts(r, d, t, s, **kw):
    q, k, v = qkv(r, t=t, s=s, dtype=d)
    return make_case(q, k, v, **kw)


def _segments_cross(r, d, **kw):
    # q: ids 1, 2, 7 (7 has no keys -> fully masked rows), 5, then padding; kv: ids 1, 2, 5, then padding
    qs = np.stack(
        [
            segment_ids_from_runs([(1, 4), (2, 3), (7, 2), (5, 2)], T),
            segment_ids_from_runs([(3, 6), (4, 7)], T),
        ]
    )
    ks = np.stack(
        [
            segment_ids_from_runs([(1, 6), (2, 3), (5, 5)], S),
            segment_ids_from_runs([(3, 2), (4, 12)], S),
        ]
    )
    return _base(r, d, q_segment_ids=jnp.asarray(qs), kv_segment_ids=jnp.asarray(ks), **kw)


def _segments_self(r, d, **kw):
    # T == S; kv_segment_ids defaults to q_segment_ids
    q, k, v = qkv(r, t=T, s=T, dtype=d)
    ids = np.stack(
        [
            segment_ids_from_runs([(1, 5), (2, 4), (3, 2)], T),
            segment_ids_from_runs([(9, 1), (4, 12)], T),
        ]
    )
    return make_case(q, k, v, q_segment_ids=jnp.asarray(ids), **kw)


def _thd(r, d, **kw):
    # 4 sequences; sequence 1 empty in both; sequence 2 has queries but no keys; rows past cu[-1] are padding.
    tq, tk = T, S
    q = normal(r, (tq, N, 8), d)
    k = normal(r, (tk, K, 8), d)
    v = normal(r, (tk, K, 8), d)
    cu_q = lengths([0, 3, 3, 7, 11])
    cu_kv = lengths([0, 5, 5, 5, 14])
    return make_case(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kw)


def _paged(r, d, t=7, hv=HV, **kw):
    page_size, num_pages, pages_per_seq = 4, 9, 3
    q = normal(r, (B, t, N, 8), d)
    k = normal(r, (num_pages, page_size, K, 8), d)
    v = normal(r, (num_pages, page_size, K, hv), d)
    table = lengths([[5, 1, 7], [2, 8, 0]])  # unordered pages; sequence 1 uses page 0 last
    assert table.shape == (B, pages_per_seq)
    return make_case(q, k, v, page_table=table, key_value_seq_lengths=lengths([10, 7]), grad=False, **kw)


def _sinks(r, d, **kw):
    return _base(r, d, sinks=normal(r, (N,), jnp.float32), **kw)


FEATURES: list[tuple[str, Callable]] = [
    ("mha", lambda r, d: make_case(*qkv(r, n=3, k=3, dtype=d))),
    ("gqa", _base),
    ("mqa", lambda r, d: make_case(*qkv(r, k=1, dtype=d))),
    ("mla", lambda r, d: make_case(*qkv(r, hv=HV, dtype=d))),
    ("unbatched", lambda r, d: make_case(*qkv(r, batch=(), dtype=d))),
    ("batch_2x3", lambda r, d: make_case(*qkv(r, batch=(2, 3), t=5, s=7, dtype=d))),
    ("empty_batch", lambda r, d: make_case(*qkv(r, batch=(0,), dtype=d))),
    ("single_token", lambda r, d: make_case(*qkv(r, t=1, s=1, dtype=d), is_causal=True)),
    (
        "batch_2x3_bias_mask_lengths",
        lambda r, d: make_case(
            *qkv(r, batch=(2, 3), t=5, s=7, dtype=d),
            bias=normal(r, (3, 1, 5, 7), d),
            mask=jnp.asarray(r.random((2, 1, 1, 1, 7)) < 0.8),
            query_seq_lengths=lengths([[5, 0, 3], [4, 5, 1]]),
            key_value_seq_lengths=lengths([[7, 2, 6], [0, 7, 5]]),
            is_causal=True,
            diagonal_alignment="bottom_right",
        ),
    ),
    (
        "batch_2x3_segments",
        lambda r, d: make_case(
            *qkv(r, batch=(2, 3), t=5, s=7, dtype=d),
            q_segment_ids=jnp.asarray(np.stack([np.stack([segment_ids_from_runs(runs, 5) for runs in row])
                                                for row in [[[(1, 2), (2, 3)], [(1, 5)], [(4, 1)]],
                                                            [[(2, 4)], [(1, 1), (3, 3)], []]]])),
            kv_segment_ids=jnp.asarray(np.stack([np.stack([segment_ids_from_runs(runs, 7) for runs in row])
                                                 for row in [[[(1, 3), (2, 4)], [(1, 6)], [(4, 7)]],
                                                             [[(2, 2), (5, 2)], [(1, 3), (3, 3)], [(1, 7)]]]])),
            is_causal=True,
            diagonal_alignment="bottom_right",
        ),
    ),  # fmt: skip
    ("scale", lambda r, d: _base(r, d, scale=0.3)),
    ("deterministic_backward", lambda r, d: _base(r, d, is_causal=True, deterministic_backward=True)),
    ("bias_BNTS", _bias((B, N, T, S))),
    ("bias_TS", _bias((T, S))),
    ("bias_N1S", _bias((N, 1, S))),
    ("bias_B11S", _bias((B, 1, 1, S))),
    ("bias_11T1", _bias((1, 1, T, 1))),
    ("bias_neg_inf", _bias_neg_inf),
    ("mask_BNTS", _mask_full),
    ("mask_TS", _mask_ts),
    ("causal_tl_T<S", lambda r, d: _base(r, d, is_causal=True)),
    ("causal_tl_T>S", lambda r, d: _qkv_ts(r, d, 17, 11, is_causal=True)),
    ("causal_br_T<S", lambda r, d: _base(r, d, is_causal=True, diagonal_alignment="bottom_right")),
    ("causal_br_T>S", lambda r, d: _qkv_ts(r, d, 17, 11, is_causal=True, diagonal_alignment="bottom_right")),
    ("window_int", lambda r, d: _base(r, d, local_window_size=3)),
    ("window_lr", lambda r, d: _base(r, d, local_window_size=(4, 1))),
    ("window_lr_br", lambda r, d: _base(r, d, local_window_size=(2, 0), diagonal_alignment="bottom_right")),
    ("window_causal", lambda r, d: _base(r, d, local_window_size=(3, 3), is_causal=True)),
    ("q_lengths", lambda r, d: _base(r, d, query_seq_lengths=lengths([9, 0]))),
    ("kv_lengths", lambda r, d: _base(r, d, key_value_seq_lengths=lengths([0, 4]))),
    (
        "lengths_causal_br_window",
        lambda r, d: _base(
            r,
            d,
            query_seq_lengths=lengths([10, 13]),
            key_value_seq_lengths=lengths([15, 6]),
            is_causal=True,
            diagonal_alignment="bottom_right",
            local_window_size=(3, 1),
        ),
    ),
    (
        "lengths_causal_tl",
        lambda r, d: _base(
            r, d, query_seq_lengths=lengths([7, 13]), key_value_seq_lengths=lengths([16, 3]), is_causal=True
        ),
    ),
    ("segments_self", _segments_self),
    ("segments_self_causal_tl", lambda r, d: _segments_self(r, d, is_causal=True)),
    ("segments_cross", _segments_cross),
    ("segments_cross_max_segments", lambda r, d: _segments_cross(r, d, max_segments_per_row=4)),
    ("segments_cross_causal_tl", lambda r, d: _segments_cross(r, d, is_causal=True)),
    (
        "segments_cross_causal_br",
        lambda r, d: _segments_cross(r, d, is_causal=True, diagonal_alignment="bottom_right"),
    ),
    (
        "segments_cross_window_br",
        lambda r, d: _segments_cross(r, d, local_window_size=(1, 2), diagonal_alignment="bottom_right"),
    ),
    ("thd", _thd),
    ("thd_causal_tl", lambda r, d: _thd(r, d, is_causal=True)),
    ("thd_causal_br_sinks", lambda r, d: _thd(r, d, is_causal=True, diagonal_alignment="bottom_right",
                                              sinks=normal(r, (N,), jnp.float32))),
    ("thd_window_maxseqlen", lambda r, d: _thd(r, d, local_window_size=(1, 1), max_seqlen_q=4, max_seqlen_kv=9)),
    ("thd_dropout_bias", lambda r, d: _thd(r, d, is_causal=True, dropout_rate=0.3, dropout_key=jax.random.key(5),
                                           bias=normal(r, (N, T, S), d))),
    ("paged", _paged),
    ("paged_sinks_dropout_qlen", lambda r, d: _paged(r, d, is_causal=True, diagonal_alignment="bottom_right",
                                                     sinks=normal(r, (N,), jnp.float32), dropout_rate=0.25,
                                                     dropout_key=jax.random.key(9),
                                                     query_seq_lengths=lengths([7, 3]))),
    ("paged_causal_br", lambda r, d: _paged(r, d, is_causal=True, diagonal_alignment="bottom_right")),
    # Decoding: one query row, bottom-right causal (it sees every key of its sequence) and top-left.
    ("paged_decode_causal_br", lambda r, d: _paged(r, d, t=1, is_causal=True, diagonal_alignment="bottom_right")),
    # The same with equal head dims, which cuDNN's paged graphs take (they decline Hv = 5).
    ("paged_hv8", lambda r, d: _paged(r, d, hv=8)),
    ("paged_decode_causal_br_hv8", lambda r, d: _paged(r, d, t=1, hv=8, is_causal=True,
                                                       diagonal_alignment="bottom_right")),
    ("decode_causal_br_lengths_window", lambda r, d: make_case(
        *qkv(r, t=1, dtype=d), key_value_seq_lengths=lengths([S, 6]), is_causal=True,
        diagonal_alignment="bottom_right", local_window_size=(3, 2))),
    ("decode_causal_top_left", lambda r, d: make_case(*qkv(r, t=1, dtype=d), is_causal=True)),
    # A few query rows over 1024+ keys: cuDNN's backward runs in plain JAX from the forward's lse (`lse_backward`).
    ("decode_long_keys_lengths_window", lambda r, d: make_case(
        *qkv(r, t=1, s=1031, dtype=d), key_value_seq_lengths=lengths([1031, 517]), is_causal=True,
        diagonal_alignment="bottom_right", local_window_size=(700, 0))),
    ("short_query_long_keys_bias_sinks_lengths", lambda r, d: make_case(
        *qkv(r, t=3, s=1029, dtype=d), bias=normal(r, (N, 3, 1029), d), sinks=normal(r, (N,), jnp.float32),
        key_value_seq_lengths=lengths([0, 800]))),
    ("short_query_long_keys_lengths_causal_br", lambda r, d: make_case(
        *qkv(r, t=4, s=1030, dtype=d), query_seq_lengths=lengths([4, 2]), key_value_seq_lengths=lengths([1030, 600]),
        is_causal=True, diagonal_alignment="bottom_right")),
    ("softcap", lambda r, d: _base(r, d, logits_soft_cap=2.5)),
    ("softcap_bias", lambda r, d: _base(r, d, logits_soft_cap=3.0, bias=normal(r, (N, T, S), d, 2.0))),
    ("sinks", _sinks),
    ("sinks_query_dtype", lambda r, d: _base(r, d, sinks=normal(r, (N,), d))),
    ("sinks_zero", lambda r, d: _base(r, d, sinks=jnp.zeros((N,), jnp.float32))),
    (
        "sinks_fully_masked",
        lambda r, d: _sinks(r, d, key_value_seq_lengths=lengths([0, 9]), is_causal=True,
                            diagonal_alignment="bottom_right", query_seq_lengths=lengths([13, 12])),
    ),
    ("dropout", lambda r, d: _base(r, d, dropout_rate=0.3, dropout_key=jax.random.key(7))),
    (
        "dropout_causal_bias",
        lambda r, d: _base(r, d, dropout_rate=0.5, dropout_key=jax.random.key(3), is_causal=True,
                           bias=normal(r, (1, N, 1, S), d)),
    ),
    (
        "mla_gqa_causal_br_sinks_softcap",
        lambda r, d: make_case(*qkv(r, n=6, k=3, hv=HV, dtype=d), is_causal=True, diagonal_alignment="bottom_right",
                               sinks=normal(r, (6,), jnp.float32), logits_soft_cap=4.0),
    ),
    ("segments_dropout", lambda r, d: _segments_cross(r, d, dropout_rate=0.4, dropout_key=jax.random.key(4))),
    ("segments_causal_sinks", lambda r, d: _segments_cross(r, d, is_causal=True, sinks=normal(r, (N,), jnp.float32))),
    (
        "everything",
        lambda r, d: _base(
            r,
            d,
            bias=normal(r, (B, 1, T, S), d),
            mask=jnp.asarray(r.random((1, N, T, S)) < 0.8),
            is_causal=True,
            diagonal_alignment="bottom_right",
            local_window_size=(6, 2),
            query_seq_lengths=lengths([12, 8]),
            key_value_seq_lengths=lengths([17, 10]),
            logits_soft_cap=5.0,
            sinks=normal(r, (N,), jnp.float32),
            dropout_rate=0.2,
            dropout_key=jax.random.key(11),
        ),
    ),
]
FEATURE_IDS = [f for f, _ in FEATURES]
assert len(set(FEATURE_IDS)) == len(FEATURE_IDS)


def build_case(feature: str, dtype) -> Case:
    """The case of a feature, with a fixed seed per feature (the same inputs for every implementation)."""
    builder = dict(FEATURES)[feature]
    return builder(np.random.default_rng(_seed(feature)), dtype)


def _seed(name: str) -> int:
    return sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**32


@functools.cache
def reference_results(feature: str, dtype_name: str):
    """float64 `(out, lse, grads, d_out)` of a feature case (shared by every implementation)."""
    dtype = jnp.dtype(dtype_name)
    case = build_case(feature, dtype)
    kw = reference_kwargs(case)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    out, lse = reference_attention(q, k, v, bias, mask, **kw)
    r = np.random.default_rng(_seed(feature) + 1)
    d_out = normal(r, out.shape, dtype)
    grads = None
    if case.grad:
        grads = reference_attention_vjp(q, k, v, bias, mask, d_out=to_f64(d_out), **kw)
    return out, lse, grads, d_out


def library_fwd_bwd(impl, case: Case):
    """A jitted `(diff, rest, d_out) -> (out, lse, grads)` for one case (array arguments traced, not baked)."""

    @jax.jit
    def fwd_bwd(diff, rest, d_out):
        f = lambda dd: call_attention(impl, {**rest, **dd}, case.static)
        if not diff:
            out, lse = f({})
            return out, lse, {}
        (out, lse), vjp = jax.vjp(f, diff)
        (g,) = vjp((d_out, jnp.zeros_like(lse)))
        return out, lse, g

    diff = {n: case.arrays[n] for n in case.diff_names}
    rest = {n: x for n, x in case.arrays.items() if n not in diff}
    return lambda d_out: fwd_bwd(diff, rest, d_out)


# The fast tier: `xla` in float32, multi-block `xla_chunked` in bfloat16 and the emulated cuDNN graphs in bfloat16,
# each on every feature group (the ids' first word: `bias`, `mask`, `window`, `segments`, `paged`, ...), and every
# variant of a group on at least one of them (a group's variants take the three in turn; a group of fewer than three
# runs each variant on all three). Everything else is the full matrix (`-m full`).
FAST_IMPLS = ("xla-f32", f"xla_chunked-bk{SMALL_BLOCK_K}-bf16", f"{CUDNN_EMULATED}-bf16")


def _fast_pairs() -> set[tuple[str, str]]:
    groups: dict[str, list[str]] = {}
    for feature in FEATURE_IDS:
        groups.setdefault(feature.split("_")[0], []).append(feature)
    pairs = set()
    for variants in groups.values():
        for i, feature in enumerate(variants):
            impls = FAST_IMPLS if len(variants) < len(FAST_IMPLS) else (FAST_IMPLS[i % len(FAST_IMPLS)],)
            pairs |= {(impl, feature) for impl in impls}
    return pairs


def _conformance_params():
    # every feature on xla and on multi-block xla_chunked in both dtypes; xla_chunked with its default (single, for
    # these sizes) key block in float32 only: its block logic is dtype-independent and CPU CI time is bounded.
    fast = _fast_pairs()
    full = lambda impl: () if (impl, feature) in fast else (pytest.mark.full,)  # noqa: E731
    params = []
    for feature in FEATURE_IDS:
        for dtype, dtype_id in zip(DTYPES, DTYPE_IDS, strict=True):
            for spec, impl_id in zip(IMPLS, IMPL_IDS, strict=True):
                if spec == "xla_chunked" and dtype != jnp.float32:
                    continue
                marks = full(f"{impl_id}-{dtype_id}")
                params.append(pytest.param(spec, feature, dtype, marks=marks, id=f"{impl_id}-{feature}-{dtype_id}"))
            if dtype in CUDNN_DTYPES:
                for spec, marks in CUDNN_PARAMS:
                    if spec == CUDNN_EMULATED:
                        marks = full(f"{spec}-{dtype_id}")
                    params.append(pytest.param(spec, feature, dtype, marks=marks, id=f"{spec}-{feature}-{dtype_id}"))
    return params


@pytest.mark.parametrize("impl_spec,feature,dtype", _conformance_params())
def test_conformance(impl_spec, feature, dtype, monkeypatch):
    check_conformance(cudnn_or_skip(impl_spec, feature, dtype, monkeypatch), feature, dtype)


def cudnn_or_skip(impl_spec, feature: str, dtype, monkeypatch):
    """The implementation to check: `impl_spec`, except `CUDNN_EMULATED` -> `"cudnn"` with the emulation switched on
    (for this test). For cuDNN, skips a case it declines, with `attnlib.explain`'s reason, and dropout."""
    if impl_spec not in ("cudnn", CUDNN_EMULATED):
        return impl_spec
    if impl_spec == CUDNN_EMULATED:
        install_cudnn_emulation(monkeypatch, emulate_graph)
    case = build_case(feature, dtype)
    a = dict(case.arrays)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    bias, mask = a.pop("bias", None), a.pop("mask", None)
    explanation = attnlib.explain(q, k, v, bias, mask, implementation="cudnn", return_residual=True, **a,
                                  **case.static)  # fmt: skip
    if explanation.implementation != "cudnn":
        pytest.skip(f"cudnn declines: {explanation.declined['cudnn']}")
    if case.static.get("dropout_rate", 0.0) > 0:
        pytest.skip("cudnn draws dropout masks with its own generator (docs/semantics.md): no reference to compare")
    return "cudnn"


def check_conformance(impl, feature, dtype):
    case = build_case(feature, dtype)
    ref_out, ref_lse, ref_grads, d_out = reference_results(feature, jnp.dtype(dtype).name)

    run = library_fwd_bwd(impl, case)
    out, lse, grads = run(d_out)
    q = case.arrays["query"]
    assert out.dtype == q.dtype, f"out dtype {out.dtype}, want query dtype {q.dtype}"
    assert lse.dtype == jnp.float32
    assert_out_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)

    # rows with no visible key and no sinks: exactly 0 / -inf / zero gradient
    empty = np.isneginf(ref_lse)
    if empty.any():
        assert (np.asarray(to_f64(out))[empty] == 0).all(), "out of a fully masked row is not exactly 0"
        assert np.isneginf(np.asarray(lse)[empty]).all(), "lse of a fully masked row is not -inf"
    for name in case.diff_names:
        assert grads[name].dtype == case.arrays[name].dtype, f"d{name} dtype {grads[name].dtype}"
        assert_finite(grads[name], f"d{name}")
        assert_grad_close(grads[name], ref_grads[name], dtype, what=f"d{name}")
    if "query" in grads and empty.any():
        dq = np.asarray(to_f64(grads["query"]))
        assert (dq[empty] == 0).all(), "query gradient of a fully masked row is not exactly 0"

    # bitwise determinism of a re-run (cuDNN's backward: only with `deterministic_backward=True`)
    out2, lse2, grads2 = run(d_out)
    assert bitwise_equal(out, out2) and bitwise_equal(lse, lse2)
    if impl == "cudnn" and not case.static.get("deterministic_backward", False):
        return
    for name in grads:
        assert bitwise_equal(grads[name], grads2[name]), f"d{name} differs between two runs"


F16_FEATURES = ["gqa", "causal_br_T>S", "sinks_fully_masked", "bias_BNTS"]


@pytest.mark.parametrize("feature", F16_FEATURES)
def test_conformance_float16(impl, feature):
    # float16 is a supported dtype too (API §1); a smaller matrix than f32/bf16 to keep CPU CI fast
    check_conformance(impl, feature, jnp.float16)


@pytest.mark.parametrize("feature", F16_FEATURES)
@pytest.mark.parametrize("impl_spec", [pytest.param(spec, marks=marks, id=spec) for spec, marks in CUDNN_PARAMS])
def test_conformance_float16_cudnn(impl_spec, feature, monkeypatch):
    check_conformance(cudnn_or_skip(impl_spec, feature, jnp.float16, monkeypatch), feature, jnp.float16)


# ------------------------------------------------------------------------------------------------------------------
# gradients through `lse` (return_residual): random cotangents on both outputs, including on -inf rows (whose
# true gradient is 0: lse is constant there).

LSE_GRAD_FEATURES = ["gqa", "causal_br_T>S", "sinks_fully_masked", "thd_causal_br_sinks", "softcap_bias", "dropout"]


@pytest.mark.parametrize("feature", LSE_GRAD_FEATURES)
def test_lse_cotangent(impl, feature):
    dtype = jnp.float32
    case = build_case(feature, dtype)
    kw = reference_kwargs(case)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    bias, mask = kw.pop("bias", None), kw.pop("mask", None)
    out, lse = reference_attention(q, k, v, bias, mask, **kw)
    r = np.random.default_rng(5)
    d_out = normal(r, out.shape, dtype)
    d_lse = normal(r, lse.shape, jnp.float32)
    ref = reference_attention_vjp(q, k, v, bias, mask, d_out=to_f64(d_out), d_lse=to_f64(d_lse), **kw)

    diff = {n: case.arrays[n] for n in case.diff_names}
    rest = {n: x for n, x in case.arrays.items() if n not in diff}

    @jax.jit
    def grads(diff, rest):
        _, vjp = jax.vjp(lambda dd: call_attention(impl, {**rest, **dd}, case.static), diff)
        return vjp((d_out, d_lse))[0]

    g = grads(diff, rest)
    for name in case.diff_names:
        assert_grad_close(g[name], ref[name], dtype, what=f"d{name}")


# ------------------------------------------------------------------------------------------------------------------
# small hand-computed cases


@pytest.mark.parametrize("impl_name", ["xla", "xla_chunked"])
def test_hand_computed(impl_name):
    # one query, two keys with logits 0 and 1 (scale 1): p = [1, e] / (1 + e)
    q = jnp.asarray([[[1.0]]], jnp.float32)  # [T=1, N=1, H=1]
    k = jnp.asarray([[[0.0]], [[1.0]]], jnp.float32)  # [S=2, K=1, H=1]
    v = jnp.asarray([[[1.0, 0.0]], [[0.0, 1.0]]], jnp.float32)  # [S=2, K=1, Hv=2]
    e = math.e
    # jitted: one compile per call instead of one per operation
    attention = jax.jit(attnlib.attention, static_argnames=("scale", "implementation", "return_residual"))
    out, lse = attention(q, k, v, scale=1.0, implementation=impl_name, return_residual=True)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [1 / (1 + e), e / (1 + e)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse)[0, 0], math.log(1 + e), rtol=1e-6)
    # off-by-one softmax (sink 0): p = [1, e] / (1 + 1 + e)
    out, lse = attention(
        q, k, v, scale=1.0, sinks=jnp.zeros((1,), jnp.float32), implementation=impl_name, return_residual=True
    )
    np.testing.assert_allclose(np.asarray(out)[0, 0], [1 / (2 + e), e / (2 + e)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse)[0, 0], math.log(2 + e), rtol=1e-6)
    # sinks + a fully masked row: out = 0, lse = the sink alone
    sink = jnp.asarray([0.75], jnp.float32)
    out, lse = attention(
        q, k, v, jnp.zeros((1, 1, 2), jnp.float32), jnp.zeros((1, 1, 2), bool), scale=1.0, sinks=sink,
        implementation=impl_name, return_residual=True,
    )  # fmt: skip
    assert (np.asarray(out) == 0).all()
    np.testing.assert_allclose(np.asarray(lse)[0, 0], 0.75, rtol=1e-7)


@pytest.mark.parametrize("impl_name", ["xla", "xla_chunked"])
def test_return_residual_false_and_default_implementation(impl_name):
    q, k, v = qkv(np.random.default_rng(1))
    attention = jax.jit(attnlib.attention, static_argnames="implementation")  # one compile, not one per operation
    out = attention(q, k, v, implementation=impl_name)
    assert isinstance(out, jax.Array) and out.shape == (B, T, N, 8) and out.dtype == jnp.float32
    ref, _ = reference_attention(to_f64(q), to_f64(k), to_f64(v))
    assert_out_close(out, ref, jnp.float32)
    # the default implementation (None) serves the same call with the same semantics
    assert_out_close(attention(q, k, v), ref, jnp.float32)


# ------------------------------------------------------------------------------------------------------------------
# the reference's own analytic backward against central finite differences of its forward (float64, tiny shapes)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(is_causal=True, diagonal_alignment="bottom_right", logits_soft_cap=2.0, sinks=True, dropout=True,
             key_value_seq_lengths=np.array([5, 2]), query_seq_lengths=np.array([3, 1])),
        dict(local_window_size=(1, 0), sinks=True, q_segment_ids=np.array([[1, 1, 2], [0, 3, 3]]),
             kv_segment_ids=np.array([[1, 2, 2, 2, 0], [3, 3, 3, 0, 0]]), is_causal=True),
    ],
    ids=["plain", "causal_br_cap_sinks_dropout_lengths", "segments_window_sinks"],
)  # fmt: skip
def test_reference_vjp_matches_finite_differences(options):
    r = np.random.default_rng(0)
    b, t, s, n, k, h, hv = 2, 3, 5, 4, 2, 3, 2
    options = dict(options)
    args = dict(
        query=r.standard_normal((b, t, n, h)),
        key=r.standard_normal((b, s, k, h)),
        value=r.standard_normal((b, s, k, hv)),
        bias=r.standard_normal((1, n, t, s)),
    )
    if options.pop("sinks", False):
        args["sinks"] = r.standard_normal(n)
    if options.pop("dropout", False):
        options.update(dropout_rate=0.3, dropout_keep=r.random((b, n, t, s)) > 0.3)
    d_out = r.standard_normal((b, t, n, hv))
    d_lse = r.standard_normal((b, t, n))

    def loss(a):
        out, lse = reference_attention(a["query"], a["key"], a["value"], a["bias"], **options,
                                       **({"sinks": a["sinks"]} if "sinks" in a else {}))  # fmt: skip
        return (out * d_out).sum() + np.where(np.isfinite(lse), lse * d_lse, 0.0).sum()

    grads = reference_attention_vjp(
        args["query"], args["key"], args["value"], args["bias"], d_out=d_out, d_lse=d_lse, **options,
        **({"sinks": args["sinks"]} if "sinks" in args else {}),
    )  # fmt: skip
    assert_matches_finite_differences(grads, loss, args)


# ------------------------------------------------------------------------------------------------------------------
# zero-length sequences: either the natural result (T = 0: empty output; S = 0: every row has no visible key, so
# out = 0 and lse = -inf, gradients 0) or a clear `ValueError` naming the argument -- never an internal error.


@pytest.mark.parametrize("t,s", [(0, S), (T, 0)], ids=["T=0", "S=0"])
def test_zero_length_sequences(impl, t, s):
    q, k, v = qkv(np.random.default_rng(0), t=t, s=s, hv=HV)
    try:
        out, lse = jax.jit(lambda q, k, v: call_attention(impl, dict(query=q, key=k, value=v), dict(is_causal=True)))(
            q, k, v
        )
        grads = jax.jit(jax.grad(
            lambda q, k, v: jnp.sum(call_attention(impl, dict(query=q, key=k, value=v), {}, False)),
            argnums=(0, 1, 2),
        ))(q, k, v)  # fmt: skip
    except ValueError as e:
        assert "`query`" in str(e) or "`key`" in str(e), f"unclear error for T={t}, S={s}: {e}"
        return
    assert out.shape == (B, t, N, HV) and lse.shape == (B, t, N)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and (np.asarray(g) == 0).all()


@pytest.mark.parametrize("impl_name", ["xla", "xla_chunked"])
def test_large_logits_are_stable(impl_name):
    # logits of magnitude ~500: the softmax must be evaluated stably (max subtraction), no overflow, no NaN.
    # float32 logits carry an absolute error ~ eps * H * max|q_h k_h| * scale; out inherits it times max|v|.
    q, k, v = qkv(np.random.default_rng(3), hv=HV)
    scale = 60.0
    out, lse = attnlib.attention(q, k, v, scale=scale, is_causal=True, implementation=impl_name,
                                 return_residual=True)  # fmt: skip
    ref_out, ref_lse = reference_attention(to_f64(q), to_f64(k), to_f64(v), scale=scale, is_causal=True)
    logit_err = 8 * 1.2e-7 * 8 * scale * float(np.abs(to_f64(q)).max() * np.abs(to_f64(k)).max())
    vmax = float(np.abs(to_f64(v)).max())
    np.testing.assert_allclose(np.asarray(out, np.float64), ref_out, atol=1e-5 + logit_err * vmax, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse, np.float64), ref_lse, atol=1e-5 + logit_err, rtol=1e-6)
    assert np.abs(ref_lse).max() > 100  # the case is what it claims to be
