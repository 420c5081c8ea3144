"""`xla_chunked` under a static band: query blocks too, and only the (query block, key block) tiles the band touches
(`xla_chunked.plan_tiles`). Odd sizes that are no multiple of the block, against the float64 reference and against
the untiled loop (every key block with all rows) forward and backward, and the work saved counted in the compiled
program's matmul FLOPs (`hlo_flops.dot_flops`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    lengths,
    normal,
    qkv,
    rng,
    segment_ids_from_runs,
    Tol,
)
from hlo_flops import dot_flops
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src import band as band_lib
from attnlib._src.backends import xla_chunked


CASES = {  # name: (t, s, n, k, block_k, kwargs, extras)
    "causal_top_left_t_lt_s": (23, 37, 4, 2, 5, dict(is_causal=True), ()),
    "causal_top_left_t_gt_s": (37, 23, 4, 2, 5, dict(is_causal=True), ()),
    "causal_bottom_right_t_lt_s": (23, 37, 4, 2, 5, dict(is_causal=True, diagonal_alignment="bottom_right"), ()),
    # the first 14 rows see nothing
    "causal_bottom_right_t_gt_s": (37, 23, 3, 1, 5, dict(is_causal=True, diagonal_alignment="bottom_right"), ()),
    "window_two_sided": (41, 41, 4, 2, 6, dict(local_window_size=(6, 3)), ()),
    "window_two_sided_bottom_right_t_lt_s": (
        29, 43, 2, 2, 5, dict(local_window_size=(5, 2), diagonal_alignment="bottom_right"), (),
    ),  # fmt: skip
    "window_segments": (41, 41, 4, 2, 4, dict(is_causal=True, local_window_size=(5, 0)), ("segments",)),
    "window_two_sided_segments_lengths": (43, 43, 2, 1, 5, dict(local_window_size=(3, 4)), ("segments", "lengths")),
    "causal_window_padding_bias_sinks": (31, 31, 4, 2, 5, dict(is_causal=True, local_window_size=(7, 0)),
                                         ("lengths", "bias", "sinks")),  # fmt: skip
    "window_thd": (47, 47, 2, 2, 5, dict(local_window_size=(4, 1)), ("thd",)),
}


def _inputs(name):
    t, s, n, k, block_k, kwargs, extras = CASES[name]
    r = rng(11)
    batch = () if "thd" in extras else (2,)
    q, key, v = qkv(r, batch=batch, t=t, s=s, n=n, k=k, h=8, hv=6)
    kwargs, arrays = dict(kwargs), {}
    if "segments" in extras:
        ids = [segment_ids_from_runs([(1, 9), (2, 17), (3, 11)], t), segment_ids_from_runs([(4, 30), (7, 8)], t)]
        kwargs["q_segment_ids"] = jnp.asarray(np.stack(ids))
    if "lengths" in extras:
        kwargs["query_seq_lengths"] = lengths([t - 6, t])
        kwargs["key_value_seq_lengths"] = lengths([s, s - 9])
    if "thd" in extras:
        kwargs["cu_seqlens_q"] = lengths([0, 13, 14, 40])
    if "bias" in extras:
        arrays["bias"] = normal(r, (2, 1, t, s))
    if "sinks" in extras:
        arrays["sinks"] = normal(r, (n,))
    d_out = normal(r, batch + (t, n, 6))
    d_lse = normal(r, batch + (t, n))
    return q, key, v, kwargs, arrays, d_out, d_lse, attnlib.XlaChunked(block_k=block_k)


def _vjp(implementation, q, key, v, kwargs, arrays, d_out, d_lse):
    def run(q, key, v, arrays):
        return attnlib.attention(q, key, v, implementation=implementation, return_residual=True, **kwargs, **arrays)

    def out_lse_and_grads(q, key, v, arrays, d_out, d_lse):
        (out, lse), vjp = jax.vjp(run, q, key, v, arrays)
        return out, lse, vjp((d_out, d_lse))

    # one compiled program (traced afresh on each call: the tests patch the tile planner between calls)
    return jax.jit(out_lse_and_grads)(q, key, v, arrays, d_out, d_lse)


FAST = {"causal_bottom_right_t_gt_s", "window_two_sided_segments_lengths", "causal_window_padding_bias_sinks",
        "window_thd"}
"""The fast tier's cases: bottom-right causal with rows that see nothing, a two-sided window with segments and
padding lengths, a top-left causal window with padding, bias and sinks, and THD: every feature once. The others
(causal alone, top-left with T < S and T > S and bottom-right with T < S; two-sided windows alone and bottom-right;
a causal window with segments) are `full`."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else (pytest.mark.full,)) for n in CASES])
def test_tiles_match_the_float64_reference_and_the_untiled_loop(monkeypatch, name):
    q, key, v, kwargs, arrays, d_out, d_lse, implementation = _inputs(name)
    plans = []
    plan_tiles = xla_chunked.plan_tiles
    monkeypatch.setattr(xla_chunked, "plan_tiles", lambda *a: plans.append(plan_tiles(*a)) or plans[-1])
    out, lse, grads = _vjp(implementation, q, key, v, kwargs, arrays, d_out, d_lse)
    tiles = plans[-1]
    assert tiles.pairs is not None and len(tiles.pairs) < tiles.num_q_blocks * tiles.num_k_blocks, tiles
    t, s = CASES[name][:2]
    assert t % tiles.block_q or s % tiles.block_k, "odd sizes: some block is padded"

    ref_kwargs = dict(kwargs)
    if "cu_seqlens_q" in kwargs:  # attnlib defaults the keys' `cu_seqlens_kv` to the queries'; the reference takes both
        ref_kwargs["cu_seqlens_kv"] = kwargs["cu_seqlens_q"]
    ref_out, ref_lse = reference_attention(q, key, v, **ref_kwargs, **arrays)
    ref = reference_attention_vjp(q, key, v, d_out=d_out, d_lse=d_lse, **ref_kwargs, **arrays)
    assert_out_close(out, ref_out, jnp.float32)
    rows_seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np.asarray(lse)), rows_seen), "lse: -inf exactly where a row sees nothing"
    assert_lse_close(np.where(rows_seen, lse, 0.0), np.where(rows_seen, ref_lse, 0.0), jnp.float32)
    for what, got in zip(("query", "key", "value"), grads[:3], strict=True):
        assert_grad_close(got, ref[what], jnp.float32, what=f"d{what}")
    for what, got in grads[3].items():
        assert_grad_close(got, ref[what], jnp.float32, what=f"d{what}")

    # Skipping changes no result: the untiled loop (no band) gives the same numbers to float32 rounding.
    monkeypatch.setattr(band_lib.Band, "on_indices", classmethod(lambda cls, config, inputs: None))
    plans.clear()
    untiled_out, untiled_lse, untiled_grads = _vjp(implementation, q, key, v, kwargs, arrays, d_out, d_lse)
    assert plans[-1].pairs is None
    tol = Tol(1e-6, 1e-6)
    assert_close(out, untiled_out, tol, what="out", scale_atol_by_max=True)
    assert_close(np.where(rows_seen, lse, 0.0), np.where(rows_seen, untiled_lse, 0.0), tol, what="lse")
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(untiled_grads), strict=True):
        assert_close(got, want, Tol(2e-6, 2e-6), what="grad", scale_atol_by_max=True)


def test_dropout_tiles_drop_what_the_untiled_loop_drops(monkeypatch):
    """The keep mask is indexed by the global query row inside a query block."""
    r = rng(3)
    q, k, v = qkv(r, batch=(2,), t=27, s=27, n=2, k=1, h=8, hv=8)
    f = lambda q, k, v: attnlib.attention(
        q, k, v, local_window_size=(4, 2), dropout_rate=0.3, dropout_key=jax.random.key(5),
        implementation=attnlib.XlaChunked(block_k=4),
    )  # fmt: skip
    g = jax.grad(lambda q, k, v: jnp.sum(jnp.square(f(q, k, v))), argnums=(0, 1, 2))
    tiled = f(q, k, v), g(q, k, v)
    monkeypatch.setattr(band_lib.Band, "on_indices", classmethod(lambda cls, config, inputs: None))
    untiled = f(q, k, v), g(q, k, v)
    for got, want in zip(jax.tree.leaves(tiled), jax.tree.leaves(untiled), strict=True):
        assert_close(got, want, Tol(2e-6, 2e-6), what="dropout", scale_atol_by_max=True)


def test_band_on_indices_only_where_it_is_static(monkeypatch):
    """A band bounds the indices unless the runtime lengths move the diagonal (bottom-right with padding) or the keys
    are laid out differently from the queries (their own `kv_segment_ids` / `cu_seqlens_kv`)."""
    q = jnp.zeros((2, 16, 2, 8))
    ids = jnp.ones((2, 16), jnp.int32)
    lens = jnp.asarray([16, 9], jnp.int32)
    cu = jnp.asarray([0, 5, 16], jnp.int32)
    seen = []
    on_indices = band_lib.Band.on_indices
    monkeypatch.setattr(
        band_lib.Band, "on_indices", classmethod(lambda cls, *a: seen.append(on_indices(*a)) or seen[-1])
    )

    def band(query=q, **kwargs):
        f = lambda q, k: attnlib.attention(q, k, k, implementation="xla_chunked", **kwargs)
        jax.eval_shape(f, query, q[0] if query.ndim == 3 else q)
        return seen[-1]

    B = band_lib.Band
    assert band() is None
    assert band(is_causal=True) == B(None, 0, False)
    assert band(is_causal=True, diagonal_alignment="bottom_right", query=q[:, :9]) == B(None, 0, True)
    assert band(local_window_size=(3, 2), key_value_seq_lengths=lens) == B(3, 2, False)
    assert band(is_causal=True, key_value_seq_lengths=lens, diagonal_alignment="bottom_right") is None
    assert band(is_causal=True, q_segment_ids=ids) == B(None, 0, False)
    assert band(is_causal=True, q_segment_ids=ids, kv_segment_ids=ids) is None
    assert band(is_causal=True, query=q[0], cu_seqlens_q=cu) == B(None, 0, False)
    assert band(is_causal=True, query=q[0], cu_seqlens_q=cu, cu_seqlens_kv=cu) is None


@pytest.mark.parametrize("direction", ["forward", "forward_and_backward"])
def test_compiled_matmul_flops_count_only_the_visible_tiles(direction):
    """T = S = 200 in blocks of 32 (7 x 7 tiles, the last ones padded): full attention runs every key block against
    all rows, causal the 28 tiles on or below the diagonal, a (31, 0) window the 13 its band touches; the compiled
    program's matmul FLOPs say so exactly (`Compiled.cost_analysis` counts a loop body once)."""
    B, T, N, H, block = 1, 200, 2, 16, 32
    q = jnp.zeros((B, T, N, H))
    implementation = attnlib.XlaChunked(block_k=block)

    def flops(**kwargs):
        f = lambda q, k, v: attnlib.attention(q, k, v, implementation=implementation, **kwargs)
        if direction == "forward_and_backward":
            f = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
        return dot_flops(jax.jit(f).lower(q, q, q).compile().as_text())

    tile = 4 * B * N * H * block * block  # q.k and p.v of one 32 x 32 tile
    per_tile = {"forward": 1, "forward_and_backward": 3.5}[direction]  # the backward: 5 matmuls of a tile's size
    full, causal, window = flops(), flops(is_causal=True), flops(is_causal=True, local_window_size=(31, 0))
    assert full == pytest.approx(per_tile * 4 * B * N * H * T * 7 * block)  # untiled: all rows x every key block
    assert causal == pytest.approx(per_tile * 28 * tile)
    assert window == pytest.approx(per_tile * 13 * tile)
