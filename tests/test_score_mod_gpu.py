"""GPU tests of score modifiers on `implementation="cudnn"`: `score_mod`, `mask_mod`, `logits_soft_cap` and boolean
`mask` arrays, forward and backward, against the `xla` implementation in float32 on the same rounded inputs (the
convention and tolerances of `test_cudnn_gpu.py`; `xla` itself is checked against the float64 reference on the CPU
in `test_score_mod.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cudnn_gpu import _compare, _qkv, DTYPE_IDS, DTYPES


pytestmark = pytest.mark.gpu


def softcap20(score, batch, head, q_idx, kv_idx):
    return 20.0 * jnp.tanh(score / 20.0)


def alibi(score, batch, head, q_idx, kv_idx, slope):
    return score - slope * jnp.abs(q_idx - kv_idx).astype(jnp.float32)


def head_sin(score, batch, head, q_idx, kv_idx):
    return score + 0.5 * jnp.sin(0.7 * head.astype(jnp.float32) + 0.01 * q_idx.astype(jnp.float32))


def prefix_lm(batch, head, q_idx, kv_idx):
    return (kv_idx < 16) | (kv_idx <= q_idx)


def sliding(batch, head, q_idx, kv_idx):
    return (q_idx - kv_idx < 24) & (kv_idx <= q_idx)


def document(batch, head, q_idx, kv_idx):
    return q_idx // 32 == kv_idx // 32


def banded_neg_inf(score, batch, head, q_idx, kv_idx):
    return jnp.where(kv_idx <= q_idx + 2, score, -jnp.inf)  # a score_mod that masks by returning -inf


def late_rows(batch, head, q_idx, kv_idx):
    return q_idx >= 20  # rows 0..19 see no key at all


def slopes(n):
    return (2.0 ** -(jnp.arange(n, dtype=jnp.float32) + 1)).reshape(n, 1, 1)


N = 6
# (id, T, S, N, K, H, Hv, kwargs)
CASES = [
    ("softcap_causal_gqa", 96, 96, N, 2, 64, 64, dict(logits_soft_cap=30.0, is_causal=True)),
    ("softcap_full_odd", 77, 131, N, 2, 64, 64, dict(logits_soft_cap=5.0)),
    ("softcap_window", 128, 128, N, 3, 64, 64, dict(logits_soft_cap=30.0, local_window_size=(17, 5))),
    ("softcap_bottom_right_t_lt_s", 48, 160, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, is_causal=True, diagonal_alignment="bottom_right")),
    ("softcap_bottom_right_t_gt_s", 160, 48, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, is_causal=True, diagonal_alignment="bottom_right")),
    ("softcap_sinks", 96, 112, N, 2, 64, 64, dict(logits_soft_cap=30.0, is_causal=True, sinks="random")),
    ("softcap_mla", 96, 96, 4, 4, 192, 128, dict(logits_soft_cap=30.0, is_causal=True)),
    ("softcap_padding", 128, 128, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, is_causal=True, query_seq_lengths=[100, 37], key_value_seq_lengths=[120, 5])),
    ("softcap_empty_sequence", 64, 64, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, query_seq_lengths=[64, 50], key_value_seq_lengths=[0, 33])),
    ("score_mod_softcap", 96, 96, N, 2, 64, 64, dict(score_mod=softcap20, is_causal=True)),
    ("alibi_args_causal", 96, 120, N, 2, 64, 64,
     dict(score_mod=alibi, score_mod_args="slopes", is_causal=True)),
    ("head_sin", 80, 80, N, 2, 64, 64, dict(score_mod=head_sin)),
    ("score_mod_neg_inf", 80, 96, N, 2, 64, 64, dict(score_mod=banded_neg_inf, sinks="random")),
    ("prefix_lm", 96, 96, N, 2, 64, 64, dict(mask_mod=prefix_lm)),
    ("sliding_as_mask_mod", 128, 128, N, 2, 64, 64, dict(mask_mod=sliding)),
    ("document", 128, 128, N, 2, 64, 64, dict(mask_mod=document)),
    ("fully_masked_rows", 64, 64, N, 2, 64, 64, dict(mask_mod=late_rows)),
    ("fully_masked_rows_sinks", 64, 64, N, 2, 64, 64, dict(mask_mod=late_rows, sinks="random")),
    ("mask_mod_softcap_causal_window", 128, 128, N, 2, 64, 64,
     dict(mask_mod=document, logits_soft_cap=30.0, is_causal=True, local_window_size=(40, 0))),
    ("bottom_right_mask_mod", 48, 160, N, 2, 64, 64, dict(mask_mod=sliding, diagonal_alignment="bottom_right")),
    # Sequence structure as an additive bias (dense graph): packed rows, and lengths with a bottom-right diagonal.
    ("segments_softcap_causal", 96, 96, N, 2, 64, 64, dict(logits_soft_cap=30.0, is_causal=True, q_segment_ids="runs")),
    ("segments_head_mask_window", 96, 96, N, 2, 64, 64,
     dict(mask_mod=lambda b, h, i, j: h != 1, local_window_size=(9, 3), q_segment_ids="runs")),
    ("cross_segments_softcap_bottom_right", 64, 96, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, is_causal=True, diagonal_alignment="bottom_right", q_segment_ids="runs",
          kv_segment_ids="runs")),
    ("padding_bottom_right_softcap", 80, 112, N, 2, 64, 64,
     dict(logits_soft_cap=30.0, is_causal=True, diagonal_alignment="bottom_right", query_seq_lengths=[70, 9],
          key_value_seq_lengths=[112, 40])),
]


def _materialize(kw, n, t, s, dtype, seed):
    kw = dict(kw)
    key = jax.random.key(seed + 7)
    if kw.get("sinks") == "random":
        kw["sinks"] = jax.random.normal(key, (n,), jnp.float32)
    if kw.get("bias") == "random":
        kw["bias"] = (0.5 * jax.random.normal(key, (2, n, t, s), jnp.float32)).astype(dtype)
    if kw.get("score_mod_args") == "slopes":
        kw["score_mod_args"] = (slopes(n),)
    for name, length in (("q_segment_ids", t), ("kv_segment_ids", s)):
        if kw.get(name) == "runs":  # row 0: four segments and padding; row 1: two segments
            cuts = [0, length // 5, length // 2, (3 * length) // 4, length - 3]
            row0 = np.zeros(length, np.int32)
            for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                row0[a:b] = i + 1
            row1 = np.where(np.arange(length) < (2 * length) // 3, 1, 2).astype(np.int32)
            kw[name] = jnp.asarray(np.stack([row0, row1]))
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_modifier_matches_reference(case, dtype):
    name, t, s, n, kh, h, hv, kw = case
    q, k, v = _qkv(11, (2,), t, s, n, kh, h, hv, dtype)
    kw = _materialize(kw, n, t, s, dtype, 11)
    out, lse, grads = _compare(q, k, v, kw, dtype=dtype, lse_grad=True)
    if name.startswith("fully_masked_rows"):
        assert np.all(np.asarray(out[:, :20], np.float32) == 0)
        assert np.all(np.asarray(grads[0][:, :20], np.float32) == 0)
        if "sinks" not in kw:
            assert np.all(np.isneginf(np.asarray(lse[:, :20])))


MASK_CASES = [
    ("random", dict()),
    ("random_causal", dict(is_causal=True)),
    ("random_padding", dict(query_seq_lengths=[90, 41], key_value_seq_lengths=[100, 60])),
    ("random_bias", dict(bias="random")),
    ("random_softcap", dict(logits_soft_cap=20.0, is_causal=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_boolean_mask_array(case, dtype):
    name, kw = case
    t, s, n, kh = 100, 112, N, 2
    q, k, v = _qkv(12, (2,), t, s, n, kh, 64, 64, dtype)
    kw = _materialize(kw, n, t, s, dtype, 12)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 1, t, s))
    mask = mask.at[:, :, 3].set(False)  # a fully masked row
    kw["mask"] = mask
    kw_bias = kw.pop("bias", None)
    if kw_bias is not None:
        kw["bias"] = kw_bias
    out, lse, grads = _compare(q, k, v, kw, dtype=dtype, lse_grad=True)
    assert np.all(np.asarray(out[:, 3], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, 3])))
    assert np.all(np.asarray(grads[0][:, 3], np.float32) == 0)


def test_explicit_cudnn_names_the_unsupported_op():
    import attnlib

    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="exp"):
        attnlib.attention(q, q, q, score_mod=lambda s, b, h, i, j: jnp.exp(s) * 0.1, implementation="cudnn")
    reason = attnlib.explain(q, q, q, score_mod=lambda s, b, h, i, j: jnp.exp(s) * 0.1).declined["cudnn"]
    assert "exp" in reason


def test_bias_with_a_modifier_declines_on_cudnn():
    """cuDNN adds its bias after the modifier, and a bias with a mask_mod gave wrong gradients on the H200 (cuDNN
    9.19): the call declines instead, and `explain` says why."""
    import attnlib

    q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    bias = jnp.zeros((2, 64, 64), jnp.bfloat16)
    explanation = attnlib.explain(q, q, q, bias, mask_mod=prefix_lm)
    assert explanation.implementation != "cudnn" and "bias" in explanation.declined["cudnn"]


def test_score_mod_args_gradient_is_refused_not_zero():
    import attnlib

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    f = lambda sl: jnp.sum(attnlib.attention(q, q, q, score_mod=alibi, score_mod_args=(sl,), implementation="cudnn"))
    with pytest.raises(NotImplementedError, match="score_mod_args"):
        jax.grad(f)(slopes(2))


def test_automatic_dispatch_serves_softcap_on_cudnn():
    import attnlib

    q = jnp.zeros((2, 256, 8, 64), jnp.bfloat16)
    explanation = attnlib.explain(q, q, q, is_causal=True, logits_soft_cap=50.0)
    assert explanation.implementation == "cudnn", str(explanation)


def test_vmap_of_a_batch_reading_modifier():
    """A modifier that reads `batch` under `vmap` sees each example's own rows (the mapped axis is looped)."""
    import attnlib

    q, k, v = _qkv(13, (3, 2), 40, 56, 4, 2, 64, 64, jnp.bfloat16)
    score_mod = lambda s, b, h, i, j: s * (1.0 + 0.5 * b.astype(jnp.float32))
    run = lambda impl, q, k, v: jax.vmap(
        lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, score_mod=score_mod, is_causal=True)
    )(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    np.testing.assert_allclose(
        np.asarray(run("cudnn", q, k, v), np.float32), np.asarray(run("xla", f32(q), f32(k), f32(v))),
        atol=2e-2, rtol=1e-2,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout_with_softcap_and_causal(dtype):
    """Dropout composes with a score modifier: cuDNN's keep mask, read off an identity value matrix, is the same in
    the forward and the backward of a soft-capped causal call (reference: the same mask applied by hand)."""
    import math

    from test_cudnn_gpu import _assert_close, _dropout_attention, _eps, _extract_kept, _normal

    B, T, S, N, rate, cap = 2, 64, 64, 2, 0.25, 20.0
    key = jax.random.key(321)
    kw = dict(is_causal=True, logits_soft_cap=cap)
    q, k, kept = _extract_kept(key, rate, B, T, S, N, dtype, **kw)
    visible = np.broadcast_to(np.tril(np.ones((T, S), bool))[None, :, None, :], kept.shape)
    assert not kept[~visible].any()
    frac = kept[visible].mean()
    assert abs(frac - (1 - rate)) < 6 * math.sqrt(rate * (1 - rate) / visible.sum()), frac
    v = _normal(jax.random.key(9), (B, S, N, 64), dtype)
    cot = jax.random.normal(jax.random.key(10), (B, T, N, 64), jnp.float32)
    mask = jnp.asarray(kept, jnp.float32)

    def ref(q, k, v):
        s = jnp.einsum("btnh,bsnh->btns", q, k, precision="highest") / math.sqrt(64)
        s = jnp.where(jnp.asarray(visible), cap * jnp.tanh(s / cap), -jnp.inf)
        return jnp.einsum("btns,bsnh->btnh", jax.nn.softmax(s, axis=-1) * mask / (1 - rate), v, precision="highest")

    run = lambda q, k, v: _dropout_attention(q, k, v, key, rate, **kw)
    e = _eps(dtype)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    _assert_close(jax.jit(run)(q, k, v), ref(f32(q), f32(k), f32(v)), 2 * e / (1 - rate), e, "out")
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32) * cot), argnums=(0, 1, 2)))(q, k, v)
    r_grads = jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        _assert_close(g, rg, 8 * e / (1 - rate), e, name, scale_by_max=True)
