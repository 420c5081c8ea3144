"""The public surface: names, lazy framework imports, explain(), dispatch logging."""

import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import attnlib


def test_import_attnlib_imports_no_framework():
    code = "import sys, attnlib; print('equinox' in sys.modules, 'haiku' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_public_names():
    assert callable(attnlib.attention)
    assert callable(attnlib.explain)
    assert isinstance(attnlib.__version__, str)


def _shapes(T=13, S=17, N=6, K=3, H=8, Hv=5, B=2, dtype=jnp.float32):
    return (
        jax.ShapeDtypeStruct((B, T, N, H), dtype),
        jax.ShapeDtypeStruct((B, S, K, H), dtype),
        jax.ShapeDtypeStruct((B, S, K, Hv), dtype),
    )


def test_explain_accepts_shape_dtype_structs_and_reports_reasons():
    q, k, v = _shapes()
    explanation = attnlib.explain(q, k, v, is_causal=True)
    # Small scores: a CPU picks xla_chunked at every size, an accelerator leaves them to xla.
    on_cpu = jax.default_backend() == "cpu"
    assert explanation.implementation == ("xla_chunked" if on_cpu else "xla")
    assert set(explanation.declined) == ({"cudnn"} if on_cpu else {"cudnn", "xla_chunked"})
    assert all(isinstance(r, str) and r for r in explanation.declined.values())
    assert f"would run: {explanation.implementation}" in str(explanation)


def test_explain_prefers_chunked_for_long_sequences_without_gpu():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("the CPU policy: on a GPU machine cuDNN comes first")
    q, k, v = _shapes(T=8192, S=8192, N=8, K=8, H=64, Hv=64, B=1)
    assert attnlib.explain(q, k, v).implementation == "xla_chunked"


def test_explain_validates_like_attention():
    q, k, v = _shapes()
    with pytest.raises(ValueError, match="`diagonal_alignment`"):
        attnlib.explain(q, k, v, diagonal_alignment="middle")
    with pytest.raises(TypeError, match="unexpected keyword argument `bogus`"):
        attnlib.explain(q, k, v, bogus=1)


def test_explicit_sequence_order_is_respected():
    q, k, v = _shapes()
    assert attnlib.explain(q, k, v, implementation=["xla_chunked", "xla"]).implementation == "xla_chunked"


def test_fallback_is_logged(caplog):
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("on a GPU cuDNN may serve the call and nothing falls back")
    q = jnp.ones((1, 3, 2, 8), jnp.float32)
    with caplog.at_level(logging.INFO, logger="attnlib"):
        attnlib.attention(q, q, q, implementation=["cudnn", "xla"], scale=0.3)
    assert any("cudnn declined" in r.getMessage() and "using xla" in r.getMessage() for r in caplog.records)


def test_single_named_implementation_that_cannot_serve_raises():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("cuDNN can serve on a GPU")
    q = jnp.ones((1, 3, 2, 8), jnp.float32)
    with pytest.raises(NotImplementedError, match="cudnn"):
        attnlib.attention(q, q, q, implementation="cudnn")


def test_self_check_runs():
    result = subprocess.run(
        [sys.executable, "-m", "attnlib", "--length", "64", "--batch", "1"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check passed" in result.stdout
    assert "xla_chunked" in result.stdout and "max|out - float64 ref|" in result.stdout


def test_automatic_choice_between_the_plain_implementations_is_per_platform(monkeypatch):
    """A CPU runs xla_chunked at every size (measured faster, benchmarks/bench_cpu_dispatch.py); elsewhere small
    scores are left to xla."""
    from attnlib._src.backends import xla_chunked

    q, k, v = _shapes()
    config = attnlib._src.validation.validate(
        q, k, v, None, None, scale=None, is_causal=True, query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=None, return_residual=False, diagonal_alignment="top_left", q_segment_ids=None,
        kv_segment_ids=None, max_segments_per_row=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
        max_seqlen_kv=None, page_table=None, logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_key=None,
        deterministic_backward=False,
    )[0]  # fmt: skip
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert xla_chunked.IMPLEMENTATION.decline_reason(config, explicit=False) is None
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    reason = xla_chunked.IMPLEMENTATION.decline_reason(config, explicit=False)
    assert reason is not None and "materialised scores" in reason and "GPU" in reason
    assert xla_chunked.IMPLEMENTATION.decline_reason(config, explicit=True) is None
