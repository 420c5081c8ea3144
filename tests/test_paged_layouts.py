"""Every documented paged pattern under every pool layout, forced on CPU: a layout is a speed choice and never changes
what a program means (`../shared/API.md`, "Portability"), so CI sees what a TPU (default `"combined"`) would run.

Patterns: the API.md example (bare token-major arrays `cache.k_pages` / `cache.v_pages`), `append` + `attend`, a
jitted decode loop, `T > 1` queries (chunked prefill), and THD (`append(..., cu_seqlens=)` + `attend(...,
cu_seqlens_q=)`), each against the float64 reference over each sequence's dense history.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_out_close, normal, rng
from reference import reference_attention

import attnlib
from attnlib._src import kv_layouts


B, K, N, H, HV, PAGE, PAGES, MAX_PAGES = 3, 2, 6, 40, 24, 4, 17, 6
PROMPTS = np.array([7, 2, 0])  # the third sequence has no prompt: its first query sees only its own token
CAUSAL = dict(is_causal=True, diagonal_alignment="bottom_right")


def _history(seed: int, length: int, dtype=jnp.float32):
    r = rng(seed)
    return normal(r, (B, length, K, H), dtype), normal(r, (B, length, K, HV), dtype)


def _expected(q_b, k_all, v_all, b: int, n: int):
    """float64 attention of sequence `b`'s queries `[1, T, N, H]` over its first `n` keys, bottom-right causal."""
    out, _ = reference_attention(q_b, k_all[b : b + 1, :n], v_all[b : b + 1, :n], **CAUSAL)
    return out


def _prefilled(layout: str | None, k_all, v_all):
    cache = attnlib.PagedKVCache.create(B, PAGES, PAGE, K, H, value_head_dim=HV, dtype=k_all.dtype,
                                        max_pages_per_seq=MAX_PAGES, layout=layout)  # fmt: skip
    return cache.append(k_all[:, :7], v_all[:, :7], lengths=jnp.asarray(PROMPTS))


def _bare(q, cache):
    """The API.md program: token-major pools as bare arrays."""
    return attnlib.attention(q, cache.k_pages, cache.v_pages, page_table=cache.page_table,
                             key_value_seq_lengths=cache.lengths, **CAUSAL)  # fmt: skip


@pytest.mark.parametrize("layout", kv_layouts.LAYOUTS)
def test_the_api_example_runs_unchanged_on_every_layout(layout):
    k_all, v_all = _history(0, 10)
    cache = _prefilled(layout, k_all, v_all)
    assert cache.k_pages.shape == (PAGES, PAGE, K, H) and cache.v_pages.shape == (PAGES, PAGE, K, HV)
    q = normal(rng(1), (B, 3, N, H))
    cache = cache.append(k_all[:, 7:10], v_all[:, 7:10])  # the queries' own tokens first: each sees itself
    out = jax.jit(_bare)(q, cache)
    for b in range(B):
        assert_out_close(out[b : b + 1], _expected(q[b : b + 1], *_tokens_of(k_all, v_all, b), b, int(PROMPTS[b]) + 3),
                         jnp.float32, what=f"{layout} sequence {b}")  # fmt: skip


def _tokens_of(k_all, v_all, b: int):
    """Sequence `b`'s dense history as the cache holds it: its prompt, then the tokens appended after it."""
    order = np.concatenate([np.arange(PROMPTS[b]), np.arange(7, k_all.shape[1])])
    k_b = jnp.zeros_like(k_all).at[b, : len(order)].set(k_all[b, order])
    v_b = jnp.zeros_like(v_all).at[b, : len(order)].set(v_all[b, order])
    return k_b, v_b


@pytest.mark.parametrize("layout", kv_layouts.LAYOUTS)
def test_a_jitted_decode_loop_gives_the_same_tokens_on_every_layout(layout):
    steps = 3
    k_all, v_all = _history(2, 7 + steps)
    cache = _prefilled(layout, k_all, v_all)
    q_all = normal(rng(3), (B, steps, N, H))

    @jax.jit
    def step(cache, k_tok, v_tok, q):
        cache = cache.append(k_tok, v_tok)
        return cache, cache.attend(q), _bare(q, cache)

    for i in range(steps):
        cache, out, out_bare = step(cache, k_all[:, 7 + i : 8 + i], v_all[:, 7 + i : 8 + i], q_all[:, i : i + 1])
        np.testing.assert_allclose(out_bare, out, rtol=1e-6, atol=1e-6)  # the bare form means the same
        for b in range(B):
            n = int(PROMPTS[b]) + i + 1
            history = _tokens_of(k_all[:, : 8 + i], v_all[:, : 8 + i], b)
            expected = _expected(q_all[b : b + 1, i : i + 1], *history, b, n)
            assert_out_close(out[b : b + 1], expected, jnp.float32, what=f"{layout} step {i} sequence {b}")
    np.testing.assert_array_equal(cache.lengths, PROMPTS + steps)


@pytest.mark.parametrize("layout", kv_layouts.LAYOUTS)
def test_chunked_prefill_with_several_queries_per_sequence(layout):
    k_all, v_all = _history(4, 12)
    cache = _prefilled(layout, k_all, v_all).append(k_all[:, 7:12], v_all[:, 7:12])
    q = normal(rng(5), (B, 5, N, H))
    out = cache.attend(q)
    for b in range(B):
        expected = _expected(q[b : b + 1], *_tokens_of(k_all, v_all, b), b, int(PROMPTS[b]) + 5)
        assert_out_close(out[b : b + 1], expected, jnp.float32, what=f"{layout} sequence {b}")


@pytest.mark.parametrize("layout", kv_layouts.LAYOUTS)
def test_a_ragged_step_of_prefill_chunks_and_decodes(layout):
    k_all, v_all = _history(6, 10)
    cache = _prefilled(layout, k_all, v_all)
    chunk = np.array([1, 3, 2])  # a decode, a prefill chunk, a first chunk
    cu = np.concatenate([[0], np.cumsum(chunk)]).astype(np.int32)
    rows = [np.arange(7, 7 + c) for c in chunk]
    k_new = jnp.concatenate([k_all[b, r] for b, r in enumerate(rows)] + [jnp.zeros((2, K, H))])  # 2 padding rows
    v_new = jnp.concatenate([v_all[b, r] for b, r in enumerate(rows)] + [jnp.zeros((2, K, HV))])
    cache = cache.append(k_new, v_new, cu_seqlens=jnp.asarray(cu))
    q = normal(rng(7), (int(cu[-1]) + 2, N, H))
    out = jax.jit(lambda q, c: c.attend(q, cu_seqlens_q=jnp.asarray(cu), max_seqlen_q=3))(q, cache)
    for b in range(B):
        k_b, v_b = _tokens_of(k_all[:, : 7 + chunk[b]], v_all[:, : 7 + chunk[b]], b)
        expected = _expected(q[None, cu[b] : cu[b + 1]], k_b, v_b, b, int(PROMPTS[b] + chunk[b]))
        assert_out_close(out[None, cu[b] : cu[b + 1]], expected, jnp.float32, what=f"{layout} sequence {b}")
    np.testing.assert_array_equal(out[cu[-1] :], 0.0)  # padding rows


def test_a_cache_of_another_layout_names_the_fast_form_once(caplog):
    k_all, v_all = _history(8, 7)
    cache = _prefilled("head_major", k_all, v_all)
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        cache.k_pages, cache.v_pages, cache.k_pages  # noqa: B018
    messages = [r.getMessage() for r in caplog.records if "token-major copies" in r.getMessage()]
    assert len(messages) <= 1  # once per layout and process: an earlier test may have logged it already
    token_major = cache.to_layout("token_major")
    np.testing.assert_array_equal(cache.k_pages, token_major.pools[0])
    np.testing.assert_array_equal(cache.v_pages, token_major.pools[1])


def test_the_log_names_the_fast_form(caplog, monkeypatch):
    from attnlib._src import logs

    monkeypatch.setattr(logs, "_logged", set())
    cache = _prefilled("combined", *_history(9, 7))
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        cache.v_pages  # noqa: B018
        cache.k_pages  # noqa: B018
    (message,) = [r.getMessage() for r in caplog.records if "token-major copies" in r.getMessage()]
    assert "'combined'" in message and "cache.attend(q" in message and "attnlib.attention(q, cache, None" in message


def test_the_tpu_default_layout_runs_the_api_example(monkeypatch):
    """`create` with no layout on a TPU picks `"combined"`: the API.md program must run there as on a CPU."""
    from attnlib._src.backends import placement

    monkeypatch.setattr(placement, "placement_platform", lambda: "tpu")
    k_all, v_all = _history(10, 8)
    cache = attnlib.PagedKVCache.create(B, PAGES, PAGE, K, H, value_head_dim=HV, dtype=jnp.float32,
                                        max_pages_per_seq=MAX_PAGES)  # fmt: skip
    assert cache.layout == "combined"
    monkeypatch.undo()  # the call itself runs on this CPU
    cache = cache.append(k_all[:, :7], v_all[:, :7], lengths=jnp.asarray(PROMPTS)).append(k_all[:, 7:], v_all[:, 7:])
    q = normal(rng(11), (B, 1, N, H))
    out = _bare(q, cache)
    np.testing.assert_allclose(out, cache.attend(q), rtol=1e-6, atol=1e-6)
    for b in range(B):
        expected = _expected(q[b : b + 1], *_tokens_of(k_all, v_all, b), b, int(PROMPTS[b]) + 1)
        assert_out_close(out[b : b + 1], expected, jnp.float32, what=f"sequence {b}")


@pytest.mark.tpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("layout", (None,) + kv_layouts.LAYOUTS)
def test_tpu_every_pattern_on_every_layout(layout, dtype):
    """On the TPU, automatic dispatch: the bare API.md form, `attend` with T = 1 and T > 1, and a ragged step, on the
    device's default layout (`None`: `"combined"`) and each forced one. float32 at the TPU's default matrix-product
    precision (one bfloat16 pass, JAX's convention there): bfloat16's tolerance."""
    k_all, v_all = _history(12, 10, dtype)
    cache = _prefilled(layout, k_all, v_all).append(k_all[:, 7:10], v_all[:, 7:10])
    assert cache.layout == (layout or "combined")
    for T in (1, 3):
        q = normal(rng(13 + T), (B, T, N, H), dtype)
        for out in (jax.jit(_bare)(q, cache), jax.jit(lambda q, c: c.attend(q))(q, cache)):
            for b in range(B):
                expected = _expected(q[b : b + 1], *_tokens_of(k_all, v_all, b), b, int(PROMPTS[b]) + 3)
                assert_out_close(out[b : b + 1], expected, jnp.bfloat16, what=f"{layout} T={T} sequence {b}")
    cu = np.array([0, 1, 4, 6], np.int32)
    q = normal(rng(20), (8, N, H), dtype)
    out = jax.jit(lambda q, c: c.attend(q, cu_seqlens_q=jnp.asarray(cu), max_seqlen_q=3))(q, cache)
    for b in range(B):
        expected = _expected(q[None, cu[b] : cu[b + 1]], *_tokens_of(k_all, v_all, b), b, int(PROMPTS[b]) + 3)
        assert_out_close(out[None, cu[b] : cu[b + 1]], expected, jnp.bfloat16, what=f"{layout} ragged sequence {b}")
