"""float64 inputs (docs/semantics.md: as `jax.nn` allows under `jax_enable_x64`): the plain-JAX implementations compute
in float64 end to end (scores, softmax statistics, accumulators, `lse`, gradients) and match the float64 reference of
`tests/reference.py` to ~1e-12; fused implementations and context parallelism decline with a clear reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, Tol
from reference import reference_attention, reference_attention_vjp

import attnlib
import attnlib.equinox as aeqx
from attnlib._src import validation
from attnlib._src.backends import xla_chunked
from attnlib._src.backends.cudnn import support


TIGHT = Tol(atol=1e-12, rtol=1e-12)
N, K = 6, 2

CASES = {
    "causal_gqa": dict(is_causal=True),
    "padding_bottom_right": dict(
        is_causal=True, diagonal_alignment="bottom_right", query_seq_lengths=[9, 4], key_value_seq_lengths=[17, 6]
    ),
    "sinks_softcap_window": dict(logits_soft_cap=4.0, sinks="random", local_window_size=(5, 1)),
    "bias_and_mask_mod": dict(bias="random", mask_mod=lambda b, h, i, j: (j % 3 != 1) | (j <= i)),
    "score_mod": dict(score_mod=lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j).astype(s.dtype)),
    "segments": dict(is_causal=True, q_segment_ids="runs"),
}


def _inputs(case, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((2, 13, N, 16)))
    k = jnp.asarray(r.standard_normal((2, 17, K, 16)))
    v = jnp.asarray(r.standard_normal((2, 17, K, 8)))
    kw = dict(CASES[case])
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    if kw.get("q_segment_ids") == "runs":
        kw["q_segment_ids"] = jnp.asarray([[1] * 5 + [2] * 8, [1] * 9 + [0] * 4], jnp.int32)
        kw["kv_segment_ids"] = jnp.asarray([[1] * 7 + [2] * 10, [1] * 12 + [0] * 5], jnp.int32)
    if kw.get("sinks") == "random":
        kw["sinks"] = jnp.asarray(r.standard_normal(N))
    bias = jnp.asarray(r.standard_normal((1, N, 13, 17))) if kw.pop("bias", None) == "random" else None
    d_out = r.standard_normal((2, 13, N, 8))
    d_lse = r.standard_normal((2, 13, N))
    return q, k, v, bias, kw, d_out, d_lse


def _numpy(kw):
    return {n: (np.asarray(x) if hasattr(x, "shape") else x) for n, x in kw.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_reference(case, impl):
    with jax.enable_x64(True):
        q, k, v, bias, kw, d_out, d_lse = _inputs(case)
        if impl != "xla" and case == "score_mod":  # xla_chunked: traced at float32, declined by name
            with pytest.raises(NotImplementedError, match="`score_mod` with float64 inputs"):
                attnlib.attention(q, k, v, implementation=impl, **kw)
            return

        def loss(q, k, v, bias):
            out, lse = attnlib.attention(q, k, v, bias, implementation=impl, return_residual=True, **kw)
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

        # one compiled program (the forward's outputs come with the gradients)
        value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (_, (out, lse)), grads = value_and_grads(q, k, v, bias)
        assert out.dtype == lse.dtype == jnp.float64
        assert all(g is None or g.dtype == jnp.float64 for g in grads)
        args = (np.asarray(q), np.asarray(k), np.asarray(v), None if bias is None else np.asarray(bias))
        r_out, r_lse = reference_attention(*args, **_numpy(kw))
        assert_close(out, r_out, TIGHT, what="out")
        assert_close(lse, r_lse, TIGHT, what="lse")
        ref = reference_attention_vjp(*args, d_out=d_out, d_lse=d_lse, **_numpy(kw))
        for name, g in zip(("query", "key", "value", "bias"), grads, strict=True):
            if g is not None:
                assert_close(g, ref[name], Tol(atol=1e-11, rtol=1e-11), what=f"d{name}", scale_atol_by_max=True)


def test_xla_chunked_names_the_float64_score_mod_limit():
    with jax.enable_x64(True):
        q, k, v, _, kw, _, _ = _inputs("score_mod")
        with pytest.raises(NotImplementedError, match="`score_mod` with float64 inputs"):
            attnlib.attention(q, k, v, implementation="xla_chunked", **kw)
        assert attnlib.explain(q, k, v, **kw).implementation == "xla"


def test_fused_and_context_parallel_decline_float64():
    with jax.enable_x64(True):
        q = jnp.zeros((1, 8, 2, 16), jnp.float64)
        config, _ = validation.validate(
            q, q, q, None, None, scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
            local_window_size=None, return_residual=False, diagonal_alignment="top_left", q_segment_ids=None,
            kv_segment_ids=None, max_segments_per_row=None, cu_seqlens_q=None, cu_seqlens_kv=None,
            max_seqlen_q=None, max_seqlen_kv=None, page_table=None, logits_soft_cap=None, sinks=None,
            dropout_rate=0.0, dropout_key=None, deterministic_backward=False,
        )  # fmt: skip
        assert "dtype float64 is not supported" in support.policy_reason(config, (9, 0), 91900)
        plain = "xla_chunked" if xla_chunked.auto_min_score_bytes() == 0 else "xla"  # a CPU picks it at every size
        assert attnlib.explain(q, q, q).implementation == plain
        with pytest.raises(NotImplementedError, match="float64"):
            attnlib.context_parallel.attention(q, q, q, axis_name="cp")
        with pytest.raises(TypeError, match=r"`fp8='current'` quantizes float16, bfloat16 or float32 inputs"):
            attnlib.attention(q, q, q, fp8="current")


def test_layers_run_in_float64():
    """As `equinox.nn.MultiheadAttention` does under x64 (float64 parameters by default)."""
    with jax.enable_x64(True):
        layer = aeqx.MultiheadAttention(4, 16, num_kv_heads=2, is_causal=True, key=jax.random.key(0))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 16)))
        y = layer(x, x, x)
        assert y.dtype == jnp.float64 and np.all(np.isfinite(np.asarray(y)))
