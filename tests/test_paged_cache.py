"""`attnlib.PagedKVCache`: page allocation, appends, and decoding that matches dense causal attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib


B, K, N, H, HV, PAGE = 3, 2, 6, 8, 5, 4


def _dense_causal(q, k, v):
    """Dense bottom-right causal attention over one sequence's whole history (the `xla` reference)."""
    return attnlib.attention(q, k, v, is_causal=True, diagonal_alignment="bottom_right", implementation="xla")


def _paged(cache, q, implementation):
    return attnlib.attention(
        q, cache.k_pages, cache.v_pages, page_table=cache.page_table, key_value_seq_lengths=cache.lengths,
        is_causal=True, diagonal_alignment="bottom_right", implementation=implementation,
    )  # fmt: skip


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_token_by_token_decoding_matches_dense(implementation):
    keys = jax.random.split(jax.random.key(0), 4)
    prompt_lengths = np.array([7, 2, 0])
    steps = 4
    k_all = jax.random.normal(keys[0], (B, 7 + steps, K, H))
    v_all = jax.random.normal(keys[1], (B, 7 + steps, K, HV))
    q_all = jax.random.normal(keys[2], (B, steps, N, H))
    cache = attnlib.PagedKVCache.create(B, 16, PAGE, K, H, value_head_dim=HV, dtype=jnp.float32, max_pages_per_seq=6)
    cache = cache.append(k_all[:, :7], v_all[:, :7], lengths=jnp.asarray(prompt_lengths))
    np.testing.assert_array_equal(cache.lengths, prompt_lengths)

    append = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
    # compiled once each: the paged call has the same shapes at every step, the dense one once per history length
    paged = jax.jit(_paged, static_argnums=2)
    dense_causal = jax.jit(_dense_causal)
    for step in range(steps):
        # Each sequence's next token is the one after its own prompt.
        index = jnp.asarray(prompt_lengths + step)[:, None, None, None]
        k_tok = jnp.take_along_axis(k_all, index, axis=1)
        v_tok = jnp.take_along_axis(v_all, index, axis=1)
        cache = append(cache, k_tok, v_tok)
        q = q_all[:, step : step + 1]
        out = paged(cache, q, implementation)
        for b in range(B):
            n = int(prompt_lengths[b]) + step + 1
            expected = dense_causal(q[b : b + 1], k_all[b : b + 1, :n], v_all[b : b + 1, :n])
            np.testing.assert_allclose(out[b : b + 1], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, prompt_lengths + steps)


def test_chunked_prefill_matches_dense():
    keys = jax.random.split(jax.random.key(1), 3)
    k = jax.random.normal(keys[0], (B, 11, K, H))
    v = jax.random.normal(keys[1], (B, 11, K, HV))
    q = jax.random.normal(keys[2], (B, 5, N, H))
    cache = attnlib.PagedKVCache.create(B, 12, PAGE, K, H, value_head_dim=HV, dtype=jnp.float32)
    cache = cache.append(k[:, :6], v[:, :6])
    cache = cache.append(k[:, 6:], v[:, 6:])  # a 5-token chunk after a 6-token prefix
    out = jax.jit(_paged, static_argnums=2)(cache, q, "xla")
    expected = jax.jit(_dense_causal)(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_pages_come_from_the_free_list_interleaved():
    cache = attnlib.PagedKVCache.create(2, 8, 2, 1, 8, dtype=jnp.float32)
    one = jnp.ones((2, 1, 1, 8))
    for _ in range(4):
        cache = cache.append(one, one)
    # Both sequences grow together, so their pages interleave: unordered, non-contiguous page tables.
    np.testing.assert_array_equal(cache.page_table[:, :2], [[0, 2], [1, 3]])
    assert int(cache.num_used_pages) == 4
    table = np.asarray(cache.page_table[:, :2]).ravel()
    assert len(set(table.tolist())) == 4


def test_out_of_pages_raises_naming_num_pages():
    cache = attnlib.PagedKVCache.create(1, 2, 4, 1, 8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="`num_pages`=2"):
        cache.append(jnp.zeros((1, 9, 1, 8)), jnp.zeros((1, 9, 1, 8)))


def test_out_of_pages_under_jit_leaves_the_sequence_unchanged():
    cache = attnlib.PagedKVCache.create(2, 3, 4, 1, 8, dtype=jnp.float32)
    new = jnp.ones((2, 8, 1, 8))
    cache = jax.jit(lambda c: c.append(new, new, lengths=jnp.array([8, 8])))(cache)
    # The first sequence takes 2 pages; the second would need 2 more but only 1 is left: it stays empty.
    np.testing.assert_array_equal(cache.lengths, [8, 0])
    assert int(cache.num_used_pages) == 2
    assert float(jnp.sum(cache.k_pages[2])) == 0.0


def test_append_validates_shapes():
    cache = attnlib.PagedKVCache.create(2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="`k_new`"):
        cache.append(jnp.zeros((3, 1, 1, 8)), jnp.zeros((3, 1, 1, 8)))
    with pytest.raises(ValueError, match="`page_size`"):
        attnlib.PagedKVCache.create(2, 4, 0, 1, 8)


def test_cache_is_a_pytree():
    cache = attnlib.PagedKVCache.create(2, 4, 4, 1, 8)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 6
    assert jax.tree_util.tree_unflatten(treedef, leaves).page_size == 4


def test_the_cache_itself_as_key():
    """`attention(q, cache, None)` is the long form with the cache's pools, page table and lengths."""
    r = np.random.default_rng(11)
    cache = attnlib.PagedKVCache.create(2, 8, 4, 2, 16, dtype=jnp.float32)
    new = lambda: jnp.asarray(r.standard_normal((2, 6, 2, 16)), jnp.float32)  # noqa: E731
    cache = cache.append(new(), new(), lengths=jnp.asarray([6, 3], jnp.int32))
    q = jnp.asarray(r.standard_normal((2, 1, 4, 16)), jnp.float32)
    kw = dict(is_causal=True, diagonal_alignment="bottom_right")
    long_form = attnlib.attention(
        q, cache.k_pages, cache.v_pages, page_table=cache.page_table, key_value_seq_lengths=cache.lengths, **kw
    )
    np.testing.assert_array_equal(np.asarray(attnlib.attention(q, cache, None, **kw)), np.asarray(long_form))
    np.testing.assert_array_equal(np.asarray(attnlib.attention(q, cache, cache, **kw)), np.asarray(long_form))
    jitted = jax.jit(lambda q, c: attnlib.attention(q, c, None, **kw))(q, cache)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(long_form), rtol=1e-6, atol=1e-6)
    assert attnlib.explain(q, cache, None).implementation is not None
    with pytest.raises(TypeError, match=r"pass value=None \(the cache holds both pools\)"):
        attnlib.attention(q, cache, q)
    with pytest.raises(ValueError, match="`page_table` comes from the cache"):
        attnlib.attention(q, cache, None, page_table=cache.page_table)
    with pytest.raises(TypeError, match="`value` is required"):
        attnlib.attention(q, q, None)
