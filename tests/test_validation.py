"""One error-message test per validation rule of `attnlib.attention`.

Every message must name the offending argument in backticks and show what was given (shape, dtype or value);
`ValueError` for shapes and values, `TypeError` for dtypes, `NotImplementedError` for a valid request an explicitly
named implementation cannot serve.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import B, H, HV, K, lengths, N, normal, qkv, S, T

import attnlib


def _inputs():
    r = np.random.default_rng(0)
    q, k, v = qkv(r, hv=HV)
    return q, k, v


def check_error(exc_type, names, given, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` raises `exc_type` whose message has every `` `name` `` and every `given` string."""
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for name in [names] if isinstance(names, str) else names:
        assert f"`{name}`" in msg, f"message does not name `{name}` in backticks: {msg!r}"
    for g in [given] if isinstance(given, str) else given:
        assert g in msg, f"message does not show what was given ({g!r}): {msg!r}"
    return msg


def attn(q, k, v, *args, **kwargs):
    return attnlib.attention(q, k, v, *args, implementation="xla", **kwargs)


def shape_str(shape) -> str:
    return str(tuple(shape))


# ------------------------------------------------------------------------------------------------------------------
# query / key / value shapes and dtypes


def test_query_rank_too_small():
    q, k, v = _inputs()
    bad = q[0, :, 0]  # [T, H]
    check_error(ValueError, "query", shape_str(bad.shape), attn, bad, k, v)


def test_key_rank_differs_from_query():
    q, k, v = _inputs()
    check_error(ValueError, "key", shape_str(k[0].shape), attn, q, k[0], v)


def test_batch_dims_differ():
    q, k, v = _inputs()
    k3 = jnp.concatenate([k, k[:1]], axis=0)
    v3 = jnp.concatenate([v, v[:1]], axis=0)
    check_error(ValueError, "key", shape_str(k3.shape), attn, q, k3, v3)


def test_heads_not_multiple():
    q, _, _ = _inputs()
    r = np.random.default_rng(1)
    k = normal(r, (B, S, 4, H))
    v = normal(r, (B, S, 4, HV))
    msg = check_error(ValueError, ["query", "key"], [shape_str(q.shape), shape_str(k.shape)], attn, q, k, v)
    assert "multiple" in msg


def test_head_dim_mismatch_query_key():
    q, _, v = _inputs()
    k = normal(np.random.default_rng(1), (B, S, K, H - 1))
    check_error(ValueError, ["query", "key"], shape_str(k.shape), attn, q, k, v)


def test_key_value_length_mismatch():
    q, k, v = _inputs()
    check_error(ValueError, ["key", "value"], shape_str(v[:, :-1].shape), attn, q, k, v[:, :-1])


def test_key_value_heads_mismatch():
    q, k, _ = _inputs()
    v = normal(np.random.default_rng(1), (B, S, 3, HV))
    check_error(ValueError, ["key", "value"], shape_str(v.shape), attn, q, k, v)


def test_dtype_mix():
    q, k, v = _inputs()
    check_error(TypeError, "key", "bfloat16", attn, q, k.astype(jnp.bfloat16), v)


def test_value_dtype_mix():
    q, k, v = _inputs()
    check_error(TypeError, "value", "float16", attn, q, k, v.astype(jnp.float16))


def test_non_float_dtype():
    q, k, v = _inputs()
    check_error(TypeError, "query", "int32", attn, q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32))


# ------------------------------------------------------------------------------------------------------------------
# bias, mask, sinks, soft cap, scale


def test_bias_not_broadcastable():
    q, k, v = _inputs()
    bias = jnp.zeros((B, N, T, S + 1), jnp.float32)
    check_error(ValueError, "bias", shape_str(bias.shape), attn, q, k, v, bias)


def test_bias_too_many_dims():
    q, k, v = _inputs()
    bias = jnp.zeros((1, B, N, T, S), jnp.float32)
    check_error(ValueError, "bias", shape_str(bias.shape), attn, q, k, v, bias)


def test_mask_not_broadcastable():
    q, k, v = _inputs()
    mask = jnp.ones((3, 1, T, S), bool)
    check_error(ValueError, "mask", shape_str(mask.shape), attn, q, k, v, None, mask)


def test_mask_not_bool():
    q, k, v = _inputs()
    mask = jnp.ones((T, S), jnp.int32)
    check_error(TypeError, "mask", "int32", attn, q, k, v, None, mask)


def test_mask_float_not_bool():
    q, k, v = _inputs()
    mask = jnp.ones((T, S), jnp.float32)
    check_error(TypeError, "mask", "float32", attn, q, k, v, None, mask)


@pytest.mark.parametrize("shape", [(N + 1,), (1, N), ()], ids=["N+1", "1xN", "scalar"])
def test_sinks_shape(shape):
    q, k, v = _inputs()
    sinks = jnp.zeros(shape, jnp.float32)
    check_error(ValueError, "sinks", shape_str(shape), attn, q, k, v, sinks=sinks)


def test_sinks_dtype():
    q, k, v = _inputs()
    check_error(TypeError, "sinks", "int32", attn, q, k, v, sinks=jnp.zeros((N,), jnp.int32))


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")], ids=["zero", "negative", "inf", "nan"])
def test_logits_soft_cap(cap):
    q, k, v = _inputs()
    check_error(ValueError, "logits_soft_cap", repr(cap), attn, q, k, v, logits_soft_cap=cap)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_scale_not_finite(scale):
    q, k, v = _inputs()
    check_error(ValueError, "scale", repr(scale), attn, q, k, v, scale=scale)


# ------------------------------------------------------------------------------------------------------------------
# masking options


@pytest.mark.parametrize("window", [-1, (2, -3), (-1, 0)], ids=["int", "right", "left"])
def test_window_negative(window):
    q, k, v = _inputs()
    check_error(ValueError, "local_window_size", str(window), attn, q, k, v, local_window_size=window)


@pytest.mark.parametrize("window", [(1, 2, 3), 2.5, "3"], ids=["triple", "float", "str"])
def test_window_bad_type(window):
    q, k, v = _inputs()
    # a wrong kind may be a ValueError (bad tuple length) or a TypeError (not an int / tuple)
    check_error((ValueError, TypeError), "local_window_size", repr(window), attn, q, k, v, local_window_size=window)


def test_unknown_diagonal_alignment():
    q, k, v = _inputs()
    check_error(ValueError, "diagonal_alignment", "'top_right'", attn, q, k, v, diagonal_alignment="top_right")


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_lengths_wrong_shape(name):
    q, k, v = _inputs()
    bad = lengths([3, 4, 5])
    check_error(ValueError, name, shape_str(bad.shape), attn, q, k, v, **{name: bad})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_lengths_wrong_dtype(name):
    q, k, v = _inputs()
    bad = jnp.asarray([3.0, 4.0], jnp.float32)
    check_error(TypeError, name, "float32", attn, q, k, v, **{name: bad})


# ------------------------------------------------------------------------------------------------------------------
# dropout


@pytest.mark.parametrize("rate", [1.0, -0.1, 1.5], ids=["one", "negative", "above_one"])
def test_dropout_rate_out_of_range(rate):
    q, k, v = _inputs()
    check_error(ValueError, "dropout_rate", repr(rate), attn, q, k, v, dropout_rate=rate, dropout_key=jax.random.key(0))


def test_dropout_without_key():
    q, k, v = _inputs()
    check_error(ValueError, ["dropout_rate", "dropout_key"], "0.1", attn, q, k, v, dropout_rate=0.1)


# ------------------------------------------------------------------------------------------------------------------
# segment ids


def test_q_segment_ids_wrong_shape():
    q, k, v = _inputs()
    ids = jnp.ones((B, T + 1), jnp.int32)
    check_error(ValueError, "q_segment_ids", shape_str(ids.shape), attn, q, k, v, q_segment_ids=ids,
                kv_segment_ids=jnp.ones((B, S), jnp.int32))  # fmt: skip


def test_kv_segment_ids_wrong_shape():
    q, k, v = _inputs()
    ids = jnp.ones((B, S - 1), jnp.int32)
    check_error(ValueError, "kv_segment_ids", shape_str(ids.shape), attn, q, k, v,
                q_segment_ids=jnp.ones((B, T), jnp.int32), kv_segment_ids=ids)  # fmt: skip


def test_segment_ids_wrong_dtype():
    q, k, v = _inputs()
    ids = jnp.ones((B, T), jnp.float32)
    check_error(TypeError, "q_segment_ids", "float32", attn, q, k, v, q_segment_ids=ids,
                kv_segment_ids=jnp.ones((B, S), jnp.int32))  # fmt: skip


def test_kv_segment_ids_default_needs_equal_lengths():
    q, k, v = _inputs()  # T=13 != S=17
    check_error(ValueError, "q_segment_ids", [f"T={T}", f"S={S}"], attn, q, k, v,
                q_segment_ids=jnp.ones((B, T), jnp.int32))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# THD


def _thd():
    r = np.random.default_rng(2)
    return normal(r, (T, N, H)), normal(r, (S, K, H)), normal(r, (S, K, HV))


def test_cu_seqlens_wrong_rank():
    q, k, v = _thd()
    cu = jnp.zeros((2, 3), jnp.int32)
    check_error(ValueError, "cu_seqlens_q", shape_str(cu.shape), attn, q, k, v, cu_seqlens_q=cu,
                cu_seqlens_kv=lengths([0, 5, 17]))  # fmt: skip


def test_cu_seqlens_too_short():
    q, k, v = _thd()
    cu = lengths([0])
    check_error(ValueError, "cu_seqlens_q", shape_str(cu.shape), attn, q, k, v, cu_seqlens_q=cu,
                cu_seqlens_kv=lengths([0]))  # fmt: skip


def test_cu_seqlens_wrong_dtype():
    q, k, v = _thd()
    cu = jnp.asarray([0.0, 5.0, 13.0], jnp.float32)
    check_error(TypeError, "cu_seqlens_q", "float32", attn, q, k, v, cu_seqlens_q=cu,
                cu_seqlens_kv=lengths([0, 5, 17]))  # fmt: skip


def test_cu_seqlens_q_kv_different_lengths():
    q, k, v = _thd()
    check_error(ValueError, ["cu_seqlens_q", "cu_seqlens_kv"], ["(3,)", "(4,)"], attn, q, k, v,
                cu_seqlens_q=lengths([0, 5, 13]), cu_seqlens_kv=lengths([0, 5, 9, 17]))  # fmt: skip


def test_cu_seqlens_decreasing():
    q, k, v = _thd()
    check_error(ValueError, "cu_seqlens_q", "[0, 7, 5]", attn, q, k, v, cu_seqlens_q=lengths([0, 7, 5]),
                cu_seqlens_kv=lengths([0, 5, 17]))  # fmt: skip


def test_cu_seqlens_past_token_count():
    q, k, v = _thd()
    check_error(ValueError, "cu_seqlens_kv", "[0, 5, 18]", attn, q, k, v, cu_seqlens_q=lengths([0, 5, 13]),
                cu_seqlens_kv=lengths([0, 5, 18]))  # fmt: skip


def test_thd_query_must_be_rank_3():
    q, k, v = _inputs()
    check_error(ValueError, ["cu_seqlens_q", "query"], shape_str(q.shape), attn, q, k, v,
                cu_seqlens_q=lengths([0, 5, 13]), cu_seqlens_kv=lengths([0, 5, 17]))  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# paged KV


def _paged():
    r = np.random.default_rng(3)
    q = normal(r, (B, 5, N, H))
    k = normal(r, (9, 4, K, H))
    v = normal(r, (9, 4, K, HV))
    return q, k, v, lengths([[5, 1, 7], [2, 8, 0]]), lengths([10, 7])


def test_page_table_without_kv_lengths():
    q, k, v, table, _ = _paged()
    check_error(ValueError, ["page_table", "key_value_seq_lengths"], "None", attn, q, k, v, page_table=table)


def test_page_table_wrong_rank():
    q, k, v, table, kvlen = _paged()
    bad = table.reshape(-1)
    check_error(ValueError, "page_table", shape_str(bad.shape), attn, q, k, v, page_table=bad,
                key_value_seq_lengths=kvlen)  # fmt: skip


def test_page_table_wrong_rows():
    q, k, v, table, kvlen = _paged()
    bad = jnp.concatenate([table, table[:1]], axis=0)
    check_error(ValueError, "page_table", shape_str(bad.shape), attn, q, k, v, page_table=bad,
                key_value_seq_lengths=kvlen)  # fmt: skip


def test_page_table_wrong_dtype():
    q, k, v, table, kvlen = _paged()
    check_error(TypeError, "page_table", "float32", attn, q, k, v, page_table=table.astype(jnp.float32),
                key_value_seq_lengths=kvlen)  # fmt: skip


def test_page_table_entry_out_of_range():
    q, k, v, _, kvlen = _paged()
    bad = lengths([[5, 1, 9], [2, 8, 0]])
    check_error(ValueError, "page_table", "9", attn, q, k, v, page_table=bad, key_value_seq_lengths=kvlen)


def test_page_pool_wrong_rank():
    q, k, v, table, kvlen = _paged()
    check_error(ValueError, "key", shape_str(k[0].shape), attn, q, k[0], v[0], page_table=table,
                key_value_seq_lengths=kvlen)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# implementation choice


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked", ("cudnn", "xla"), ["xla_chunked", "xla"], None],
                         ids=["xla", "xla_chunked", "tuple", "list", "none"])  # fmt: skip
def test_known_implementations_serve(implementation):
    q, k, v = _inputs()
    out = attnlib.attention(q, k, v, implementation=implementation)
    assert out.shape == (B, T, N, HV)


@pytest.mark.parametrize("implementation", ["flash", "XLA", ("xla", "triton"), ()],
                         ids=["flash", "case", "in_seq", "empty"])  # fmt: skip
def test_unknown_implementation(implementation):
    q, k, v = _inputs()
    bad = repr(implementation if isinstance(implementation, str) or not implementation else implementation[1])
    check_error(ValueError, "implementation", bad, attnlib.attention, q, k, v, implementation=implementation)


def test_no_requested_implementation_can_serve():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present; cudnn may serve")
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match=r"cudnn"):
        attnlib.attention(q, k, v, implementation=("cudnn",))


@pytest.mark.parametrize("value", [0, -2], ids=["zero", "negative"])
def test_max_segments_per_row_not_positive(value):
    q, k, v = _inputs()
    check_error(ValueError, "max_segments_per_row", str(value), attn, q, k, v,
                q_segment_ids=jnp.ones((B, T), jnp.int32), kv_segment_ids=jnp.ones((B, S), jnp.int32),
                max_segments_per_row=value)  # fmt: skip


def test_max_segments_per_row_without_segments():
    q, k, v = _inputs()
    check_error(ValueError, ["max_segments_per_row", "q_segment_ids"], "None", attn, q, k, v,
                max_segments_per_row=3)  # fmt: skip


def test_explicit_implementation_that_cannot_serve():
    # this test machine has no CUDA GPU / no native extension: an explicit "cudnn" must refuse, not fall back
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present; cudnn may serve")
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match=r"cudnn"):
        attnlib.attention(q, k, v, implementation="cudnn")


def test_fallback_is_logged(caplog, monkeypatch):
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present; cudnn may serve")
    from attnlib._src import logs

    # dispatch logs each distinct fallback once per process; forget earlier tests' messages
    monkeypatch.setattr(logs, "_logged", set())
    q, k, v = _inputs()
    with caplog.at_level(logging.DEBUG, logger="attnlib"):
        attnlib.attention(q, k, v, implementation=("cudnn", "xla"))
    text = "\n".join(rec.getMessage() for rec in caplog.records)
    assert "cudnn" in text and "xla" in text, f"fallback from cudnn to xla was not logged: {text!r}"


def test_explain():
    q, k, v = _inputs()
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    e = attnlib.explain(spec(q), spec(k), spec(v), implementation=("cudnn", "xla"), is_causal=True)
    assert e.implementation == "xla"
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert "cudnn" in e.declined and e.declined["cudnn"]
    assert "xla" in str(e)
    # explain validates like attention does
    check_error(ValueError, "logits_soft_cap", "-1.0", attnlib.explain, q, k, v, logits_soft_cap=-1.0)


def test_errors_raise_at_trace_time_under_jit():
    q, k, v = _inputs()
    f = jax.jit(lambda q, k, v: attn(q, k, v, sinks=jnp.zeros((N + 1,), jnp.float32)))
    check_error(ValueError, "sinks", shape_str((N + 1,)), f, q, k, v)


def test_message_style_example():
    # the house-style example sentence: which argument, the requirement, then "Got ..." with shapes
    q, _, _ = _inputs()
    r = np.random.default_rng(1)
    k, v = normal(r, (B, S, 4, H)), normal(r, (B, S, 4, HV))
    with pytest.raises(ValueError) as info:
        attn(q, k, v)
    assert re.search(r"Got .*\(2, 13, 6, 8\).*\(2, 17, 4, 8\)", str(info.value)), str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# padding lengths: range checked when concrete, clamped when traced; Python lists accepted as jax.nn accepts them


@pytest.mark.parametrize(
    "name,values,message",
    [
        ("key_value_seq_lengths", [20, 16], "must be in [0, S=16]. Got key_value_seq_lengths[0]=20"),
        ("key_value_seq_lengths", [3, -1], "must be in [0, S=16]. Got key_value_seq_lengths[1]=-1"),
        ("query_seq_lengths", [4, 13], "must be in [0, T=12]. Got query_seq_lengths[1]=13"),
    ],
)
def test_lengths_out_of_range_name_the_argument(name, values, message):
    q, kv = jnp.zeros((2, 12, 2, 8)), jnp.zeros((2, 16, 2, 8))
    with pytest.raises(ValueError, match=re.escape(f"`{name}` {message}")):
        attnlib.attention(q, kv, kv, **{name: jnp.asarray(values, jnp.int32)})


def test_lengths_as_lists_and_traced_lengths_are_clamped():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((2, 12, 2, 8)), jnp.float32)
    kv = jnp.asarray(r.standard_normal((2, 16, 2, 8)), jnp.float32)
    as_array = attnlib.attention(q, kv, kv, key_value_seq_lengths=jnp.asarray([16, 0], jnp.int32))
    as_list = attnlib.attention(q, kv, kv, key_value_seq_lengths=[16, 0])
    np.testing.assert_array_equal(np.asarray(as_list), np.asarray(as_array))
    clamped = jax.jit(lambda n: attnlib.attention(q, kv, kv, key_value_seq_lengths=n))
    traced = clamped(jnp.asarray([40, -5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(clamped(jnp.asarray([16, 0], jnp.int32))))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(as_array), rtol=1e-6, atol=1e-6)  # jit vs eager


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"return_max_logit": "yes"}, "`return_max_logit` must be bool. Got 'yes'."),
        ({"score_mod": lambda s, b, h, i, j, a: s * a, "score_mod_args": jnp.ones(2)},
         "`score_mod_args` must be a sequence (tuple or list). Got f32[2]."),
        ({"fp8": 8}, "`fp8` must be str | attnlib.Fp8Scales | None. Got 8."),
        ({"score_mod": 3}, "`score_mod` must be a callable | None. Got 3."),
    ],
)  # fmt: skip
def test_new_arguments_of_the_wrong_kind_get_one_readable_sentence(kwargs, message):
    """`score_mod`, `fp8` and `return_max_logit` arguments (docs/semantics.md): the type error names the argument
    and the expected kind as a user writes it."""
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(TypeError, match=re.escape(message)):
        attnlib.attention(q, q, q, **kwargs)


def test_numpy_scalars_are_accepted_where_python_ones_are():
    """As `jax.nn.dot_product_attention` accepts them."""
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 7, 2, 8)), jnp.float32)
    expected, expected_lse = attnlib.attention(
        q, q, q, is_causal=True, return_residual=True, scale=0.3, local_window_size=(3, 0), logits_soft_cap=5.0
    )
    out, lse = attnlib.attention(
        q, q, q, is_causal=np.bool_(True), return_residual=np.bool_(True), scale=np.float32(0.3),
        local_window_size=(np.int64(3), np.int32(0)), logits_soft_cap=np.float64(5.0),
    )  # fmt: skip
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(lse, expected_lse)
    explanation = attnlib.explain(q, q, q, is_causal=np.bool_(True), deterministic_backward=np.bool_(False))
    assert explanation.implementation is not None
