"""CPU tests of the dense cuDNN wrapper (padding lengths, trimmed query lengths, custom VJP) against an emulated graph.

The graph call is replaced by `emulate`, a plain-JAX model of a dense cuDNN SDPA graph with padding lengths: it
never writes rows past `seq_len_q` (O, dQ) or `seq_len_kv` (dK, dV), so those rows hold zeros when the wrapper asked
for them to be zero-filled and NaN otherwise, and rows that see no key come out NaN (0 / 0), the worst a real kernel
could do. The wrapper must still match the `xla` reference exactly where the API defines the result (zeros, `-inf`,
gradients). What this cannot show is that cuDNN behaves like the model: `test_cudnn_gpu.py` checks that on the GPU.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fake_cudnn, run_pytest_on_simulated_devices
from test_cudnn_ragged import _close, _compare, _eps, _mask, softmax_rows

import attnlib
from attnlib._src.backends.cudnn import attention as dense, executor, cache, support
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid


def _unwritten(x: jax.Array, rows: int, lengths: jax.Array, zero_filled: bool, seq_kv: jax.Array | None = None):
    """`x` `[b, rows, ...]` with the rows at or past `lengths` as the kernel leaves them: zero-filled by a memset, or
    (`seq_kv` given: a graph without the memset) written as zeros by the kernel except in batch elements without
    keys, which it skips (NaN), or else never written (NaN)."""
    expand = lambda m: m.reshape(m.shape + (1,) * (x.ndim - m.ndim))
    keep = expand(jnp.arange(rows)[None, :] < lengths[:, None])
    if zero_filled:
        return jnp.where(keep, x, 0.0)
    if seq_kv is None:
        return jnp.where(keep, x, jnp.nan)
    return jnp.where(expand(seq_kv[:, None] > 0), jnp.where(keep, x, 0.0), jnp.nan)


def emulate(spec: GraphSpec, entry, *operands, tokens=None):
    """A plain-JAX dense cuDNN SDPA graph, in `spec.out_uids()` order."""
    del entry, tokens
    vals = dict(zip(spec.in_uids(), operands))
    b, t, s, g = spec.b, spec.t, spec.s, spec.n // spec.k
    seq_q = vals.get(Uid.SEQ_Q, jnp.full((b,), t, jnp.int32))
    seq_kv = vals.get(Uid.SEQ_KV, jnp.full((b,), s, jnp.int32))
    heads_first = lambda x: jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3))
    q = heads_first(vals[Uid.Q])
    k = jnp.repeat(heads_first(vals[Uid.K]), g, axis=1)
    v = jnp.repeat(heads_first(vals[Uid.V]), g, axis=1)
    logits = jnp.einsum("bnih,bnjh->bnij", q, k, precision="highest") * spec.scale
    if spec.bias_b:
        logits = logits + vals[Uid.BIAS].astype(jnp.float32)
    mask = _mask(spec, seq_q, seq_kv)
    logits = jnp.where(mask, logits, -jnp.inf)
    filled = {spec.out_uids()[i] for i in spec.zero_fill()}
    # attnlib relies on cuDNN's zeros only for top-left padded graphs without the memset; elsewhere: never written.
    kernel_zeros = seq_kv if spec.rows_by_length and not spec.memset_rows else None
    rows_first = lambda x: jnp.transpose(x, (0, 2, 1, 3))
    if spec.direction == "fwd":
        o, stats = softmax_rows(logits, v, vals.get(Uid.SINK))
        out = _unwritten(rows_first(o), t, seq_q, Uid.O in filled, kernel_zeros).astype(spec.dtype)
        rows = jnp.arange(t)[None, None, :] < seq_q[:, None, None]
        stats = jnp.where(rows, stats, jnp.nan)
        if spec.row_max:  # cuDNN's score_max and score_sum_exp instead of Stats
            top = jnp.max(logits, axis=-1)
            sum_exp = jnp.sum(jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)[..., None]), axis=-1)
            return out, jnp.where(rows, top, jnp.nan), jnp.where(rows, sum_exp, jnp.nan)
        return (out, stats) if spec.stats else (out,)
    o, do = heads_first(vals[Uid.O]), heads_first(vals[Uid.DO])
    p = jnp.where(mask, jnp.exp(logits - vals[Uid.STATS][..., None]), 0.0)
    dp = jnp.einsum("bnih,bnjh->bnij", do, v, precision="highest")
    d_logits = p * (dp - jnp.sum(do * o, axis=-1, keepdims=True))
    dq = jnp.einsum("bnij,bnjh->bnih", d_logits, k, precision="highest") * spec.scale
    dk = jnp.einsum("bnij,bnih->bnjh", d_logits, q, precision="highest") * spec.scale
    dv = jnp.einsum("bnij,bnih->bnjh", p, do, precision="highest")
    fold = lambda x: rows_first(jnp.sum(jnp.reshape(x, (b, spec.k, g) + x.shape[2:]), axis=2))
    grads = [
        _unwritten(rows_first(dq), t, seq_q, Uid.DQ in filled, kernel_zeros),
        _unwritten(fold(dk), s, seq_kv, Uid.DK in filled, kernel_zeros),
        _unwritten(fold(dv), s, seq_kv, Uid.DV in filled, kernel_zeros),
    ]
    if spec.bias_b:
        dbias = jnp.sum(d_logits, axis=(0,), keepdims=True) if spec.bias_b == 1 else d_logits
        grads.append(jnp.sum(dbias, axis=1, keepdims=True) if spec.bias_n == 1 else dbias)
    return tuple(x.astype(spec.dtype) for x in grads)


def entry_for(spec: GraphSpec) -> cache.GraphEntry:
    """A stand-in built graph (the emulator needs only the spec)."""
    return cache.GraphEntry(
        blob=b"{}", workspace_bytes=0, in_uids=tuple(map(int, spec.in_uids())),
        out_uids=tuple(map(int, spec.out_uids())), zero_fill=spec.zero_fill(), label=spec.label,
    )  # fmt: skip


@pytest.fixture(params=[92100, 91900], ids=["memset", "kernel_zeros"])
def emulated(monkeypatch, request):
    """Route dense `implementation="cudnn"` calls through `emulate`, as on an H200: with cuDNN 9.19, which writes
    zeros in padded rows itself, and with a cuDNN not known to (9.21 here), where attnlib zero-fills them first
    (`support.writes_padding_zeros`)."""
    fake_cudnn(monkeypatch, version=request.param)
    monkeypatch.setattr(executor, "get_entry", entry_for)
    monkeypatch.setattr(executor, "ffi_graph_call", emulate)


def _qkv(seed, B, T, S, N, K, H=64, Hv=48, dtype=jnp.bfloat16):
    a, b, c = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(a, (B, T, N, H)).astype(dtype), jax.random.normal(b, (B, S, K, H)).astype(dtype),
            jax.random.normal(c, (B, S, K, Hv)).astype(dtype))  # fmt: skip


PADDING_CASES = [
    ("q_and_kv", {"query_seq_lengths": [29, 7, 0], "key_value_seq_lengths": [33, 5, 12]}),
    ("kv_only_causal", {"key_value_seq_lengths": [33, 20, 1], "is_causal": True}),
    ("q_only", {"query_seq_lengths": [1, 29, 16]}),
    ("empty_sequence", {"query_seq_lengths": [29, 11, 3], "key_value_seq_lengths": [0, 17, 33]}),
    ("window_rows_past_keys", {"query_seq_lengths": [29, 25, 10], "key_value_seq_lengths": [9, 33, 0],
                               "is_causal": True, "local_window_size": (5, 0)}),
    ("two_sided_window_rows_past_keys", {"query_seq_lengths": [29, 20, 29], "key_value_seq_lengths": [12, 33, 3],
                                         "local_window_size": (4, 2)}),
    ("bottom_right", {"query_seq_lengths": [29, 20, 8], "key_value_seq_lengths": [10, 33, 0],
                      "is_causal": True, "diagonal_alignment": "bottom_right"}),
]  # fmt: skip


def _lengths(kw):
    return {key: (jnp.asarray(val, jnp.int32) if key.endswith("lengths") else val) for key, val in kw.items()}


@pytest.mark.parametrize("case", PADDING_CASES, ids=[c[0] for c in PADDING_CASES])
def test_padding_lengths_match_reference(emulated, case):
    q, k, v = _qkv(1, 3, 29, 33, 6, 2)
    kw = _lengths(case[1])
    out, lse, grads = _compare(q, k, v, kw)
    assert not any(np.isnan(np.asarray(x, np.float32)).any() for x in (out, *grads))
    ql = np.asarray(kw.get("query_seq_lengths", [29] * 3))
    kl = np.asarray(kw.get("key_value_seq_lengths", [33] * 3))
    for b in range(3):  # rows past the lengths: exact zeros (and -inf lse), not merely small
        assert np.all(np.asarray(out[b, ql[b]:], np.float32) == 0) and np.all(np.isneginf(np.asarray(lse[b, ql[b]:])))
        assert np.all(np.asarray(grads[0][b, ql[b]:], np.float32) == 0)
        assert np.all(np.asarray(grads[1][b, kl[b]:], np.float32) == 0)
        assert np.all(np.asarray(grads[2][b, kl[b]:], np.float32) == 0)


@pytest.mark.parametrize("lse_grad", [False, True], ids=["out", "out_and_lse"])
def test_sinks_with_trimmed_rows(emulated, lse_grad):
    q, k, v = _qkv(2, 3, 29, 33, 4, 4)
    kw = _lengths({"query_seq_lengths": [29, 12, 29], "key_value_seq_lengths": [8, 33, 0], "is_causal": True,
                   "local_window_size": (6, 0)})  # fmt: skip
    kw["sinks"] = jax.random.normal(jax.random.key(3), (4,), jnp.float32)
    _compare(q, k, v, kw, diff_sinks=True, lse_grad=lse_grad)


def test_bias_with_trimmed_rows(emulated):
    q, k, v = _qkv(4, 3, 29, 33, 4, 2)
    kw = _lengths({"query_seq_lengths": [29, 12, 20], "key_value_seq_lengths": [9, 33, 0], "is_causal": True,
                   "local_window_size": (6, 0)})  # fmt: skip
    kw["bias"] = jax.random.normal(jax.random.key(5), (1, 4, 29, 33), jnp.float32)
    _compare(q, k, v, kw)


def test_vmap_of_padded_call_matches_reference(emulated):
    q, k, v = _qkv(6, 3, 29, 33, 4, 2)
    q_len = jnp.asarray([29, 12, 0], jnp.int32)
    kv_len = jnp.asarray([9, 33, 5], jnp.int32)

    def f(impl, q, k, v, q_len, kv_len):
        one = lambda q, k, v, a, b: attnlib.attention(
            q[None], k[None], v[None], query_seq_lengths=a[None], key_value_seq_lengths=b[None], is_causal=True,
            local_window_size=(6, 0), implementation=impl)[0]  # fmt: skip
        return jax.vmap(one)(q, k, v, q_len, kv_len)

    out = jax.jit(lambda *a: f("cudnn", *a))(q, k, v, q_len, kv_len)
    f32 = lambda x: x.astype(jnp.float32)
    expected = jax.jit(lambda *a: f("xla", *a))(f32(q), f32(k), f32(v), q_len, kv_len)
    _close(out, expected, 2 * _eps(q.dtype), _eps(q.dtype), "out")


def _full_size_selects(fn, *args) -> list[str]:
    """`select_n` equations of `fn`'s jaxpr whose result has the query's or the keys' full size."""
    big = {args[0].size // args[0].shape[-1] * args[2].shape[-1], args[0].size, args[1].size}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "select_n" and eqn.outvars[0].aval.size in big:
                yield str(eqn.outvars[0].aval)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_padded_top_left_calls_make_no_pass_over_output_or_gradients(emulated, monkeypatch, alignment):
    """Padded top-left calls rely on trimmed lengths and zero-filled results: no `where` over O, dO, dQ, dK, dV.
    Bottom-right calls (rows that see no key come first) still mask them."""
    shaped_zeros = lambda spec, entry, *ops, tokens=None: tuple(
        jnp.zeros(*spec.shape(uid)) for uid in spec.out_uids()
    )
    monkeypatch.setattr(executor, "ffi_graph_call", shaped_zeros)  # the graph itself, opaque: no selects inside
    q, k, v = _qkv(7, 3, 29, 33, 4, 2)
    kw = _lengths({"query_seq_lengths": [29, 12, 20], "key_value_seq_lengths": [9, 33, 0], "is_causal": True,
                   "diagonal_alignment": alignment})  # fmt: skip
    loss = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, implementation="cudnn", **kw).astype(jnp.float32))
    selects = _full_size_selects(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    if alignment == "top_left":
        assert selects == []
    else:
        assert len(selects) >= 4  # out, dO, dQ, and dK/dV


def test_context_parallel_on_the_emulated_cudnn_wrapper():
    """`tests/cp_cudnn_emulated.py` on 4 simulated CPU devices."""
    run_pytest_on_simulated_devices("cp_cudnn_emulated.py", 4)


MAX_LOGIT_CASES = [
    ("causal_gqa", {"is_causal": True}, 29),
    ("padding", dict(PADDING_CASES[0][1]), 29),
    ("window_rows_past_keys", dict(PADDING_CASES[4][1]), 29),
    ("bottom_right_t_gt_s", {"is_causal": True, "diagonal_alignment": "bottom_right"}, 45),
    ("mask_hides_rows", {"mask": "rows"}, 29),
    ("bias", {"bias": "random"}, 29),
]  # fmt: skip


@pytest.mark.parametrize("case,kw,T", MAX_LOGIT_CASES, ids=[c[0] for c in MAX_LOGIT_CASES])
def test_max_logit_comes_from_the_forward_graph(emulated, monkeypatch, case, kw, T):
    """`return_max_logit` on cuDNN's dense path is the forward graph's `score_max` (no separate pass: `max_logit.py`
    is not called), equal to the plain pass's value; rows that see no key do not count; `lse` is unchanged."""
    from attnlib._src import max_logit as max_logit_lib

    q, k, v = _qkv(41, 3, T, 33, 4, 2)
    kw = _lengths(kw)
    extra = {}
    if kw.pop("mask", None) == "rows":  # query rows 3..9 see nothing in head 2 of batch row 1
        hide = (jnp.arange(3)[:, None, None, None] == 1) & (jnp.arange(4)[None, :, None, None] == 2)
        hide = hide & (jnp.arange(T)[None, None, :, None] >= 3) & (jnp.arange(T)[None, None, :, None] < 10)
        extra["mask"] = jnp.broadcast_to(~hide, (3, 4, T, 33))
    if kw.pop("bias", None) == "random":
        extra["bias"] = jax.random.normal(jax.random.key(3), (1, 4, T, 33), jnp.float32).astype(jnp.bfloat16)
    expected = attnlib.attention(q, k, v, implementation="xla", return_max_logit=True, return_residual=True,
                                 **extra, **kw)  # fmt: skip
    plain_pass = max_logit_lib.max_logit

    def refuse(*args):
        raise AssertionError("max_logit.py's separate pass ran")

    monkeypatch.setattr(max_logit_lib, "max_logit", refuse)
    out, lse, max_logit = jax.jit(lambda q, k, v: attnlib.attention(
        q, k, v, implementation="cudnn", return_max_logit=True, return_residual=True, **extra, **kw))(q, k, v)  # fmt: skip
    monkeypatch.setattr(max_logit_lib, "max_logit", plain_pass)
    assert max_logit.shape == (3, 4) and max_logit.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(max_logit), np.asarray(expected[2]), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(expected[1]), rtol=0, atol=2 * 2.0**-7)


def test_max_logit_with_sinks_takes_its_own_pass(emulated):
    """A sink would enter cuDNN's row maximum: with sinks the statistic comes from `max_logit.py`'s pass."""
    q, k, v = _qkv(42, 2, 29, 33, 4, 2)
    sinks = jnp.asarray([3.0, -1.0, 0.5, 9.0], jnp.float32)
    got = attnlib.attention(q, k, v, sinks=sinks, implementation="cudnn", return_max_logit=True)[1]
    expected = attnlib.attention(q, k, v, sinks=sinks, implementation="xla", return_max_logit=True)[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-5)
