"""`xla_chunked`'s two backward forms against the float64 reference: keys in one block (the forward's probabilities
reused, `one_block.py`) and keys over several blocks (recomputed per block), forward, lse and every gradient,
including the fast form where every key is visible and the guarded one (padding, causal, sinks, bias, rows that see
nothing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_lse_close, assert_out_close, lengths, normal, qkv, rng
from reference import reference_attention, reference_attention_vjp

import attnlib
from attnlib._src.backends import one_block


CASES = {  # name: (t, s, n, k, h, hv, kwargs, extras)
    "every_key_visible_gqa": (11, 13, 6, 2, 8, 5, {}, ()),
    "every_key_visible_mha_t_gt_s": (19, 7, 3, 3, 4, 6, {}, ()),
    "padding_causal_gqa": (13, 17, 4, 2, 8, 8, dict(is_causal=True), ("lengths",)),
    "bias_window": (12, 15, 4, 4, 8, 8, dict(local_window_size=(3, 2)), ("bias",)),
    "sinks_rows_that_see_nothing": (9, 11, 4, 2, 8, 8, dict(is_causal=True), ("sinks", "empty_rows")),
    # Long enough for one_block to split the query rows under the causal bound (`one_block.row_chunks`).
    "split_causal_gqa_sinks": (160, 160, 4, 2, 8, 6, dict(is_causal=True), ("sinks",)),
    "split_causal_bottom_right_t_lt_s": (150, 190, 3, 1, 8, 8,
                                         dict(is_causal=True, diagonal_alignment="bottom_right"), ()),
    "split_window": (140, 140, 2, 2, 8, 8, dict(local_window_size=(30, 0)), ()),
}


def _inputs(name):
    t, s, n, k, h, hv, kwargs, extras = CASES[name]
    r = rng(7)
    q, key, v = qkv(r, batch=(2,), t=t, s=s, n=n, k=k, h=h, hv=hv)
    kwargs = dict(kwargs)
    arrays = {}
    if "lengths" in extras:
        kwargs["key_value_seq_lengths"] = lengths([s - 5, s])
    if "empty_rows" in extras:
        kwargs["key_value_seq_lengths"] = lengths([0, s - 3])
    if "bias" in extras:
        arrays["bias"] = normal(r, (2, n, t, s))
    if "sinks" in extras:
        arrays["sinks"] = normal(r, (n,))
    d_out = normal(r, (2, t, n, hv))
    d_lse = normal(r, (2, t, n))
    return q, key, v, kwargs, arrays, d_out, d_lse


@pytest.mark.parametrize("block", ["one", "several"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_float64_reference(monkeypatch, name, block):
    q, key, v, kwargs, arrays, d_out, d_lse = _inputs(name)
    implementation = attnlib.XlaChunked(block_k=512 if block == "one" else 4)
    reused, chunks = [], []
    one_block_backward, one_block_row_chunks = one_block.backward, one_block.row_chunks
    monkeypatch.setattr(
        one_block, "backward", lambda *a, **k: reused.append(True) or one_block_backward(*a, **k)
    )
    monkeypatch.setattr(
        one_block, "row_chunks", lambda *a: chunks.append(len(one_block_row_chunks(*a))) or one_block_row_chunks(*a)
    )

    def run(q, key, v, arrays):
        return attnlib.attention(q, key, v, implementation=implementation, return_residual=True, **kwargs, **arrays)

    (out, lse), vjp = jax.vjp(run, q, key, v, arrays)
    grads = vjp((d_out, d_lse))
    assert bool(reused) == (block == "one"), "the backward form under test did not run"
    if block == "one":
        assert set(chunks) == ({2} if name.startswith("split") else {1}), f"row chunks: {chunks}"
    ref_out, ref_lse = reference_attention(q, key, v, **kwargs, **arrays)
    ref = reference_attention_vjp(q, key, v, d_out=d_out, d_lse=d_lse, **kwargs, **arrays)
    assert_out_close(out, ref_out, jnp.float32)
    rows_seen = np.isfinite(ref_lse)
    assert_lse_close(np.where(rows_seen, lse, 0.0), np.where(rows_seen, ref_lse, 0.0), jnp.float32)
    assert np.array_equal(np.isfinite(np.asarray(lse)), rows_seen), "lse: -inf exactly where a row sees nothing"
    for what, got in zip(("query", "key", "value"), grads[:3], strict=True):
        assert_grad_close(got, ref[what], jnp.float32, what=f"d{what}")
    for what, got in grads[3].items():
        assert_grad_close(got, ref[what], jnp.float32, what=f"d{what}")
