"""Serving from a `PagedKVCache`: every pool layout, ragged appends, mixed prefill + decode batches (THD queries
against the cache), page recycling, layout conversion and the Pallas TPU paged kernels' declines, against the
float64 reference.

Each expected output is the float64 reference (`tests/reference.py`) run per sequence on that sequence's own tokens
(kept here in NumPy, never read back from the cache), bottom-right causal: so appends, page tables, layouts and the
packing of ragged queries are all checked. JAX's ragged paged-attention kernel cannot run in Pallas interpret mode
(JAX 0.10.2 to 0.12.1: it reshapes a VMEM ref; `PallasTpu(interpret=True)` raises for it); on CPU its calls go to
`helpers.ragged_paged_stand_in` (attnlib's wiring around the kernel), on a TPU (`tpu` marker) to the kernel itself;
`tests/test_pallas_tpu_compile.py` compiles it for a v5e with libtpu.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_out_close, ragged_paged_stand_in, to_f64
from reference import reference_attention

import attnlib
from attnlib._src.backends.pallas_tpu import ragged


INTERPRET = attnlib.PallasTpu(interpret=True)


@dataclasses.dataclass(frozen=True)
class Batch:
    """A cache of `prefix` tokens per sequence, then one ragged step: `chunk[b]` new tokens appended (and queried)
    per sequence: prefill chunks, single-token decodes and idle slots mixed."""

    prefix: tuple[int, ...] = (5, 17, 0, 9)
    chunk: tuple[int, ...] = (3, 1, 6, 0)
    n: int = 6
    k: int = 2
    h: int = 40
    hv: int = 40
    page_size: int = 8
    num_pages: int = 19
    pages_per_seq: int = 4
    padding_rows: int = 3  # packed rows past cu_seqlens_q[-1]


def _tokens(batch: Batch, dtype, seed=0):
    r = np.random.default_rng(seed)
    total = [p + c for p, c in zip(batch.prefix, batch.chunk)]
    rnd = lambda *shape: r.standard_normal(shape).astype(np.float32)  # noqa: E731
    keys = [rnd(t, batch.k, batch.h) for t in total]
    values = [rnd(t, batch.k, batch.hv) for t in total]
    queries = rnd(sum(batch.chunk) + batch.padding_rows, batch.n, batch.h)
    cast = lambda xs: [np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in xs]  # noqa: E731
    return cast(keys), cast(values), cast([queries])[0]


def _cu(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def _filled_cache(batch: Batch, layout: str, dtype, keys, values) -> attnlib.PagedKVCache:
    """The prefix written by a dense append (with lengths), the chunk by a ragged one."""
    B = len(batch.prefix)
    cache = attnlib.PagedKVCache.create(
        B, batch.num_pages, batch.page_size, batch.k, batch.h, batch.hv, dtype=dtype,
        max_pages_per_seq=batch.pages_per_seq, layout=layout,
    )  # fmt: skip
    width = max(batch.prefix)
    dense = lambda xs, d: np.stack([np.pad(x[:p], ((0, width - p), (0, 0), (0, 0))) for x, p in zip(xs, batch.prefix)])  # noqa: E731
    cache = cache.append(
        jnp.asarray(dense(keys, batch.h), dtype), jnp.asarray(dense(values, batch.hv), dtype),
        lengths=jnp.asarray(batch.prefix, jnp.int32),
    )  # fmt: skip
    chunk = lambda xs: np.concatenate([x[p:] for x, p in zip(xs, batch.prefix)])  # noqa: E731
    pad = lambda x: np.pad(x, ((0, 2), (0, 0), (0, 0)))  # noqa: E731  rows past cu[-1]: not written
    return cache.append(
        jnp.asarray(pad(chunk(keys)), dtype), jnp.asarray(pad(chunk(values)), dtype), cu_seqlens=_cu(batch.chunk)
    )


def _expected(batch: Batch, keys, values, queries, **kwargs) -> np.ndarray:
    """Per sequence: its chunk's queries against all its keys, bottom-right causal, float64; padding rows 0."""
    cu = _cu(batch.chunk)
    out = np.zeros(queries.shape[:2] + (batch.hv,))
    for b in range(len(batch.chunk)):
        if batch.chunk[b] == 0:
            continue
        q = queries[None, cu[b] : cu[b + 1]]
        o, _ = reference_attention(
            q, keys[b][None], values[b][None], is_causal=True, diagonal_alignment="bottom_right", **kwargs
        )
        out[cu[b] : cu[b + 1]] = o[0]
    return out


def _mixed_call(cache, queries, batch: Batch, implementation, dtype, **kwargs):
    return cache.attend(jnp.asarray(queries, dtype), cu_seqlens_q=_cu(batch.chunk), implementation=implementation,
                        **kwargs)  # fmt: skip


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(ragged, "ragged_kernel", ragged_paged_stand_in())


MIXED = {
    "gqa": ({}, Batch()),
    "window_soft_cap_scale": (dict(local_window_size=(4, 0), logits_soft_cap=2.5, scale=0.3), Batch()),
    "mqa_head_dim_64": ({}, Batch(n=5, k=1, h=64, hv=64, page_size=16, num_pages=9, pages_per_seq=2)),
}


@pytest.mark.parametrize("layout", ["token_major", "head_major", "combined"])
@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_mixed_batch_on_the_plain_implementations(layout, implementation):
    batch = Batch(hv=24)
    keys, values, queries = _tokens(batch, jnp.float32)
    cache = _filled_cache(batch, layout, jnp.float32, keys, values)
    np.testing.assert_array_equal(cache.lengths, np.add(batch.prefix, batch.chunk))
    impl = attnlib.XlaChunked(block_k=5) if implementation == "xla_chunked" else implementation
    out = _mixed_call(cache, queries, batch, impl, jnp.float32)
    assert_out_close(out, _expected(batch, keys, values, queries), jnp.float32)


@pytest.mark.parametrize("name", sorted(MIXED))
def test_mixed_batch_on_the_ragged_kernel_wiring(stand_in, name):
    kwargs, batch = MIXED[name]
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    assert attnlib.explain(jnp.asarray(queries, jnp.bfloat16), cache, None, cu_seqlens_q=_cu(batch.chunk),
                           is_causal=True, diagonal_alignment="bottom_right",
                           implementation=INTERPRET, **kwargs).implementation == "pallas_tpu"  # fmt: skip
    out = _mixed_call(cache, queries, batch, INTERPRET, jnp.bfloat16, **kwargs)
    assert out.shape == queries.shape[:2] + (batch.hv,)
    assert_out_close(out, _expected(batch, keys, values, queries, **kwargs), jnp.bfloat16)


@pytest.mark.parametrize("implementation", ["xla", "kernel"])
def test_rows_beyond_a_sequences_cached_keys_are_zero(stand_in, implementation):
    """A sequence queried with more rows than it has cached keys: bottom-right aligned, its first rows see no key and
    are 0 (the kernel leaves them as garbage; attnlib zeroes them only on such a step)."""
    batch = Batch()
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    counts = (3, 1, 8, 0)  # sequence 2 holds 6 keys
    q = np.concatenate([queries[:4], np.random.default_rng(2).standard_normal((8, batch.n, batch.h), np.float32)])
    q = np.asarray(jnp.asarray(q, jnp.bfloat16).astype(jnp.float32))
    impl = INTERPRET if implementation == "kernel" else "xla"
    out = cache.attend(jnp.asarray(q, jnp.bfloat16), cu_seqlens_q=_cu(counts), implementation=impl)
    expected = _expected(dataclasses.replace(batch, chunk=counts), keys, values, q)
    np.testing.assert_array_equal(np.asarray(out[4:6], np.float32), 0.0)
    assert_out_close(out, expected, jnp.bfloat16)


def test_dense_chunked_prefill_and_decode_on_the_ragged_kernel_wiring(stand_in):
    batch = Batch(chunk=(3, 3, 3, 3), padding_rows=0)
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    expected = _expected(batch, keys, values, queries).reshape(4, 3, batch.n, batch.hv)
    dense_q = jnp.asarray(queries.reshape(4, 3, batch.n, batch.h), jnp.bfloat16)
    assert_out_close(cache.attend(dense_q, implementation=INTERPRET), expected, jnp.bfloat16)
    assert_out_close(cache.attend(dense_q[:, -1:], implementation=INTERPRET), expected[:, -1:], jnp.bfloat16)


def test_head_major_decode_runs_the_paged_kernel_on_the_pools_as_they_are():
    batch = Batch(chunk=(1, 1, 1, 1), padding_rows=0)
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "head_major", jnp.bfloat16, keys, values)
    assert cache.pools[0].shape == (batch.k, batch.num_pages, batch.page_size, 128)  # padded once, at create
    out = cache.attend(jnp.asarray(queries[:, None], jnp.bfloat16), implementation=INTERPRET)
    assert_out_close(out[:, 0], _expected(batch, keys, values, queries), jnp.bfloat16)


def test_interpret_mode_on_a_combined_cache_names_the_limit_and_the_ways_out():
    """Without the stand-in: JAX's ragged kernel cannot be interpreted, so `PallasTpu(interpret=True)` raises at trace
    time, naming the layout, the limit and what runs instead (before: an AttributeError from inside Pallas)."""
    batch = Batch(chunk=(1, 1, 1, 1), padding_rows=0)
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    q = jnp.asarray(queries[:, None], jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"(?s)combined.*interpret mode.*xla.*to_layout"):
        jax.jit(lambda q, c: c.attend(q, implementation=INTERPRET)).lower(q, cache)
    out = cache.to_layout("head_major").attend(q, implementation=INTERPRET)  # the way out it names
    assert_out_close(out[:, 0], _expected(batch, keys, values, queries), jnp.bfloat16)


def test_gradient_of_a_mixed_batch_differentiates_the_xla_fallback(stand_in):
    batch = Batch()
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal(queries.shape[:2] + (batch.hv,)), jnp.float32)
    loss = lambda impl: lambda q: jnp.sum(_mixed_call(cache, q, batch, impl, jnp.bfloat16).astype(jnp.float32) * d_out)  # noqa: E731
    q = jnp.asarray(queries, jnp.bfloat16)
    assert_grad_close(jax.grad(loss(None))(q), to_f64(jax.grad(loss("xla"))(q)), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(loss(INTERPRET))(q)


def test_release_recycles_pages_for_new_sequences():
    cache = attnlib.PagedKVCache.create(2, 4, 4, 1, 8, dtype=jnp.float32, max_pages_per_seq=3)
    tokens = lambda n: jnp.ones((n, 1, 8), jnp.float32)  # noqa: E731
    cache = cache.append(tokens(12), tokens(12), cu_seqlens=np.array([0, 9, 12], np.int32))  # 3 + 1 pages: full
    with pytest.raises(ValueError, match="num_pages"):
        cache.append(tokens(2), tokens(2), cu_seqlens=np.array([0, 0, 2], np.int32))  # sequence 1 needs a page
    held = set(np.asarray(cache.page_table[0]).tolist())
    cache = cache.release(np.array([True, False]))
    np.testing.assert_array_equal(cache.lengths, [0, 3])
    assert int(cache.num_used_pages) == 1
    cache = cache.append(tokens(10), tokens(10), cu_seqlens=np.array([0, 5, 8], np.int32))
    np.testing.assert_array_equal(cache.lengths, [5, 6])
    assert set(np.asarray(cache.page_table[0, :2]).tolist()) <= held  # the released pages, handed out again
    assert len(set(np.asarray(cache.page_table[:, :2]).ravel().tolist())) == 4  # no page shared


def test_release_under_jit_and_validation():
    cache = attnlib.PagedKVCache.create(2, 4, 4, 1, 8, dtype=jnp.float32)
    cache = jax.jit(lambda c, d: c.release(d))(cache, jnp.array([True, False]))
    with pytest.raises(ValueError, match="`done` must be bool"):
        cache.release(np.array([1, 0]))


@pytest.mark.parametrize("source", ["token_major", "head_major", "combined"])
def test_to_layout_keeps_every_token(source):
    batch = Batch(hv=24)
    keys, values, queries = _tokens(batch, jnp.float32)
    cache = _filled_cache(batch, source, jnp.float32, keys, values)
    expected = _mixed_call(cache, queries, batch, "xla", jnp.float32)
    for target in ("token_major", "head_major", "combined"):
        converted = cache.to_layout(target)
        assert converted.layout == target
        np.testing.assert_array_equal(_mixed_call(converted, queries, batch, "xla", jnp.float32), expected)


def test_the_cache_is_a_pytree_with_its_layout_static():
    cache = attnlib.PagedKVCache.create(2, 4, 16, 2, 64, layout="combined")
    leaves, tree = jax.tree.flatten(cache)
    assert [x.shape for x in leaves[:1]] == [(4, 16, 4, 128)] and len(cache.pools) == 1
    assert jax.tree.unflatten(tree, leaves).layout == "combined"
    with pytest.raises(ValueError, match="`layout` must be one of"):
        attnlib.PagedKVCache.create(2, 4, 16, 2, 64, layout="page_major")


def test_declines_name_the_layout_and_the_limit():
    batch = Batch()
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    q = jnp.asarray(queries, jnp.bfloat16)
    cu = _cu(batch.chunk)
    kwargs = dict(cu_seqlens_q=cu, is_causal=True, diagonal_alignment="bottom_right")
    token_major = _filled_cache(batch, "token_major", jnp.bfloat16, keys, values)
    reason = attnlib.explain(q, token_major, None, implementation=[INTERPRET, "xla"], **kwargs).declined
    assert "combined" in reason["pallas_tpu"] and "to_layout" in reason["pallas_tpu"]
    combined = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    declines = {
        "return_residual": dict(return_residual=True),
        "sinks": dict(sinks=jnp.zeros((batch.n,), jnp.bfloat16)),
        "top_left": dict(diagonal_alignment="top_left"),
        "not_causal": dict(is_causal=False),
    }
    for name, extra in declines.items():
        with pytest.raises(NotImplementedError, match="pallas_tpu"):
            combined.attend(q, implementation=INTERPRET, **{**kwargs, **extra})
    odd_heads = Batch(n=6, k=3)
    keys3, values3, _ = _tokens(odd_heads, jnp.bfloat16)
    cache3 = _filled_cache(odd_heads, "combined", jnp.bfloat16, keys3, values3)
    with pytest.raises(NotImplementedError, match="K=3 key/value heads"):
        cache3.attend(q, implementation=INTERPRET, cu_seqlens_q=cu)


def test_ragged_queries_are_validated():
    batch = Batch()
    keys, values, queries = _tokens(batch, jnp.float32)
    cache = _filled_cache(batch, "token_major", jnp.float32, keys, values)
    q = jnp.asarray(queries)
    with pytest.raises(ValueError, match="one row per sequence"):
        cache.attend(q, cu_seqlens_q=np.array([0, 3, 4], np.int32))
    with pytest.raises(ValueError, match="rank 3"):
        cache.attend(q[None], cu_seqlens_q=_cu(batch.chunk))
    with pytest.raises(NotImplementedError, match="`bias` with ragged queries"):
        cache.attend(q, cu_seqlens_q=_cu(batch.chunk), bias=jnp.zeros((batch.n, q.shape[0], 32)))
    with pytest.raises(ValueError, match="`cu_seqlens` must be int"):
        cache.append(jnp.asarray(keys[0]), jnp.asarray(values[0]), cu_seqlens=np.array([0, 1], np.int32))


@pytest.mark.tpu
@pytest.mark.parametrize("name", sorted(MIXED))
def test_tpu_mixed_batch_on_the_ragged_kernel(name):
    kwargs, batch = MIXED[name]
    batch = dataclasses.replace(batch, page_size=16, num_pages=2 * batch.num_pages)
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    out = _mixed_call(cache, queries, batch, "pallas_tpu", jnp.bfloat16, **kwargs)
    assert_out_close(out, _expected(batch, keys, values, queries, **kwargs), jnp.bfloat16)


@pytest.mark.tpu
def test_tpu_default_layout_is_combined_and_decodes_on_the_kernel():
    batch = Batch(chunk=(1, 1, 1, 1), padding_rows=0, page_size=16, num_pages=12, h=64, hv=64)
    cache = attnlib.PagedKVCache.create(4, 12, 16, 2, 64)
    assert cache.layout == "combined"
    keys, values, queries = _tokens(batch, jnp.bfloat16)
    cache = _filled_cache(batch, "combined", jnp.bfloat16, keys, values)
    out = cache.attend(jnp.asarray(queries[:, None], jnp.bfloat16), implementation="pallas_tpu")
    assert_out_close(out[:, 0], _expected(batch, keys, values, queries), jnp.bfloat16)
