"""`jax.debug_nans` / `jax.debug_infs` (issue 43 item 3): a call in which every query row sees a key, and its
gradient, compute no inf or NaN anywhere on the plain-JAX implementations, in float32 and float64. Masking uses a
finite score (`scores.hidden_score`, jax.nn's `-0.7 * finfo.max`); only the `lse` returned for a row that sees
nothing is -inf, as the contract says.

The calls run under `jax.disable_jit()`, so every operation is checked, inside loops and `custom_vjp` rules too
(under `jit` the flags check only a computation's outputs).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib


B, T, S, N, K, H = 2, 7, 9, 4, 2, 8

CASES = {
    "causal": dict(is_causal=True),
    "kv_lengths": dict(key_value_seq_lengths=[9, 3]),
    "q_and_kv_lengths": dict(query_seq_lengths=[7, 4], key_value_seq_lengths=[5, 9], is_causal=True),
    "mask": dict(mask="random"),
    "gqa_window_sinks": dict(is_causal=True, local_window_size=(2, 0), sinks="random"),
    "bias": dict(bias="random", is_causal=True),
    "bias_mask_softcap": dict(bias="random", mask="random", logits_soft_cap=3.0),
    "dropout": dict(dropout_rate=0.25, dropout_key="key", is_causal=True),
    "fp8": dict(fp8="current", is_causal=True, key_value_seq_lengths=[6, 9]),
    "score_mod_mask_mod": dict(
        score_mod=lambda s, b, h, i, j: s - 0.25 * jnp.abs(i - j).astype(s.dtype),
        mask_mod=lambda b, h, i, j: (j <= i) | (j % 2 == 0),
    ),
}
EMPTY_ROWS = {"q_and_kv_lengths"}
"""Cases whose padded query rows see nothing: healthy as long as their (-inf) `lse` is not returned."""

IMPLS = {
    "xla": "xla",
    "xla_chunked": "xla_chunked",  # keys in one block: the forward's probabilities reused by the backward
    "xla_chunked-bk4": attnlib.XlaChunked(block_k=4),  # online softmax over three blocks, recomputing backward
}


@contextlib.contextmanager
def _checked(dtype):
    """NaN and inf checks on, every operation run eagerly, and float64 enabled for float64."""
    with jax.debug_nans(True), jax.debug_infs(True), jax.enable_x64(dtype == np.float64), jax.disable_jit():
        yield


def _inputs(case: str, dtype, seed: int = 0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((B, T, N, H)), dtype)
    k = jnp.asarray(r.standard_normal((B, S, K, H)), dtype)
    v = jnp.asarray(r.standard_normal((B, S, K, H)), dtype)
    kw = dict(CASES[case])
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    if kw.get("mask") == "random":
        mask = r.random((B, N, T, S)) < 0.3
        mask[..., np.arange(T), np.arange(T)] = True  # every row sees a key
        kw["mask"] = jnp.asarray(mask)
    if kw.get("dropout_key") == "key":
        kw["dropout_key"] = jax.random.key(seed)
    if kw.get("sinks") == "random":
        kw["sinks"] = jnp.asarray(r.standard_normal(N), dtype)
    bias = jnp.asarray(r.standard_normal((1, N, T, S)), dtype) if kw.pop("bias", None) == "random" else None
    return q, k, v, bias, kw


def _skip_unsupported(impl_name: str, case: str, dtype):
    if impl_name != "xla" and "score_mod" in CASES[case] and dtype == np.float64:
        pytest.skip("xla_chunked declines a float64 score_mod")
    if "fp8" in CASES[case] and dtype == np.float64:
        pytest.skip("FP8 attention takes 16- and 32-bit inputs")


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("impl_name", list(IMPLS))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradient_are_finite(case, impl_name, dtype):
    _skip_unsupported(impl_name, case, dtype)
    return_residual = case not in EMPTY_ROWS
    with _checked(dtype):
        q, k, v, bias, kw = _inputs(case, dtype)
        r = np.random.default_rng(1)
        d_out = jnp.asarray(r.standard_normal((B, T, N, H)), dtype)
        d_lse = jnp.asarray(r.standard_normal((B, T, N)), dtype)

        def loss(q, k, v, bias):
            result = attnlib.attention(
                q, k, v, bias, implementation=IMPLS[impl_name], return_residual=return_residual, **kw
            )
            if not return_residual:
                return jnp.sum(result * d_out)
            out, lse = result
            return jnp.sum(out * d_out) + jnp.sum(lse.astype(dtype) * d_lse)

        argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
        value, grads = jax.value_and_grad(loss, argnums=argnums)(q, k, v, bias)
    assert np.isfinite(value)
    for g in grads:
        assert g.dtype == dtype
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_empty_rows_keep_their_contract(impl_name, dtype):
    """With the flags off, a row that sees nothing still returns `out = 0`, `lse = -inf` (its sink logit with
    sinks) and passes zero gradients; the other rows' gradients are finite."""
    with jax.enable_x64(dtype == np.float64):
        q, k, v, _, _ = _inputs("mask", dtype)
        mask = np.ones((B, 1, T, S), bool)
        mask[0, :, 2] = False  # batch 0, query 2 sees nothing
        mask = jnp.asarray(mask)
        sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], dtype)
        for with_sinks in (False, True):
            kw = dict(mask=mask, implementation=IMPLS[impl_name], return_residual=True)
            if with_sinks:
                kw["sinks"] = sinks
            out, lse = attnlib.attention(q, k, v, **kw)
            np.testing.assert_array_equal(np.asarray(out[0, 2]), 0.0)
            expected = np.asarray(sinks, np.float64) if with_sinks else np.full(N, -np.inf)
            np.testing.assert_allclose(np.asarray(lse[0, 2], np.float64), expected, rtol=1e-6)
            assert np.isfinite(np.asarray(lse[1])).all()

            def loss(q, k, v):
                out, lse = attnlib.attention(q, k, v, **kw)
                finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
                return jnp.sum(out) + jnp.sum(finite_lse.astype(dtype))

            dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
            np.testing.assert_array_equal(np.asarray(dq[0, 2]), 0.0)
            for g in (dq, dk, dv):
                assert np.isfinite(np.asarray(g)).all()


@pytest.mark.parametrize("impl_name", list(IMPLS))
def test_empty_lse_gradient_is_zero(impl_name):
    """The cotangent of a -inf `lse` entry does not reach the inputs."""
    q, k, v, _, _ = _inputs("mask", np.float32)
    mask = np.ones((B, 1, T, S), bool)
    mask[1, :, 4] = False
    kw = dict(mask=jnp.asarray(mask), implementation=IMPLS[impl_name], return_residual=True)
    empty_lse = lambda q, k, v: jnp.sum(attnlib.attention(q, k, v, **kw)[1][1, 4])  # noqa: E731
    dq, dk, dv = jax.grad(empty_lse, argnums=(0, 1, 2))(q, k, v)
    for g in (dq, dk, dv):
        np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_max_logit_is_finite(dtype):
    """`return_max_logit` of rows and sequences that all see a key, dense with padded query rows and THD."""
    with _checked(dtype):
        q, k, v, _, kw = _inputs("q_and_kv_lengths", dtype)
        _, max_logit = attnlib.attention(q, k, v, implementation="xla", return_max_logit=True, **kw)
        cu_seqlens = jnp.asarray([0, 3, 7], jnp.int32)
        _, thd_max_logit = attnlib.attention(
            q[0], k[0, :T], v[0, :T], cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, is_causal=True,
            implementation="xla", return_max_logit=True,
        )  # fmt: skip
    assert np.isfinite(np.asarray(max_logit)).all() and np.isfinite(np.asarray(thd_max_logit)).all()
