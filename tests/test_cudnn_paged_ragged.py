"""Ragged queries against a paged cache (`cu_seqlens_q` with `page_table`) on cuDNN's paged forward graph.

One serving step mixes prefill chunks, single-token decodes, an idle sequence, an empty slot and padding rows past
`cu_seqlens_q[-1]` on a token-major `PagedKVCache`. attnlib lays the packed queries out as rows
`[B, max_seqlen_q, N, H]` for the graph and reads each token's result back. Every expected value is the float64
reference (`tests/reference.py`) run sequence by sequence, each as a dense paged call with its own queries, its
page-table row and its key count (bottom-right causal unless a case says otherwise); the gradient goes through the
`xla` fallback, since cuDNN's paged graph has no backward.

- On the CPU the graph call is the plain-JAX model of a cuDNN paged graph (`cudnn_emulation.emulate_graph`, as on an
  H200 with cuDNN 9.19): it writes NaN wherever a real kernel may leave rows undefined, so the wrapper's masking and
  gathering are exercised. With the native extension built, the same steps also run through the real FFI call and
  the extension's CPU handler (`cudnn_paged_ragged_ffi_cases.py`, in a subprocess), and the CUDA lowering shows one
  `attnlib_cudnn_graph` call of a paged graph.
- The `gpu` tests run the same kind of step on real cuDNN.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import emulate_graph, entry_for, h200, install
from helpers import (
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    place_calls_on,
    run_pytest_on_simulated_devices,
)
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.backends.cudnn import ffi, support
from attnlib._src.config import AttentionConfig


BOTTOM_RIGHT_CAUSAL = {"is_causal": True, "diagonal_alignment": "bottom_right"}


@dataclasses.dataclass(frozen=True)
class Step:
    """A cache holding `prefix[b]` tokens of sequence `b`, then one ragged step appending `chunk[b]` tokens and
    querying `queries[b]` (default: the appended ones): prefill chunks, decodes (1), idle sequences and empty slots
    (0) mixed, with `padding_rows` packed rows past `cu_seqlens_q[-1]`."""

    prefix: tuple[int, ...] = (5, 17, 0, 9, 22, 0)
    chunk: tuple[int, ...] = (7, 1, 11, 0, 1, 0)
    queries: tuple[int, ...] | None = None
    n: int = 6
    k: int = 2
    h: int = 40
    hv: int = 24
    page_size: int = 8
    pages_per_seq: int = 3
    num_pages: int = 13
    padding_rows: int = 3
    max_seqlen_q: int | None = 11

    @property
    def counts(self) -> tuple[int, ...]:
        return self.chunk if self.queries is None else self.queries

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int32)

    @property
    def bound(self) -> dict:
        return {} if self.max_seqlen_q is None else {"max_seqlen_q": self.max_seqlen_q}


def _mixed_step(step: Step, seed: int = 0, dtype=jnp.bfloat16):
    """`(cache, queries [Tq, N, H])`: the prefix written by a dense append with lengths, the chunk by a ragged one."""
    r = np.random.default_rng(seed)
    B = len(step.prefix)
    draw = lambda *shape: jnp.asarray(r.standard_normal(shape).astype(np.float32), dtype)  # noqa: E731
    cache = attnlib.PagedKVCache.create(
        B, step.num_pages, step.page_size, step.k, step.h, step.hv, dtype=dtype,
        max_pages_per_seq=step.pages_per_seq, layout="token_major",
    )  # fmt: skip
    width = max(step.prefix)
    cache = cache.append(draw(B, width, step.k, step.h), draw(B, width, step.k, step.hv),
                         lengths=jnp.asarray(step.prefix, jnp.int32))  # fmt: skip
    cu = np.concatenate([[0], np.cumsum(step.chunk)]).astype(np.int32)
    new = int(cu[-1]) + 2  # two rows past cu[-1]: not written
    cache = cache.append(draw(new, step.k, step.h), draw(new, step.k, step.hv), cu_seqlens=cu)
    np.testing.assert_array_equal(cache.lengths, np.add(step.prefix, step.chunk))
    queries = draw(int(step.cu_seqlens_q[-1]) + step.padding_rows, step.n, step.h)
    return cache, queries


def _per_sequence(step: Step, cache, queries, fn):
    """`fn(query [1, t, N, H], table [1, pps], lengths [1], rows)` for each sequence with queries, float64."""
    table, lengths, cu = np.asarray(cache.page_table), np.asarray(cache.lengths), step.cu_seqlens_q
    q = np.asarray(queries.astype(jnp.float32), np.float64)
    for b, count in enumerate(step.counts):
        if count:
            rows = slice(int(cu[b]), int(cu[b + 1]))
            fn(q[None, rows], table[b : b + 1], lengths[b : b + 1], rows)


def _pools(cache):
    return tuple(np.asarray(x.astype(jnp.float32), np.float64) for x in (cache.k_pages, cache.v_pages))


def _expected(step: Step, cache, queries, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """float64 `(out [Tq, N, Hv], lse [Tq, N])`: each sequence alone; padding rows 0 and -inf."""
    out = np.zeros(queries.shape[:2] + (step.hv,))
    lse = np.full(queries.shape[:2], -np.inf)
    k_pool, v_pool = _pools(cache)

    def one(q, table, lengths, rows):
        o, l = reference_attention(q, k_pool, v_pool, page_table=table, key_value_seq_lengths=lengths, **kwargs)
        out[rows], lse[rows] = o[0], l[0]

    _per_sequence(step, cache, queries, one)
    return out, lse


def _expected_grads(step: Step, cache, queries, d_out, d_lse, **kwargs) -> tuple[np.ndarray, ...]:
    """float64 gradients of `<d_out, out> + <d_lse, lse>` w.r.t. the packed queries and both pools."""
    k_pool, v_pool = _pools(cache)
    dq = np.zeros(queries.shape)
    dk, dv = np.zeros(k_pool.shape), np.zeros(v_pool.shape)

    def one(q, table, lengths, rows):
        g = reference_attention_vjp(
            q, k_pool, v_pool, page_table=table, key_value_seq_lengths=lengths,
            d_out=np.asarray(d_out, np.float64)[None, rows], d_lse=np.asarray(d_lse, np.float64)[None, rows],
            **kwargs,
        )  # fmt: skip
        dq[rows] = g["query"][0]
        dk[...] += g["key"]
        dv[...] += g["value"]

    _per_sequence(step, cache, queries, one)
    return dq, dk, dv


def _attend(step: Step, cache, queries, implementation, **kwargs):
    return cache.attend(queries, cu_seqlens_q=step.cu_seqlens_q, implementation=implementation, **step.bound,
                        **kwargs)  # fmt: skip


def _explain(step: Step, cache, queries, **kwargs):
    kwargs = {**BOTTOM_RIGHT_CAUSAL, **kwargs}
    return attnlib.explain(queries, cache, None, cu_seqlens_q=step.cu_seqlens_q, **step.bound, **kwargs)


def _check_step(step: Step, cache, queries, implementation, kwargs, dtype=jnp.bfloat16):
    """Output and lse of the step against the float64 reference, and the output-only call's output."""
    run = jax.jit(lambda q, c, residual: _attend(step, c, q, implementation, return_residual=residual, **kwargs),
                  static_argnums=2)  # fmt: skip
    out, lse = run(queries, cache, True)
    expected_out, expected_lse = _expected(step, cache, queries, **{**BOTTOM_RIGHT_CAUSAL, **kwargs})
    assert out.dtype == dtype and out.shape == expected_out.shape
    assert_out_close(out, expected_out, dtype)
    assert_lse_close(lse, expected_lse, dtype)
    end = int(step.cu_seqlens_q[-1])
    np.testing.assert_array_equal(np.asarray(out[end:], np.float32), 0.0)
    assert np.isneginf(np.asarray(lse[end:])).all()
    assert_out_close(run(queries, cache, False), expected_out, dtype, what="out without lse")


# ------------------------------------------------------------------------------------------------------------------
# CPU: the whole wrapper over the emulated graph


CASES = {
    "gqa_mla": (Step(), {}),
    "window": (Step(), {"local_window_size": (4, 0)}),
    "not_causal": (Step(), {"is_causal": False}),
    "top_left_causal": (Step(), {"diagonal_alignment": "top_left"}),
    # Rows of all the packed tokens, padding included: as many rows as the cache holds keys (24).
    "max_seqlen_q_default": (Step(max_seqlen_q=None, padding_rows=4), {}),
    "mqa_page_16": (Step(n=5, k=1, h=48, hv=48, page_size=16, pages_per_seq=2, num_pages=9), {}),
}


@pytest.fixture
def emulated(monkeypatch):
    """The name `"cudnn"` and automatic dispatch run attnlib's cuDNN wrapper over the emulated graphs of an H200."""
    return install(monkeypatch, emulate_graph)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mixed_step_matches_the_float64_reference(emulated, name):
    step, kwargs = CASES[name]
    cache, queries = _mixed_step(step)
    explanation = _explain(step, cache, queries, **kwargs)
    assert explanation.implementation == "cudnn", explanation
    _check_step(step, cache, queries, "cudnn", kwargs)


def test_rows_that_see_no_key_are_zero(emulated):
    """A sequence queried with more rows than it holds keys: bottom-right aligned, its first rows see no key (out 0,
    lse -inf), as does every row of a sequence without keys."""
    step = Step(queries=(7, 1, 14, 0, 1, 2), max_seqlen_q=14)  # sequence 2 holds 11 keys, sequence 5 none
    cache, queries = _mixed_step(step, seed=1)
    _check_step(step, cache, queries, "cudnn", {})
    out = np.asarray(_attend(step, cache, queries, "cudnn").astype(jnp.float32))
    cu = step.cu_seqlens_q
    np.testing.assert_array_equal(out[cu[2] : cu[2] + 3], 0.0)
    np.testing.assert_array_equal(out[cu[5] : cu[6]], 0.0)


def _loss(step, cache, implementation, d_out, d_lse):
    def loss(q, k_pages, v_pages):
        c = dataclasses.replace(cache, pools=(k_pages, v_pages))
        out, lse = _attend(step, c, q, implementation, return_residual=True)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)

    return loss


def _check_gradients(step: Step, cache, queries, seed: int = 2):
    r = np.random.default_rng(seed)
    d_out = jnp.asarray(r.standard_normal(queries.shape[:2] + (step.hv,)), jnp.float32)
    d_lse = jnp.asarray(r.standard_normal(queries.shape[:2]), jnp.float32)
    grads = jax.jit(jax.grad(_loss(step, cache, None, d_out, d_lse), argnums=(0, 1, 2)))(
        queries, cache.k_pages, cache.v_pages
    )
    expected = _expected_grads(step, cache, queries, d_out, d_lse, **BOTTOM_RIGHT_CAUSAL)
    for name, g, e in zip(("dq", "dk_pages", "dv_pages"), grads, expected, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_grad_close(g, e, jnp.bfloat16, what=name)
    np.testing.assert_array_equal(np.asarray(grads[0][int(step.cu_seqlens_q[-1]) :], np.float32), 0.0)
    return d_out, d_lse


def test_gradient_differentiates_the_xla_fallback(emulated):
    """Automatic dispatch runs the forward on cuDNN and differentiates `xla` on the packed queries (out and lse
    cotangents); cuDNN named alone has no gradient to offer."""
    step = Step()
    cache, queries = _mixed_step(step, seed=3)
    assert _explain(step, cache, queries).implementation == "cudnn"
    d_out, d_lse = _check_gradients(step, cache, queries)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(_loss(step, cache, "cudnn", d_out, d_lse))(queries, cache.k_pages, cache.v_pages)


def test_the_graph_is_the_paged_forward_over_padded_rows(monkeypatch):
    """One paged forward graph: `b` = page-table rows, `t` = max_seqlen_q, the pools' geometry, bottom-right."""
    specs = []
    install(monkeypatch, emulate_graph, entry=lambda spec: specs.append(spec) or entry_for(spec))
    step = Step()
    cache, queries = _mixed_step(step)
    _attend(step, cache, queries, "cudnn", return_residual=True)
    [spec] = specs
    assert (spec.direction, spec.b, spec.t, spec.s, spec.n, spec.k, spec.h, spec.hv) == ("fwd", 6, 11, 24, 6, 2, 40, 24)
    assert spec.pages == (13, 8, 3) and spec.padding and spec.stats and not spec.ragged
    assert (spec.alignment, spec.left_bound, spec.right_bound) == ("bottom_right", None, 0)


# ------------------------------------------------------------------------------------------------------------------
# what automatic dispatch says on a GPU, and what cuDNN declines


@pytest.fixture
def on_a_gpu(monkeypatch):
    """attnlib sees an H200 with cuDNN 9.19 and places the calls of the test on it (nothing runs here)."""
    monkeypatch.setattr(support, "_device", lambda: (h200(), None))
    place_calls_on(monkeypatch, "gpu")


def test_explain_names_cudnn_on_a_gpu(on_a_gpu):
    step = Step()
    cache, queries = _mixed_step(step)
    explanation = _explain(step, cache, queries)
    assert explanation.implementation == "cudnn" and not explanation.declined, explanation
    assert str(explanation) == "attnlib would run: cudnn"


DECLINED = {
    "rows_longer_than_the_cache": (Step(max_seqlen_q=25), {}, {}, "max_seqlen_q=25, pages_per_seq * page_size=24"),
    "rows_of_all_packed_tokens": (Step(max_seqlen_q=None, padding_rows=5), {}, {}, "Pass `max_seqlen_q`"),
    "soft_cap": (Step(), {"logits_soft_cap": 2.5}, {}, "`logits_soft_cap` with a paged key/value cache"),
    "score_mod": (Step(), {"score_mod": lambda s, b, h, i, j: s * 0.5}, {}, "`score_mod`/`mask_mod`"),
    "sinks": (Step(), {"sinks": jnp.zeros((6,), jnp.bfloat16)}, {}, "`sinks` with a paged"),
    "float32": (Step(), {}, {"dtype": jnp.float32}, "dtype float32"),
    "head_major_cache": (Step(), {}, {"layout": "head_major"}, "token_major"),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_a_declined_mixed_step_names_its_reason(on_a_gpu, name):
    step, kwargs, cache_kwargs, reason = DECLINED[name]
    cache, queries = _mixed_step(step, dtype=cache_kwargs.get("dtype", jnp.bfloat16))
    if "layout" in cache_kwargs:
        cache = cache.to_layout(cache_kwargs["layout"])
    explanation = _explain(step, cache, queries, **kwargs)
    assert explanation.implementation not in ("cudnn", None), explanation
    declined = explanation.declined["cudnn"]
    assert reason in declined, declined
    assert declined.endswith("."), declined


def test_a_declined_mixed_step_runs_on_the_next_implementation(emulated):
    """A soft cap (cuDNN's paged graph has no score modifier): automatic dispatch runs it on the next implementation,
    exactly."""
    step = Step()
    cache, queries = _mixed_step(step, seed=4)
    kwargs = {"logits_soft_cap": 2.5, "local_window_size": (4, 0)}
    assert _explain(step, cache, queries, **kwargs).implementation not in ("cudnn", None)
    _check_step(step, cache, queries, None, kwargs)


def _config(**changes) -> AttentionConfig:
    """The static configuration of the default mixed step (validated as a call would be)."""
    from attnlib._src import validation

    step = Step()
    cache, queries = _mixed_step(step)
    config, _ = validation.validate(
        queries, cache.k_pages, cache.v_pages, None, None, scale=None, is_causal=True, query_seq_lengths=None,
        key_value_seq_lengths=cache.lengths, local_window_size=None, return_residual=False,
        diagonal_alignment="bottom_right", q_segment_ids=None, kv_segment_ids=None, max_segments_per_row=None,
        cu_seqlens_q=step.cu_seqlens_q, cu_seqlens_kv=None, max_seqlen_q=11, max_seqlen_kv=None,
        page_table=cache.page_table, logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_key=None,
        deterministic_backward=False,
    )  # fmt: skip
    assert config.ragged_queries and config.num_sequences == 6 and config.max_seqlen_q == 11
    return dataclasses.replace(config, **changes)


def test_policy_of_ragged_paged_queries():
    """Served on Hopper from cuDNN 9.5 (paged graphs); the rows must fit the cache; the paged limits still hold."""
    reason = lambda config, version=91900: support.policy_reason(config, (9, 0), version)  # noqa: E731
    assert reason(_config()) is None
    assert reason(_config(max_seqlen_q=24)) is None  # 24 rows, 24 keys
    assert "max_seqlen_q=25, pages_per_seq * page_size=24" in reason(_config(max_seqlen_q=25))
    assert "9.5 or newer" in reason(_config(), 90400)
    assert "`bias` with a paged" in reason(_config(bias_shape=(6, 26, 24)))
    assert "dropout with a paged" in reason(_config(dropout_rate=0.1))
    assert "boolean `mask` with a paged" in reason(_config(mask_shape=(26, 24)))
    # The same limits hold for dense queries (a soft cap was served and silently dropped before).
    dense = _config(ragged_queries=False, batch_shape=(6,), q_len=4, max_seqlen_q=None)
    assert reason(dense) is None
    assert "`logits_soft_cap` with a paged" in reason(dataclasses.replace(dense, logits_soft_cap=30.0))


# ------------------------------------------------------------------------------------------------------------------
# the real graph call: its CPU handler and its CUDA lowering (no GPU: stand-in built graphs; needs the extension)


needs_extension = pytest.mark.skipif(ffi.unavailable_reason() is not None, reason=f"{ffi.unavailable_reason()}")


@needs_extension
def test_the_ffi_call_on_the_cpu_handler():
    """`tests/cudnn_paged_ragged_ffi_cases.py` in a subprocess: the mixed steps above through attnlib's FFI target,
    run by the native extension's CPU handler."""
    run_pytest_on_simulated_devices("cudnn_paged_ragged_ffi_cases.py", 1)


@needs_extension
def test_a_mixed_step_lowers_to_one_paged_graph_call(monkeypatch):
    from test_lowering import StandInEntries

    cudnn = attnlib.Cudnn(executor=StandInEntries(), device=h200())
    step = Step()
    cache, queries = _mixed_step(step)
    text = (
        jax.jit(lambda q, c: _attend(step, c, q, cudnn, **BOTTOM_RIGHT_CAUSAL))
        .trace(queries, cache)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @attnlib_cudnn_graph" in line]
    assert len(calls) == 1, text
    assert 'label = "sdpa_paged_fwd_nostats_b6_t11_s24_n6_k2_h40_hv24"' in calls[0], calls[0]
    assert "(tensor<6x11x6x40xbf16>" in calls[0] and "-> (tensor<6x11x6x24xbf16>" in calls[0], calls[0]


# ------------------------------------------------------------------------------------------------------------------
# GPU: real cuDNN


GPU_STEP = Step(
    prefix=(37, 100, 0, 61, 250, 0, 5), chunk=(29, 1, 77, 0, 1, 0, 1), n=8, k=2, h=64, hv=64, page_size=16,
    pages_per_seq=20, num_pages=40, padding_rows=5, max_seqlen_q=77,
)  # fmt: skip
FILLS_THE_CACHE = dataclasses.replace(
    GPU_STEP, chunk=(29, 1, 256, 0, 1, 0, 1), pages_per_seq=16, num_pages=50, max_seqlen_q=256
)  # a whole prompt as long as the cache: as many graph rows as keys
GPU_CASES = {
    "gqa": (GPU_STEP, {}),
    "window": (GPU_STEP, {"local_window_size": (40, 0)}),
    "mla_page_32": (dataclasses.replace(GPU_STEP, h=128, hv=64, page_size=32, pages_per_seq=10, num_pages=24), {}),
    "rows_that_see_no_key": (dataclasses.replace(GPU_STEP, queries=(29, 1, 90, 0, 1, 3, 1), max_seqlen_q=90), {}),
    "prompt_fills_the_cache": (FILLS_THE_CACHE, {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_mixed_step_matches_the_float64_reference(name):
    step, kwargs = GPU_CASES[name]
    cache, queries = _mixed_step(step)
    explanation = _explain(step, cache, queries, **kwargs)
    assert explanation.implementation == "cudnn", explanation
    _check_step(step, cache, queries, "cudnn", kwargs)


@pytest.mark.gpu
def test_gpu_gradient_differentiates_the_xla_fallback():
    cache, queries = _mixed_step(GPU_STEP, seed=3)
    _check_gradients(GPU_STEP, cache, queries)
