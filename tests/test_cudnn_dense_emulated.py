"""CPU tests of the dense cuDNN wrapper (padding lengths, trimmed query lengths, custom VJP) against an emulated graph.

The graph call is replaced by `emulate` (`tests/cudnn_emulation.py`), a plain-JAX model of a dense cuDNN SDPA
graph with padding lengths: it never writes rows past `seq_len_q` (O, dQ) or `seq_len_kv` (dK, dV), so those rows
hold zeros when the wrapper asked for them to be zero-filled and NaN otherwise, and rows that see no key come out NaN
(0 / 0), the worst a real kernel could do. The wrapper must still match the `xla` reference exactly where the API
defines the result (zeros, `-inf`, gradients). What this cannot show is that cuDNN behaves like the model:
`test_cudnn_gpu.py` checks that on the GPU.
"""

import logging

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import _unwritten, emulate, emulated_cudnn, entry_for, install  # noqa: F401  (_unwritten, entry_for: test_fp8_cudnn_emulated)
from helpers import run_pytest_on_simulated_devices
from test_cudnn_ragged import _close, _compare, _eps

import attnlib
from attnlib._src import logs


@pytest.fixture(params=[92100, pytest.param(91900, marks=pytest.mark.full)], ids=["memset", "kernel_zeros"])
def emulated(monkeypatch, request):
    """Route dense `implementation="cudnn"` calls through `emulate`, as on an H200: with cuDNN 9.19, which writes
    zeros in padded rows itself, and with a cuDNN not known to (9.21 here), where attnlib zero-fills them first
    (`support.writes_padding_zeros`)."""
    return install(monkeypatch, emulate, version=request.param)


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
def test_padded_top_left_calls_make_no_pass_over_output_or_gradients(emulated, alignment):
    """Padded top-left calls rely on trimmed lengths and zero-filled results: no `where` over O, dO, dQ, dK, dV.
    Bottom-right calls (rows that see no key come first) still mask them."""
    shaped_zeros = lambda spec, entry, *ops, tokens=None: tuple(
        jnp.zeros(*spec.shape(uid)) for uid in spec.out_uids()
    )
    cudnn = emulated_cudnn(shaped_zeros, version=emulated.device.cudnn_version)  # opaque graph: no selects inside
    q, k, v = _qkv(7, 3, 29, 33, 4, 2)
    kw = _lengths({"query_seq_lengths": [29, 12, 20], "key_value_seq_lengths": [9, 33, 0], "is_causal": True,
                   "diagonal_alignment": alignment})  # fmt: skip
    loss = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, implementation=cudnn, **kw).astype(jnp.float32))
    selects = _full_size_selects(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    if alignment == "top_left":
        assert selects == []
    else:
        assert len(selects) >= 4  # out, dO, dQ, and dK/dV


@pytest.mark.parametrize(
    "t,s,kw,graph",
    [
        (1, 1024, {"is_causal": True, "diagonal_alignment": "bottom_right"}, False),
        (16, 2048, {"bias": True}, False),
        (1, 1023, {}, True),  # few keys: cuDNN's graph
        (17, 2048, {}, True),  # more query rows: cuDNN's graph
        (1, 1024, {"mask": True}, True),  # a boolean mask reaches cuDNN as a bias: its graph
        (1, 1024, {"logits_soft_cap": 5.0}, True),  # a score modifier: its graph
    ],
    ids=["decode", "t16_bias", "s1023", "t17", "mask", "soft_cap"],
)
def test_backward_of_few_query_rows_over_many_keys_runs_without_a_graph(emulated, monkeypatch, caplog, t, s, kw,
                                                                          graph):  # fmt: skip
    """Few query rows over 1024+ keys: the gradient comes from `lse_backward` (in plain JAX, from the forward's
    statistics), not from cuDNN's backward graph (the conformance cases `decode_long_keys_*` and
    `short_query_long_keys_*` check its values)."""
    directions = []

    def recording(spec, entry, *operands, tokens=None):
        directions.append(spec.direction)
        return emulate(spec, entry, *operands, tokens=tokens)

    cudnn = emulated_cudnn(recording, version=emulated.device.cudnn_version)
    monkeypatch.setattr(logs, "_logged", set())  # logged once per process: forget earlier tests' messages
    q, k, v = _qkv(8, 2, t, s, 4, 2, Hv=64)
    kw = dict(kw)
    if kw.pop("bias", False):
        kw["bias"] = jax.random.normal(jax.random.key(9), (4, t, s), jnp.bfloat16)
    if kw.pop("mask", False):
        kw["mask"] = jax.random.uniform(jax.random.key(9), (t, s)) < 0.5
    loss = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, implementation=cudnn, **kw).astype(jnp.float32))
    with caplog.at_level(logging.INFO, logger="attnlib"):
        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert directions == (["fwd", "bwd"] if graph else ["fwd"])
    assert graph or any("lse_backward" in record.getMessage() for record in caplog.records)


def test_context_parallel_on_the_emulated_cudnn_wrapper():
    """`tests/cp_cudnn_emulated.py` on 4 simulated CPU devices."""
    run_pytest_on_simulated_devices("cp_cudnn_emulated.py", 4)


@pytest.mark.full
def test_context_parallel_on_the_emulated_cudnn_wrapper_full_matrix():
    run_pytest_on_simulated_devices("cp_cudnn_emulated.py", 4, tier="full")


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
        q, k, v, implementation="cudnn", return_max_logit=True, return_residual=True, **extra, **kw
    ))(q, k, v)  # fmt: skip
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
