"""The public surface: names, lazy framework imports, explain(), dispatch logging."""

import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import place_calls_on

import attnlib
from attnlib._src.backends import xla_chunked


def test_import_attnlib_imports_no_framework():
    code = "import sys, attnlib; print('equinox' in sys.modules, 'haiku' in sys.modules, 'flax' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False", "False"]


def test_public_names():
    assert callable(attnlib.attention)
    assert callable(attnlib.explain)
    for cls in (attnlib.Cudnn, attnlib.PallasTpu, attnlib.Xla, attnlib.XlaChunked):
        assert hash(cls()) == hash(cls()) and cls() == cls()  # frozen, hashable: static under jit
    assert (
        attnlib.Cudnn().name == "cudnn" and attnlib.Xla().name == "xla" and attnlib.XlaChunked().name == "xla_chunked"
    )
    assert attnlib.PallasTpu().name == "pallas_tpu"
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
    on_cpu = xla_chunked.auto_min_score_bytes() == 0
    assert explanation.implementation == ("xla_chunked" if on_cpu else "xla")
    assert set(explanation.declined) == ({"cudnn", "pallas_tpu"} if on_cpu else {"cudnn", "pallas_tpu", "xla_chunked"})
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
    """A CPU runs xla_chunked at every size (measured faster, benchmarks/bench_cpu.py --suite dispatch); elsewhere small
    scores are left to xla."""
    from attnlib._src.backends.base import Context

    q, k, v = _shapes()
    automatic, requested = Context(automatic=True), Context(automatic=False)
    chunked = attnlib.XlaChunked()
    config = attnlib._src.validation.validate(
        q, k, v, None, None, scale=None, is_causal=True, query_seq_lengths=None, key_value_seq_lengths=None,
        local_window_size=None, return_residual=False, diagonal_alignment="top_left", q_segment_ids=None,
        kv_segment_ids=None, max_segments_per_row=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
        max_seqlen_kv=None, page_table=None, logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_key=None,
        deterministic_backward=False,
    )[0]  # fmt: skip
    place_calls_on(monkeypatch, "cpu")
    assert chunked.decline_reason(config, automatic) is None
    place_calls_on(monkeypatch, "gpu")
    reason = chunked.decline_reason(config, automatic)
    assert reason is not None and "materialised scores" in reason and "GPU" in reason
    assert chunked.decline_reason(config, requested) is None


def test_configured_xla_chunked_runs_its_block_size(monkeypatch):
    """`XlaChunked(block_k=4)` pads S = 17 keys to 5 blocks of 4; the name runs one 17-key block. Same numbers."""
    from attnlib._src.backends import xla_chunked

    padded_to = []
    pad_keys = xla_chunked.pad_keys
    monkeypatch.setattr(xla_chunked, "pad_keys", lambda p, s: padded_to.append(s) or pad_keys(p, s))
    r = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(r[0], (2, 13, 6, 8))
    k, v = jax.random.normal(r[1], (2, 17, 3, 8)), jax.random.normal(r[2], (2, 17, 3, 5))
    small = attnlib.attention(q, k, v, is_causal=True, implementation=attnlib.XlaChunked(block_k=4))
    default = attnlib.attention(q, k, v, is_causal=True, implementation="xla_chunked")
    assert padded_to == [20, 17]
    assert jnp.allclose(small, default, atol=1e-5)


def test_configured_implementation_is_a_static_value():
    """Equal configurations hit jit's cache; another block size retraces."""
    traces = []

    def run(q, implementation):
        traces.append(implementation)
        return attnlib.attention(q, q, q, implementation=implementation)

    run = jax.jit(run, static_argnames="implementation")
    q = jnp.ones((1, 9, 2, 8))
    for block_k in (4, 4, 5):
        run(q, implementation=attnlib.XlaChunked(block_k=block_k))
    assert traces == [attnlib.XlaChunked(block_k=4), attnlib.XlaChunked(block_k=5)]


def test_configured_implementation_in_explain_sequences_and_layers():
    q, k, v = _shapes()
    chunked = attnlib.XlaChunked(block_k=4)
    assert attnlib.explain(q, k, v, implementation=chunked).implementation == "xla_chunked"
    assert attnlib.explain(q, k, v, implementation=["cudnn", chunked]).implementation in ("cudnn", "xla_chunked")
    assert attnlib.explain(q, k, v, implementation=(chunked, "xla")).requested == ("xla_chunked", "xla")
    import attnlib.equinox as aeqx

    layer = aeqx.MultiheadAttention(4, 16, implementation=chunked, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (11, 16))
    assert layer.implementation is chunked
    plain = aeqx.MultiheadAttention(4, 16, implementation="xla", key=jax.random.key(0))
    assert jnp.allclose(layer(x, x, x), plain(x, x, x), atol=1e-5)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (
            5,
            TypeError,
            r"`implementation` must be str \| attnlib.Cudnn \| attnlib.PallasTpu \| attnlib.XlaChunked \| attnlib.Xla"
            r" \| a sequence",
        ),
        ("flash", ValueError, r"`implementation` must be None, one of .* a configured implementation"),
        ([], ValueError, r"non-empty sequence"),
        (["xla", 3], ValueError, r"Got \['xla', 3\]"),
    ],
)
def test_bad_implementation_is_named(bad, error, match):
    q = jnp.ones((1, 3, 2, 8))
    with pytest.raises(error, match=match):
        attnlib.attention(q, q, q, implementation=bad)


@pytest.mark.parametrize("block_k", [0, -3, 2.5, True, "64"])
def test_bad_block_k_is_named(block_k):
    with pytest.raises(ValueError, match=r"`block_k` must be a positive int. Got block_k="):
        attnlib.XlaChunked(block_k=block_k)


def test_every_argument_of_attention_has_one_home_in_context_parallelism():
    """Context parallelism forwards, handles or refuses each keyword of `attnlib.attention`: a new option must be
    classified there (the lists are checked against the signature, the one list of arguments)."""
    from attnlib._src.attention import ARGUMENT_DEFAULTS
    from attnlib._src.context_parallel import api

    homes = [set(api._FORWARDED), set(api._HANDLED), set(api._UNSUPPORTED), set(api._UNSUPPORTED_MODIFIERS)]
    assert set().union(*homes) == set(ARGUMENT_DEFAULTS)
    assert sum(len(h) for h in homes) == len(ARGUMENT_DEFAULTS), "an argument is in two lists"


def test_context_parallelism_refuses_max_logit_by_name():
    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(NotImplementedError, match="`return_max_logit`"):
        attnlib.context_parallel.attention(q, q, q, axis_name="x", return_max_logit=True)


def test_explain_takes_every_keyword_of_attention():
    """`explain` accepts exactly `attention`'s arguments: it reads them from `attention`'s signature."""
    import inspect

    q, k, v = _shapes()
    names = [n for n, p in inspect.signature(attnlib.attention).parameters.items() if p.kind is p.KEYWORD_ONLY]
    defaults = {n: inspect.signature(attnlib.attention).parameters[n].default for n in names}
    assert attnlib.explain(q, k, v, **defaults).implementation is not None
    with pytest.raises(TypeError, match="unexpected keyword argument `is_casual`"):
        attnlib.explain(q, k, v, is_casual=True)
