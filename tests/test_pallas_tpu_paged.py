"""`attnlib.PallasTpu` decoding from a paged KV cache (JAX's Pallas paged-attention kernel) against the float64
reference, its gradient through the `xla` fallback and its declines.

On CPU the kernel runs in Pallas TPU interpret mode (`PallasTpu(interpret=True)`); the `tpu`-marked tests run the
same cases on a real TPU. Sizes are odd and distinct (N != K, H no multiple of 128, lengths ending mid-page, a
sequence of length 0, page tables in shuffled order). The kernel rounds keys and values to bfloat16, so the cases
are bfloat16 (float32 declines).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_grad_close,
    assert_out_close,
    normal,
    on_a_simulated_tpu,
    paged_decode_stand_in,
    rng,
    to_f64,
)  # fmt: skip
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.backends.pallas_tpu import paged


INTERPRET = attnlib.PallasTpu(interpret=True)
DECODE = (("is_causal", True), ("diagonal_alignment", "bottom_right"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode: `lengths` per sequence, pool and page geometry, heads, and extra keyword arguments."""

    lengths: tuple[int, ...] = (5, 32, 0, 17)
    n: int = 6
    k: int = 2
    h: int = 40
    num_pages: int = 23
    page_size: int = 8
    pages_per_seq: int = 4
    kwargs: tuple = DECODE


CASES = {
    "gqa_causal_bottom_right": Case(),
    "mha_unmasked": Case(n=3, k=3, kwargs=()),
    "mqa_soft_cap_scale": Case(n=5, k=1, h=24, kwargs=DECODE + (("logits_soft_cap", 2.5), ("scale", 0.37))),
    "query_padding": Case(kwargs=DECODE + (("query_seq_lengths", np.asarray([1, 0, 1, 1], np.int32)),)),
    # S = 37 * 16 = 592 > 512: automatic dispatch on a TPU picks pallas_tpu; 37 pages: one page per kernel step.
    "long_pages": Case(lengths=(590, 77), page_size=16, pages_per_seq=37, num_pages=79, h=64),
}


def _on_tpu(case: Case) -> Case:
    """`case` with pages of at least 16 tokens (what a TPU serves)."""
    return dataclasses.replace(case, page_size=max(case.page_size, paged.TPU_PAGE_SIZE_MULTIPLE))


def _arrays(case: Case, dtype=jnp.bfloat16):
    """`(q [B, 1, N, H], k_pages, v_pages, page_table, lengths)`: each sequence's pages drawn without replacement
    from a shuffled pool."""
    r = rng(17)
    B = len(case.lengths)
    q = normal(r, (B, 1, case.n, case.h), dtype)
    k = normal(r, (case.num_pages, case.page_size, case.k, case.h), dtype)
    v = normal(r, (case.num_pages, case.page_size, case.k, case.h), dtype)
    table = r.permutation(case.num_pages)[: B * case.pages_per_seq].reshape(B, case.pages_per_seq)
    return q, k, v, jnp.asarray(table, jnp.int32), jnp.asarray(case.lengths, jnp.int32)


def _kwargs(case: Case, table, lengths):
    kw = dict(case.kwargs, page_table=table, key_value_seq_lengths=lengths)
    return {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


def _reference_kwargs(kw):
    return {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in kw.items()}


def _check_forward(case: Case, implementation):
    q, k, v, table, lengths = _arrays(case)
    kw = _kwargs(case, table, lengths)
    out = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=implementation, **kw))(q, k, v)
    ref_out, ref_lse = reference_attention(*(to_f64(x) for x in (q, k, v)), **_reference_kwargs(kw))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_out_close(out, ref_out, jnp.bfloat16)
    empty = np.isinf(ref_lse)
    assert (np.asarray(to_f64(out))[empty] == 0).all(), "a row that sees nothing has a non-zero output"
    return empty


@pytest.mark.parametrize("name", list(CASES))
def test_interpret_decode_matches_reference(name):
    _check_forward(CASES[name], INTERPRET)


def test_the_empty_rows_are_exercised():
    """The cases meant to have rows that see nothing do (in the reference), so that
    `test_interpret_decode_matches_reference` checks the kernel's output there."""
    for name, count in (("gqa_causal_bottom_right", 6), ("query_padding", 12)):  # the sequence of length 0, ...
        q, k, v, table, lengths = _arrays(CASES[name])  # ... and a padding query
        kw = _reference_kwargs(_kwargs(CASES[name], table, lengths))
        _, ref_lse = reference_attention(*(to_f64(x) for x in (q, k, v)), **kw)
        assert np.isinf(ref_lse).sum() == count, name


def test_explain_names_pallas_tpu_for_a_decode():
    q, k, v, table, lengths = _arrays(CASES["gqa_causal_bottom_right"])
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **_kwargs(CASES["gqa_causal_bottom_right"],
                                                                                  table, lengths))
    assert explanation.implementation == "pallas_tpu"


def test_page_table_entries_past_the_length_are_clamped():
    """Entries past a sequence's length are never read for values: out-of-pool ones (-1, P) change nothing (under
    `jit`: concrete tables are validated)."""
    case = CASES["gqa_causal_bottom_right"]
    q, k, v, table, lengths = _arrays(case)
    pages_used = -(-np.asarray(lengths) // case.page_size)
    past = np.arange(case.pages_per_seq)[None, :] >= pages_used[:, None]
    wild = jnp.asarray(np.where(past, np.where(np.arange(case.pages_per_seq) % 2, -1, case.num_pages), table))
    run = jax.jit(lambda t: attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case, t, lengths)))
    np.testing.assert_array_equal(np.asarray(run(wild), np.float32), np.asarray(run(table), np.float32))


def test_decode_from_a_paged_kv_cache():
    """`PagedKVCache.append` then a decode step, as the API page shows it."""
    r = rng(19)
    B, N, K, H = 3, 4, 2, 24
    cache = attnlib.PagedKVCache.create(B, 11, 8, K, H, dtype=jnp.bfloat16, max_pages_per_seq=3)
    prompt = [normal(r, (B, 13, K, H), jnp.bfloat16) for _ in range(2)]
    cache = cache.append(*prompt, lengths=jnp.asarray([13, 4, 9], jnp.int32))
    q = normal(r, (B, 1, N, H), jnp.bfloat16)
    kw = dict(page_table=cache.page_table, key_value_seq_lengths=cache.lengths, is_causal=True,
              diagonal_alignment="bottom_right")  # fmt: skip
    # jitted: one compile each, not one per operation
    out = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=INTERPRET, **kw))(
        q, cache.k_pages, cache.v_pages
    )
    ref = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation="xla", **kw))(
        *(x.astype(jnp.float32) for x in (q, cache.k_pages, cache.v_pages))
    )
    assert_out_close(out, np.asarray(ref, np.float64), jnp.bfloat16)


def test_gradient_differentiates_the_xla_fallback():
    case = CASES["mqa_soft_cap_scale"]
    q, k, v, table, lengths = _arrays(case)
    kw = _kwargs(case, table, lengths)
    d_out = normal(rng(23), q.shape, jnp.float32)
    loss = lambda q, k, v: jnp.sum(
        attnlib.attention(q, k, v, implementation=(INTERPRET, "xla"), **kw).astype(jnp.float32) * d_out
    )
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    args = [to_f64(x) for x in (q, k, v)]
    ref = reference_attention_vjp(*args, d_out=to_f64(d_out), **_reference_kwargs(kw))
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_grad_close(g, ref[name], jnp.bfloat16, what=f"d{name}")


def test_gradient_named_alone_raises():
    case = CASES["gqa_causal_bottom_right"]
    q, k, v, table, lengths = _arrays(case)
    kw = _kwargs(case, table, lengths)
    loss = lambda q: jnp.sum(attnlib.attention(q, k, v, implementation=INTERPRET, **kw).astype(jnp.float32))
    with pytest.raises(NotImplementedError, match="pallas_tpu: gradients of paged key/value attention"):
        jax.jit(jax.grad(loss))(q)  # jitted: traced, not run op by op up to the error


DECLINES = {
    "chunked_prefill": (dict(t=3), "T=3 queries per sequence"),
    "float32": (dict(dtype=jnp.float32), "kernel rounds keys and values to bfloat16"),
    "lse": (dict(return_residual=True), "`return_residual=True`"),
    "sinks": (dict(sinks=jnp.zeros((6,), jnp.float32)), "`sinks` with a paged KV cache"),
    "array_scale": (dict(scale=jnp.asarray(0.3, jnp.float32)), "an array `scale`"),
    "window": (dict(local_window_size=(7, 0)), "local_window_size=(7, 0)"),
    "causal_top_left": (dict(diagonal_alignment="top_left"), "diagonal_alignment='top_left'"),
    "bias": (dict(bias=jnp.zeros((4, 6, 1, 32), jnp.bfloat16)), "`bias`"),
}


@pytest.mark.parametrize("name", list(DECLINES))
def test_declines_with_a_reason(name):
    extra, match = DECLINES[name]
    extra = dict(extra)
    t, dtype = extra.pop("t", 1), extra.pop("dtype", jnp.bfloat16)
    case = CASES["gqa_causal_bottom_right"]
    q, k, v, table, lengths = _arrays(case, dtype)
    q = jnp.tile(q, (1, t, 1, 1))
    kw = _kwargs(case, table, lengths) | extra
    explanation = attnlib.explain(q, k, v, implementation=INTERPRET, **kw)
    assert explanation.implementation is None
    assert match in explanation.declined["pallas_tpu"]
    with pytest.raises(NotImplementedError, match="pallas_tpu: "):
        attnlib.attention(q, k, v, implementation=INTERPRET, **kw)
    result = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=(INTERPRET, "xla"), **kw))(q, k, v)
    out = result[0] if isinstance(result, tuple) else result
    assert out.shape == q.shape


def test_pages_per_block():
    assert paged.pages_per_block(16, 64) == 32
    assert paged.pages_per_block(16, 13) == 13
    assert paged.pages_per_block(8, 100) == 50
    assert paged.pages_per_block(1024, 4) == 1


def test_automatic_dispatch_on_a_tpu_picks_it_for_long_caches(monkeypatch):
    on_a_simulated_tpu(monkeypatch)
    for case, automatic in ((CASES["long_pages"], "pallas_tpu"), (CASES["gqa_causal_bottom_right"], "xla_chunked")):
        q, k, v, table, lengths = _arrays(case)
        assert attnlib.explain(q, k, v, **_kwargs(case, table, lengths)).implementation == automatic


# ------------------------------------------------------------------------------------------------------------------
# the partitionable call around the kernel (off interpret mode: a plain-JAX stand-in for the kernel)


def test_stand_in_matches_the_kernel():
    """The stand-in that the partitioning tests put in the kernel's place computes what the kernel computes."""
    r = rng(29)
    q = normal(r, (3, 6, 128), jnp.bfloat16)
    k_pool, v_pool = (normal(r, (2, 9, 8, 128), jnp.bfloat16) for _ in range(2))
    lengths = jnp.asarray([5, 24, 17], jnp.int32)
    table = jnp.asarray(rng(31).permutation(9)[:9].reshape(3, 3), jnp.int32)
    kw = dict(soft_cap=2.0, pages_per_block=3)
    kernel = paged.decode_kernel(q, k_pool, v_pool, lengths, table, interpret=True, **kw)
    stand_in = paged_decode_stand_in()(q, k_pool, v_pool, lengths, table, interpret=False, **kw)
    assert_out_close(kernel, np.asarray(stand_in, np.float64), jnp.bfloat16)


@pytest.fixture
def tpu_with_stand_in(monkeypatch):
    """A "TPU" whose paged kernel is the stand-in: `PallasTpu()` then runs the partitionable call."""
    on_a_simulated_tpu(monkeypatch)
    monkeypatch.setattr(paged, "decode_kernel", paged_decode_stand_in())


@pytest.mark.parametrize("pool_mapped", [False, True], ids=["shared_pool", "pool_per_example"])
def test_vmap_of_a_decode(tpu_with_stand_in, pool_mapped):
    """`vmap` over decodes: with a shared pool the mapped axis folds into the batch (one call), with a pool per
    example one call runs per example; both equal the calls one by one."""
    del tpu_with_stand_in
    case = _on_tpu(CASES["gqa_causal_bottom_right"])
    examples = [_arrays(dataclasses.replace(case, lengths=lengths)) for lengths in ((5, 32, 0, 17), (9, 1, 30, 8))]
    q, k, v, table, lengths = (jnp.stack(xs) for xs in zip(*examples, strict=True))
    if not pool_mapped:
        k, v = k[0], v[0]

    def one(q, k, v, table, lengths):
        return attnlib.attention(q, k, v, implementation=attnlib.PallasTpu(), **_kwargs(case, table, lengths))

    mapped = jax.jit(jax.vmap(one, in_axes=(0, 0 if pool_mapped else None, 0 if pool_mapped else None, 0, 0)))
    out = mapped(q, k, v, table, lengths)
    for i in range(2):
        ki, vi = (k[i], v[i]) if pool_mapped else (k, v)
        expected = one(q[i], ki, vi, table[i], lengths[i])
        np.testing.assert_array_equal(np.asarray(out[i], np.float32), np.asarray(expected, np.float32))


# ------------------------------------------------------------------------------------------------------------------
# on a TPU


def test_on_a_tpu_page_sizes_are_multiples_of_16(monkeypatch):
    """On a TPU the kernel gets the page sizes JAX tests it with (multiples of 16); interpret mode takes any."""
    on_a_simulated_tpu(monkeypatch)
    case = CASES["gqa_causal_bottom_right"]  # pages of 8 tokens
    q, k, v, table, lengths = _arrays(case)
    kw = _kwargs(case, table, lengths)
    explanation = attnlib.explain(q, k, v, implementation=(attnlib.PallasTpu(), "xla"), **kw)
    assert explanation.implementation == "xla"
    assert "pages of 8 tokens are not served on a TPU" in explanation.declined["pallas_tpu"]
    assert attnlib.explain(q, k, v, implementation=INTERPRET, **kw).implementation == "pallas_tpu"


@pytest.mark.tpu
@pytest.mark.parametrize("name", list(CASES))
def test_tpu_decode_matches_reference(name):
    _check_forward(_on_tpu(CASES[name]), attnlib.PallasTpu())


@pytest.mark.tpu
def test_tpu_automatic_dispatch_decodes_long_caches_on_pallas_tpu():
    case = CASES["long_pages"]
    q, k, v, table, lengths = _arrays(case)
    assert attnlib.explain(q, k, v, **_kwargs(case, table, lengths)).implementation == "pallas_tpu"
    _check_forward(case, None)


def test_no_nan_reaches_the_output_under_debug_nans():
    """A sequence of length 0 and a padding query give exact zeros, and nothing trips `jax_debug_nans` (the kernel
    is handed at least one key per sequence, so it writes every output row)."""
    case = CASES["query_padding"]
    q, k, v, table, lengths = _arrays(case)
    with jax.debug_nans(True):
        out = attnlib.attention(q, k, v, implementation=INTERPRET, **_kwargs(case, table, lengths))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert (np.asarray(out[2], np.float32) == 0).all() and (np.asarray(out[1], np.float32) == 0).all()


def test_kernel_on_attnlib_operands_has_no_data_race():
    """JAX's paged-attention kernel had data races (fixed upstream in May 2025, found with TPU interpret mode's race
    detector). The same detector, on the operands attnlib builds (head-major padded pools, a clamped table, at least
    one key per sequence), finds none; every out-of-bounds read would raise (interpret mode's default)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
    from jax.experimental.pallas import tpu as pltpu

    case = _on_tpu(CASES["gqa_causal_bottom_right"])
    q, k, v, table, lengths = _arrays(case)
    kw = _kwargs(case, table, lengths)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
        # `interpret=False`: the kernel is traced under this context's parameters, not attnlib's default ones.
        run = attnlib.PallasTpu(interpret=False)
        with pytest.MonkeyPatch.context() as m:
            on_a_simulated_tpu(m)
            m.setattr(paged, "partitioning", _Unpartitioned())
            out = attnlib.attention(q, k, v, implementation=run, **kw)
    assert interpreter.races is not None, "the race detector did not run"
    assert not interpreter.races.races_found
    ref_out, _ = reference_attention(*(to_f64(x) for x in (q, k, v)), **_reference_kwargs(kw))
    assert_out_close(out, ref_out, jnp.bfloat16)


class _Unpartitioned:
    """`partitioning` without the partitionable wrapper (TPU interpret mode's callbacks cannot be partitioned)."""

    PAGED = None

    @staticmethod
    def call(fn, signature, operands):
        del signature
        return fn(*operands)
