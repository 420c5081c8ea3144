"""CPU tests of the cuDNN wrapper for score-modifier graphs, with the graph emulated.

`emulate` stands in for a dense cuDNN SDPA graph with a `score_mod` / `score_mod_bprop`: it runs attnlib's own
lowering of the modifier (`score_mod_lowering.emit_forward` / `emit_backward`) on `NumpyOps`, the CPU model of the
graph's pointwise ops, inside the attention math cuDNN performs (scale → modifier → bias → softmax; backward
dS = P (dP - D) → bprop → dQ, dK, dV). So everything of attnlib's side runs for real: the composed modifier (soft cap,
mask_mod, causal, window, bottom-right offset), key padding and boolean masks as an additive bias, masked-row
detection from the statistics, the custom VJP and the lse-gradient reference. The GPU suite
(`test_score_mod_gpu.py`) runs the same cases on cuDNN itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import install
from test_cudnn_gpu import _compare, _qkv
from test_score_mod_gpu import _materialize, CASES, MASK_CASES, N

from attnlib._src.backends.cudnn import graphs
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid


def _emulate_numpy(spec: GraphSpec, *operands):
    from attnlib._src.backends.cudnn import score_mod_lowering as lowering

    vals = dict(zip(spec.in_uids(), (np.asarray(x) for x in operands)))
    b, g = spec.b, spec.n // spec.k
    heads_first = lambda x: np.transpose(np.asarray(x, np.float32), (0, 2, 1, 3))
    q = heads_first(vals[Uid.Q])
    k = np.repeat(heads_first(vals[Uid.K]), g, axis=1)
    v = np.repeat(heads_first(vals[Uid.V]), g, axis=1)
    scale = spec.scale if spec.scale is not None else vals[Uid.ATTN_SCALE][0]  # a runtime scale: an operand
    logits = np.einsum("bnih,bnjh->bnij", q, k).astype(np.float32) * np.float32(scale)
    grids = [np.broadcast_to(x, logits.shape).astype(np.float32) for x in np.indices(logits.shape, sparse=True)]
    args = [np.asarray(vals[u], np.float32) for u in spec.in_uids() if u >= graphs.MODIFIER_ARG_UID]
    ops = lowering.NumpyOps()
    store: dict = {}
    scores = np.asarray(lowering.emit_forward(ops, spec.modifier.jaxpr, logits, lambda: grids, args, store))
    if spec.bias_b:
        scores = scores + np.asarray(vals[Uid.BIAS], np.float32)
    sinks = vals.get(Uid.SINK)
    m = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    e = np.exp(scores - m)
    den = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks[None, :, None, None] - m)
    rows_first = lambda x: np.transpose(x, (0, 2, 1, 3))
    if spec.direction == "fwd":
        o = np.einsum("bnij,bnjh->bnih", e / den, v)
        return rows_first(o).astype(spec.dtype), (m + np.log(den))[..., 0].astype(np.float32)
    o, do = heads_first(vals[Uid.O]), heads_first(vals[Uid.DO])
    p = np.exp(scores - vals[Uid.STATS][..., None])
    dp = np.einsum("bnih,bnjh->bnij", do, v)
    d_scores = (p * (dp - np.sum(do * o, axis=-1, keepdims=True))).astype(np.float32)
    d_logits = np.asarray(lowering.emit_backward(ops, spec.modifier.jaxpr, d_scores, lambda: grids, args, store))
    dq = np.einsum("bnij,bnjh->bnih", d_logits, k) * scale
    dk = np.einsum("bnij,bnih->bnjh", d_logits, q) * scale
    dv = np.einsum("bnij,bnih->bnjh", p, do)
    fold = lambda x: rows_first(np.sum(np.reshape(x, (b, spec.k, g) + x.shape[2:]), axis=2))
    grads = [rows_first(dq), fold(dk), fold(dv)]
    if spec.bias_b and spec.bias_grad:
        dbias = d_scores.sum(axis=0, keepdims=True) if spec.bias_b == 1 else d_scores
        grads.append(dbias.sum(axis=1, keepdims=True) if spec.bias_n == 1 else dbias)
    return tuple(np.asarray(x).astype(spec.dtype) for x in grads)


def emulate(spec: GraphSpec, entry, *operands, tokens=None):
    """The modifier graph on the CPU (a host callback, so it runs under `jit`)."""
    del entry, tokens
    if spec.modifier is None:
        from test_cudnn_dense_emulated import emulate as plain

        return plain(spec, None, *operands)[: len(spec.out_uids())]  # no dBias when `bias_grad` is False
    shapes = [jax.ShapeDtypeStruct(*spec.shape(uid)) for uid in spec.out_uids()]
    return tuple(jax.pure_callback(lambda *xs: _emulate_numpy(spec, *xs), shapes, *operands))


@pytest.fixture
def emulated(monkeypatch):
    return install(monkeypatch, emulate)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_modifier_wrapper_matches_reference(emulated, case):
    name, t, s, n, kh, h, hv, kw = case
    q, k, v = _qkv(11, (2,), t, s, n, kh, h, hv, jnp.bfloat16)
    kw = _materialize(kw, n, t, s, jnp.bfloat16, 11)
    out, lse, grads = _compare(q, k, v, kw, dtype=jnp.bfloat16, lse_grad=True)
    if name.startswith("fully_masked_rows"):
        assert np.all(np.asarray(out[:, :20], np.float32) == 0)
        assert np.all(np.asarray(grads[0][:, :20], np.float32) == 0)


@pytest.mark.parametrize("case", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_boolean_mask_wrapper_matches_reference(emulated, case):
    _, kw = case
    t, s = 100, 112
    q, k, v = _qkv(12, (2,), t, s, N, 2, 64, 64, jnp.bfloat16)
    kw = _materialize(kw, N, t, s, jnp.bfloat16, 12)
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 1, t, s)).at[:, :, 3].set(False)
    kw["mask"] = mask
    out, lse, grads = _compare(q, k, v, kw, dtype=jnp.bfloat16, lse_grad=True)
    assert np.all(np.asarray(out[:, 3], np.float32) == 0) and np.all(np.isneginf(np.asarray(lse[:, 3])))
    assert np.all(np.asarray(grads[0][:, 3], np.float32) == 0)


def batch_dependent(score, batch, head, q_idx, kv_idx):
    return score * (1.0 + 0.5 * batch.astype(jnp.float32)) - 0.1 * head.astype(jnp.float32)


@pytest.mark.parametrize("score_mod", [batch_dependent, None], ids=["reads_batch", "softcap_only"])
def test_vmap_matches_reference(emulated, score_mod):
    """`vmap` over calls with a modifier: a modifier that reads `batch` sees each example's own rows (the mapped axis
    is looped, not folded into the graph's batch), as on the plain-JAX implementations."""
    import attnlib

    q, k, v = _qkv(13, (3, 2), 40, 56, 4, 2, 64, 64, jnp.bfloat16)
    kw = dict(score_mod=score_mod, logits_soft_cap=None if score_mod else 20.0, is_causal=True)
    run = lambda impl, q, k, v: jax.vmap(lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, **kw))(
        q, k, v
    )
    f32 = lambda x: x.astype(jnp.float32)
    out = run("cudnn", q, k, v)
    ref = run("xla", f32(q), f32(k), f32(v))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=2e-2, rtol=1e-2)
