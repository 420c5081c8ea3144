"""GPU tests of cuDNN THD (`cu_seqlens_*`), packed rows (`*_segment_ids`) and paged key/value caches.

Everything is compared with `attnlib.attention(..., implementation="xla")` evaluated in float32 on the same rounded
inputs, with the tolerances of `test_cudnn_gpu.py` (derived from the dtype's epsilon, never tuned). Rows outside
every sequence must be exactly 0 in the output and gradients, with `lse = -inf`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_cudnn_gpu as dense  # the dense GPU tests' helpers (same directory)


pytestmark = pytest.mark.gpu

DTYPES, DTYPE_IDS = dense.DTYPES, dense.DTYPE_IDS


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _packed(seed, tq, tkv, n, kh, h, hv, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (dense._normal(kq, (tq, n, h), dtype), dense._normal(kk, (tkv, kh, h), dtype),
            dense._normal(kv, (tkv, kh, hv), dtype))  # fmt: skip


def _with_ragged_stats(monkeypatch, layout: str) -> None:
    """The name `"cudnn"` (which the helpers pass) stands for `attnlib.Cudnn(ragged_stats=layout)` in this test."""
    import attnlib
    from attnlib._src import dispatch

    monkeypatch.setitem(dispatch.REGISTRY, "cudnn", lambda: attnlib.Cudnn(ragged_stats=layout))


def _check_padding_rows(out, lse, grads, end):
    assert np.all(np.asarray(out[end:], np.float32) == 0), "output rows past cu_seqlens_q[-1] are not 0"
    assert np.all(np.isneginf(np.asarray(lse[end:]))), "lse rows past cu_seqlens_q[-1] are not -inf"
    assert np.all(np.asarray(grads[0][end:], np.float32) == 0), "dq rows past cu_seqlens_q[-1] are not 0"


RNG = np.random.default_rng(2026)
MANY_SHORT = RNG.integers(0, 18, 40)  # 40 sequences, some empty

# (id, q lengths, kv lengths or None, extra padding rows, N, K, H, Hv, kwargs)
THD_CASES = [
    ("single_sequence_causal", [200], None, 0, 4, 4, 64, 64, {"is_causal": True}),
    ("many_short_gqa_causal", MANY_SHORT, None, 5, 8, 2, 64, 64, {"is_causal": True}),
    ("odd_lengths_full", [37, 101, 0, 263, 1], None, 11, 4, 2, 128, 128, {}),
    ("cross_top_left_causal", [30, 7, 64, 0, 5], [45, 7, 20, 9, 0], 3, 4, 2, 64, 64, {"is_causal": True}),
    # Rows past kv_len + 6 see no key: cuDNN gets trimmed query lengths and leaves those rows unwritten.
    ("cross_top_left_window_rows_past_keys", [30, 7, 64, 0, 5], [12, 7, 20, 9, 0], 3, 4, 2, 64, 64,
     {"is_causal": True, "local_window_size": (6, 0)}),
    ("cross_bottom_right_causal", [30, 7, 64, 0, 5], [45, 7, 20, 9, 0], 3, 4, 2, 64, 64,
     {"is_causal": True, "diagonal_alignment": "bottom_right"}),
    ("window_causal", [150, 90, 3], None, 2, 4, 2, 64, 64, {"is_causal": True, "local_window_size": (31, 0)}),
    ("window_two_sided", [150, 90, 3], None, 2, 4, 4, 64, 64, {"local_window_size": (16, 8)}),
    ("mla_causal", [70, 33, 128], None, 4, 4, 4, 192, 128, {"is_causal": True}),
    ("max_seqlen_bound", [60, 64, 1, 33], None, 7, 4, 2, 64, 64, {"is_causal": True, "max_seqlen_q": 64,
                                                                 "max_seqlen_kv": 64}),
]  # fmt: skip


def _check_thd(case, dtype):
    _, q_lens, kv_lens, pad, n, kh, h, hv, kw = case
    cu_q = _cu(q_lens)
    cu_kv = cu_q if kv_lens is None else _cu(kv_lens)
    tq, tkv = int(cu_q[-1]) + pad, int(cu_kv[-1]) + (pad if kv_lens is None else 1)
    q, k, v = _packed(1, tq, tkv, n, kh, h, hv, dtype)
    kw = dict(kw, cu_seqlens_q=cu_q)
    if kv_lens is not None:
        kw["cu_seqlens_kv"] = cu_kv
    out, lse, grads = dense._compare(q, k, v, kw, dtype=dtype)
    _check_padding_rows(out, lse, grads, int(cu_q[-1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", THD_CASES, ids=[c[0] for c in THD_CASES])
def test_thd_matches_reference(case, dtype):
    _check_thd(case, dtype)


def _check_thd_sinks_and_lse_gradient(dtype):
    """Ragged + sinks backward (cuDNN has it only from 9.26): routed through a sink-free backward graph."""
    q, k, v = _packed(2, 300, 300, 4, 2, 64, 64, dtype)
    sinks = jax.random.normal(jax.random.key(3), (4,), jnp.float32) + 1.0
    kw = {"cu_seqlens_q": _cu([100, 0, 57, 120]), "is_causal": True, "sinks": sinks}
    dense._compare(q, k, v, kw, dtype=dtype, lse_grad=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_thd_sinks_and_lse_gradient(dtype):
    _check_thd_sinks_and_lse_gradient(dtype)


RAGGED_STATS_CASES = ["single_sequence_causal", "many_short_gqa_causal", "cross_top_left_window_rows_past_keys",
                      "cross_bottom_right_causal", "window_two_sided", "mla_causal", "max_seqlen_bound"]


@pytest.mark.parametrize("name", RAGGED_STATS_CASES)
def test_thd_with_ragged_stats(monkeypatch, name):
    """Stats per query token forced (`attnlib.Cudnn(ragged_stats="per_token")`; the default chooses per call)."""
    _with_ragged_stats(monkeypatch, "per_token")
    _check_thd(next(c for c in THD_CASES if c[0] == name), jnp.bfloat16)


def test_thd_sinks_and_lse_gradient_with_ragged_stats(monkeypatch):
    _with_ragged_stats(monkeypatch, "per_token")
    _check_thd_sinks_and_lse_gradient(jnp.bfloat16)


def _check_thd_deterministic():
    import attnlib

    q, k, v = _packed(4, 500, 500, 8, 2, 64, 64, jnp.bfloat16)
    cu = _cu([200, 100, 150, 40])
    f = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True, implementation="cudnn",
                                                  deterministic_backward=True).astype(jnp.float32) ** 2)
    g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
    a, b = g(q, k, v), g(q, k, v)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_thd_deterministic_backward_is_bitwise_reproducible():
    _check_thd_deterministic()


def _check_thd_dropout():
    """cuDNN's own dropout mask, read off a one-hot value matrix, explains its forward and backward exactly."""
    import attnlib

    dtype, rate, N, D = jnp.bfloat16, 0.25, 2, 64
    lengths = [40, 64, 23]
    cu = _cu(lengths)
    T = int(cu[-1])
    key = jax.random.key(77)
    seq = np.repeat(np.arange(3), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    q = dense._normal(jax.random.key(1), (T, N, D), dtype)
    k = dense._normal(jax.random.key(2), (T, N, D), dtype)
    onehot = jnp.broadcast_to(jax.nn.one_hot(pos, D, dtype=dtype)[:, None, :], (T, N, D))
    run = lambda q, k, v: attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True, implementation="cudnn",
                                            dropout_rate=rate, dropout_key=key)  # fmt: skip
    p_drop = np.asarray(jax.jit(run)(q, k, onehot), np.float32)  # [T, N, D]: kept probabilities by key position
    visible = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # [Tq, Tkv]
    kept = np.zeros((T, N, T), bool)
    for t in range(T):
        cols = np.nonzero(visible[t])[0]
        kept[t][:, cols] = p_drop[t][:, pos[cols]] > 0
    frac = kept.transpose(0, 2, 1)[visible].mean()
    sigma = math.sqrt(rate * (1 - rate) / visible.sum() / N)
    assert abs(frac - (1 - rate)) < 6 * sigma, f"kept fraction {frac:.4f} vs {1 - rate}"
    assert np.array_equal(p_drop, np.asarray(jax.jit(run)(q, k, onehot), np.float32)), "same key, other mask"

    v = dense._normal(jax.random.key(3), (T, N, D), dtype)
    cot = jax.random.normal(jax.random.key(4), (T, N, D), jnp.float32)
    mask = jnp.asarray(kept, jnp.float32)

    def ref(q, k, v):
        s = jnp.einsum("tnh,snh->tns", q, k, precision="highest") / math.sqrt(D)
        s = jnp.where(jnp.asarray(visible)[:, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1) * mask / (1 - rate)
        return jnp.einsum("tns,snh->tnh", p, v, precision="highest")

    e = dense._eps(dtype)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    dense._assert_close(jax.jit(run)(q, k, v), ref(f32(q), f32(k), f32(v)), 2 * e / (1 - rate), e, "dropout out")
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2)))(q, k, v)
    r_grads = jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        dense._assert_close(g, rg, 8 * e / (1 - rate), e, f"dropout {name}", scale_by_max=True)


def test_thd_dropout_same_mask_forward_and_backward():
    _check_thd_dropout()


def test_thd_empty_batch_and_all_padding():
    import attnlib

    q, k, v = _packed(5, 64, 64, 4, 2, 64, 64, jnp.bfloat16)
    cu = jnp.asarray([0, 0, 0, 0], jnp.int32)
    f = lambda q, k, v: attnlib.attention(q, k, v, cu_seqlens_q=cu, implementation="cudnn", return_residual=True)
    out, lse = jax.jit(f)(q, k, v)
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))
    g = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32)), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.all(np.asarray(x, np.float32) == 0) for x in g)


def test_bucket_boundaries_and_graph_reuse():
    """Sequence counts 8 and 9 straddle a bucket; lengths changing inside a bucket build no new graph."""
    import attnlib
    from attnlib._src.backends.cudnn import executor as cudnn_attention

    def run(lengths, tq):
        q, k, v = _packed(6, tq, tq, 4, 2, 64, 64, jnp.bfloat16)
        kw = {"cu_seqlens_q": _cu(lengths), "is_causal": True, "max_seqlen_q": 128, "max_seqlen_kv": 128}
        out, lse, grads = dense._compare(q, k, v, kw, dtype=jnp.bfloat16)
        _check_padding_rows(out, lse, grads, int(sum(lengths)))

    # Graphs fetched from outside memory (built now, or read from a disk cache another test process filled).
    loaded = lambda: cudnn_attention.CACHE.stats["builds"] + cudnn_attention.CACHE.stats["disk_hits"]
    run([128, 1, 2, 3, 4, 5, 6, 7], 300)  # 8 sequences: bucket 8
    before = loaded()
    run([5, 128, 9, 9, 9, 9, 9, 100], 300)  # other lengths, same bucket: no new graph
    assert loaded() == before
    run([128, 1, 2, 3, 4, 5, 6, 7, 8], 300)  # 9 sequences: bucket 16, new graphs
    assert loaded() == before + 2  # forward and backward
    q = jnp.zeros((300, 4, 64), jnp.bfloat16)
    # a sequence longer than the bucketed bound (128) is NaN, never wrong numbers
    out = attnlib.attention(q, q, q, cu_seqlens_q=_cu([20, 200, 10]), max_seqlen_q=100, implementation="cudnn")
    out = np.asarray(out, np.float32)
    assert np.isnan(out[20:220]).all() and not np.isnan(out[:20]).any() and not np.isnan(out[220:]).any()


# ------------------------------------------------------------------------------------------------------------------
# packed rows


def _segments(rng, B, L, max_runs):
    rows = []
    for _ in range(B):
        row = np.zeros(L, np.int32)
        j, run = int(rng.integers(0, 4)), 0
        while j < L and run < max_runs:
            n = int(rng.integers(1, L // 3))
            row[j : j + n] = run + 1
            j += n + int(rng.integers(0, 3))
            run += 1
        rows.append(row)
    return jnp.asarray(np.stack(rows))


def _check_segments(causal, dtype):
    rng = np.random.default_rng(10)
    B, T = 3, 160
    ids = _segments(rng, B, T, 6)
    q, k, v = dense._qkv(7, (B,), T, T, 4, 2, 64, 64, dtype)
    kw = {"q_segment_ids": ids, "max_segments_per_row": 6, "is_causal": causal,
          "query_seq_lengths": jnp.asarray([T, 150, 97], jnp.int32)}  # fmt: skip
    out, _, grads = dense._compare(q, k, v, kw, dtype=dtype)
    padding = np.asarray(ids) == 0
    assert np.all(np.asarray(out, np.float32)[padding] == 0) and np.all(np.asarray(grads[0], np.float32)[padding] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_segments_match_reference(causal, dtype):
    _check_segments(causal, dtype)


def _check_segments_cross_bottom_right():
    rng = np.random.default_rng(11)
    B, T, S = 2, 96, 150
    q_ids, kv_ids = _segments(rng, B, T, 4), _segments(rng, B, S, 4)
    q, _, _ = dense._qkv(8, (B,), T, T, 4, 2, 64, 64, jnp.bfloat16)
    _, k, v = dense._qkv(9, (B,), S, S, 4, 2, 64, 64, jnp.bfloat16)
    kw = {"q_segment_ids": q_ids, "kv_segment_ids": kv_ids, "max_segments_per_row": 4, "is_causal": True,
          "diagonal_alignment": "bottom_right"}  # fmt: skip
    dense._compare(q, k, v, kw, dtype=jnp.bfloat16)


def test_segments_cross_attention_bottom_right():
    _check_segments_cross_bottom_right()


def _check_segment_overflow():
    import attnlib

    ids = jnp.asarray([[1] * 20 + [2] * 20 + [3] * 24, [1] * 30 + [2] * 30 + [0] * 4], jnp.int32)
    q, k, v = dense._qkv(10, (2,), 64, 64, 4, 4, 64, 64, jnp.bfloat16)
    kw = {"q_segment_ids": ids, "max_segments_per_row": 2, "is_causal": True}
    out = np.asarray(jax.jit(lambda *a: attnlib.attention(*a, implementation="cudnn", **kw))(q, k, v), np.float32)
    ref = attnlib.attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="xla", **kw)
    assert np.isnan(out[0]).all(), "the row with 3 segments (bound 2) must be NaN"
    e = dense._eps(jnp.bfloat16)
    dense._assert_close(out[1], ref[1], 2 * e, e, "row within the bound")


def test_segment_count_overflow_gives_nan_rows():
    _check_segment_overflow()


def _traced_ids_run(impl, q, k, v, ids, **extra):
    """(out, dq, dk, dv) as float32 numpy under `jit` with the segment ids a traced argument."""
    import attnlib

    cot = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

    def loss(q, k, v, ids):
        out = attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True, implementation=impl, **extra)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    with jax.default_matmul_precision("highest"):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, ids)
    return [np.asarray(x, np.float32) for x in (out, *grads)]


@pytest.mark.parametrize("runs,fused", [((5, 16), True), ((3, 17), False)], ids=["fits", "over_default"])
def test_segments_without_a_bound_under_jit(runs, fused):
    """No `max_segments_per_row`, ids traced: cuDNN with the default bound (16) when the rows fit — the same bits
    as that bound given explicitly — and xla_chunked when a row holds more (inside `lax.cond` XLA fuses it
    differently, so not bit for bit; cuDNN with the bound would give NaN rows); both against the float32 reference."""
    B, T = 2, 96
    ids = np.zeros((B, T), np.int32)
    for r, n in enumerate(runs):
        sizes = np.random.default_rng(r).integers(1, 6, n)
        ids[r, : sizes.sum()] = np.repeat(np.arange(1, n + 1), sizes)
    ids = jnp.asarray(ids)
    q, k, v = dense._qkv(12, (B,), T, T, 4, 2, 64, 64, jnp.bfloat16)
    got = _traced_ids_run("cudnn", q, k, v, ids)
    twin = _traced_ids_run("cudnn", q, k, v, ids, max_segments_per_row=16) if fused else got
    reference = _traced_ids_run("xla", *(x.astype(jnp.float32) for x in (q, k, v)), ids)
    e = dense._eps(jnp.bfloat16)
    for name, x, t, r in zip(("out", "dq", "dk", "dv"), got, twin, reference, strict=True):
        np.testing.assert_array_equal(x, t, err_msg=name)
        dense._assert_close(x, r, (2 if name == "out" else 8) * e, e, name, scale_by_max=name != "out")


# ------------------------------------------------------------------------------------------------------------------
# paged


def _pools(seed, P, page, kh, h, hv, dtype):
    kk, kv = jax.random.split(jax.random.key(seed))
    return dense._normal(kk, (P, page, kh, h), dtype), dense._normal(kv, (P, page, kh, hv), dtype)


PAGED_CASES = [
    ("decode_gqa", 1, 8, 2, 128, 128, {}),
    ("decode_mqa_top_left", 1, 4, 1, 64, 64, {"diagonal_alignment": "top_left"}),
    ("prefill_bottom_right", 16, 4, 2, 64, 64, {}),
    ("prefill_mla", 8, 4, 4, 192, 128, {}),
    ("prefill_window", 16, 4, 2, 64, 64, {"local_window_size": (40, 0)}),
]


@pytest.mark.parametrize("residual", [True, False], ids=["lse", "out_only"])
@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_matches_reference(case, residual):
    import attnlib

    _, T, n, kh, h, hv, kw = case
    B, P, page, pps = 4, 40, 16, 8
    rng = np.random.default_rng(12)
    table = np.stack([rng.permutation(P)[:pps] for _ in range(B)]).astype(np.int32)  # unordered pages
    table[3, :4] = table[0, :4]  # shared pages (a common prefix)
    lengths = jnp.asarray([37, 128, 16, 70], jnp.int32)
    kp, vp = _pools(13, P, page, kh, h, hv, jnp.bfloat16)
    q = dense._normal(jax.random.key(14), (B, T, n, h), jnp.bfloat16)
    kw = dict({"is_causal": True, "diagonal_alignment": "bottom_right"}, **kw)
    kw.update(page_table=jnp.asarray(table), key_value_seq_lengths=lengths, return_residual=residual)
    got = jax.jit(lambda *a: attnlib.attention(*a, implementation="cudnn", **kw))(q, kp, vp)
    ref = attnlib.attention(*(x.astype(jnp.float32) for x in (q, kp, vp)), implementation="xla", **kw)
    e = dense._eps(jnp.bfloat16)
    if residual:
        dense._assert_close(got[0], ref[0], 2 * e, e, "out")
        dense._assert_close(got[1], ref[1], 2 * e, 0.0, "lse")
    else:
        dense._assert_close(got, ref, 2 * e, e, "out")


def test_paged_gradients_raise_explicitly_and_fall_back_automatically():
    import attnlib

    kp, vp = _pools(15, 16, 16, 2, 64, 64, jnp.bfloat16)
    q = dense._normal(jax.random.key(16), (2, 1, 4, 64), jnp.bfloat16)
    kw = dict(page_table=jnp.asarray([[3, 1, 4], [15, 9, 2]], jnp.int32), is_causal=True,
              key_value_seq_lengths=jnp.asarray([40, 9], jnp.int32), diagonal_alignment="bottom_right")  # fmt: skip
    loss = lambda impl: lambda q, kp, vp: jnp.sum(
        attnlib.attention(q, kp, vp, implementation=impl, **kw).astype(jnp.float32) ** 2)  # fmt: skip
    with pytest.raises(NotImplementedError, match="paged key/value attention"):
        jax.jit(jax.grad(loss("cudnn")))(q, kp, vp)
    assert attnlib.explain(q, kp, vp, **kw).implementation == "cudnn"
    got = jax.jit(jax.grad(loss(None), argnums=(0, 1, 2)))(q, kp, vp)
    ref = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, kp, vp)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        dense._assert_close(g, r, 8 * dense._eps(jnp.bfloat16), dense._eps(jnp.bfloat16), name, scale_by_max=True)


def test_paged_cache_decoding_matches_dense_causal():
    import attnlib

    B, K, N, H, prefill, steps = 3, 2, 8, 128, 21, 12
    cache = attnlib.PagedKVCache.create(B, num_pages=64, page_size=16, num_kv_heads=K, head_dim=H,
                                        max_pages_per_seq=8)  # fmt: skip
    total = prefill + steps
    k_all = dense._normal(jax.random.key(17), (B, total, K, H), jnp.bfloat16)
    v_all = dense._normal(jax.random.key(18), (B, total, K, H), jnp.bfloat16)
    q_all = dense._normal(jax.random.key(19), (B, total, N, H), jnp.bfloat16)

    @jax.jit
    def step(cache, q, k, v):
        cache = cache.append(k, v)
        out = attnlib.attention(q, cache.k_pages, cache.v_pages, page_table=cache.page_table,
                                key_value_seq_lengths=cache.lengths, is_causal=True,
                                diagonal_alignment="bottom_right", implementation="cudnn")  # fmt: skip
        return cache, out

    cache, first = step(cache, q_all[:, :prefill], k_all[:, :prefill], v_all[:, :prefill])  # chunked prefill
    outs = [first]
    for t in range(prefill, total):
        cache, out = step(cache, q_all[:, t : t + 1], k_all[:, t : t + 1], v_all[:, t : t + 1])
        outs.append(out)
    ref = attnlib.attention(q_all.astype(jnp.float32), k_all.astype(jnp.float32), v_all.astype(jnp.float32),
                            is_causal=True, implementation="xla")  # fmt: skip
    e = dense._eps(jnp.bfloat16)
    dense._assert_close(jnp.concatenate(outs, axis=1), ref, 2 * e, e, "paged decode vs dense causal")


RAGGED_STATS_MORE = {
    "segments_causal": lambda: _check_segments(True, jnp.bfloat16),
    "segments_cross_bottom_right": lambda: _check_segments_cross_bottom_right(),
    "segment_overflow": lambda: _check_segment_overflow(),
    "thd_dropout": lambda: _check_thd_dropout(),
    "thd_deterministic": lambda: _check_thd_deterministic(),
}


@pytest.mark.parametrize("name", list(RAGGED_STATS_MORE))
@pytest.mark.parametrize("mode", ["per_token", "padded"])
def test_ragged_stats_on_segments_dropout_and_determinism(monkeypatch, name, mode):
    """The rest of the ragged suite with each stats layout forced (the default chooses per
    call): segments, overflow, dropout, deterministic backward."""
    _with_ragged_stats(monkeypatch, mode)
    RAGGED_STATS_MORE[name]()


@pytest.mark.parametrize("case", THD_CASES, ids=[c[0] for c in THD_CASES])
def test_thd_with_padded_stats_layout(monkeypatch, case):
    """Every THD case with padded `[b, N, t]` statistics forced (the default chooses per call)."""
    _with_ragged_stats(monkeypatch, "padded")
    _check_thd(case, jnp.bfloat16)
