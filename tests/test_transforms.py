"""`attnlib.attention` under JAX transformations: jit, grad, jax.checkpoint, vmap (numbers and lowered HLO), vmap∘grad.

`xla_chunked` legitimately lowers to a while loop over key blocks; the HLO checks therefore compare the vmapped
lowering with the lowering of one example: vmap must not add loops and must not replicate the dot products per
example (one batched computation).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_grad_close,
    assert_out_close,
    HV,
    lengths,
    N,
    normal,
    qkv,
    S,
    segment_ids_from_runs,
    T,
    to_f64,
)
from reference import reference_attention, reference_attention_vjp

import attnlib


VB = 7  # vmapped batch size: a prime distinct from every other dim (T=13, S=17, N=6, K=2, H=8, Hv=5, block 5)


def _inputs(batch=(2,), seed=0, dtype=jnp.float32):
    return qkv(np.random.default_rng(seed), batch=batch, hv=HV, dtype=dtype)


OPTIONS = dict(is_causal=True, diagonal_alignment="bottom_right", logits_soft_cap=4.0)


def _ref(q, k, v, bias=None, **kw):
    kw = {n: to_f64(x) if isinstance(x, (jax.Array, np.ndarray)) else x for n, x in kw.items()}
    return reference_attention(to_f64(q), to_f64(k), to_f64(v), to_f64(bias), **kw)


# ------------------------------------------------------------------------------------------------------------------
# jit


def test_jit_matches_eager_and_reference(impl):
    q, k, v = _inputs()
    sinks = normal(np.random.default_rng(1), (N,))
    f = lambda q, k, v, sinks: attnlib.attention(q, k, v, sinks=sinks, implementation=impl, **OPTIONS)
    jitted = jax.jit(f)(q, k, v, sinks)
    eager = f(q, k, v, sinks)
    assert_out_close(jitted, eager, jnp.float32)
    ref, _ = _ref(q, k, v, sinks=sinks, **OPTIONS)
    assert_out_close(jitted, ref, jnp.float32)


def test_jit_traced_lengths_and_segments(impl):
    # the ragged metadata is traced (values unknown at trace time): one compilation serves different values
    q, k, v = _inputs()
    f = jax.jit(
        lambda q, k, v, ql, kl: attnlib.attention(
            q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, implementation=impl, **OPTIONS
        )
    )
    for ql, kl in [([13, 4], [17, 9]), ([1, 13], [3, 17])]:
        out = f(q, k, v, lengths(ql), lengths(kl))
        ref, _ = _ref(q, k, v, query_seq_lengths=np.asarray(ql), key_value_seq_lengths=np.asarray(kl), **OPTIONS)
        assert_out_close(out, ref, jnp.float32)


# ------------------------------------------------------------------------------------------------------------------
# grad and jax.checkpoint


def _loss(impl, **options):
    def loss(q, k, v, bias, sinks, cot):
        out = attnlib.attention(q, k, v, bias, sinks=sinks, implementation=impl, **options)
        return jnp.sum(out * cot)

    return loss


def _grad_inputs(batch=(2,)):
    r = np.random.default_rng(4)
    q, k, v = _inputs(batch)
    bias = normal(r, (N, T, S))
    sinks = normal(r, (N,))
    cot = normal(r, tuple(batch) + (T, N, HV))
    return q, k, v, bias, sinks, cot


def test_grad_matches_reference(impl):
    q, k, v, bias, sinks, cot = _grad_inputs()
    g = jax.jit(jax.grad(_loss(impl, **OPTIONS), argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, sinks, cot)
    ref = reference_attention_vjp(
        to_f64(q), to_f64(k), to_f64(v), to_f64(bias), d_out=to_f64(cot), sinks=to_f64(sinks), **OPTIONS
    )
    for name, got in zip(["query", "key", "value", "bias", "sinks"], g, strict=True):
        assert_grad_close(got, ref[name], jnp.float32, what=f"d{name}")


def test_checkpoint(impl):
    q, k, v, bias, sinks, cot = _grad_inputs()
    loss = _loss(impl, **OPTIONS)
    argnums = (0, 1, 2, 3, 4)
    plain = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias, sinks, cot)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=argnums))(q, k, v, bias, sinks, cot)
    saveless = jax.jit(
        jax.grad(jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable), argnums=argnums)
    )(q, k, v, bias, sinks, cot)
    for a, b, c in zip(plain, remat, saveless, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------------
# vmap: numbers


def _vmap_cases():
    r = np.random.default_rng(9)
    qs = segment_ids_from_runs([(1, 6), (2, 5)], T)
    ks = segment_ids_from_runs([(1, 9), (2, 8)], S)
    return {
        "plain": (dict(), dict(), dict()),
        "bias_mask_causal_sinks": (
            dict(bias=normal(r, (VB, N, T, S)), mask=jnp.asarray(r.random((VB, 1, T, S)) < 0.8)),
            dict(sinks=normal(r, (N,))),
            OPTIONS,
        ),
        "lengths_window": (
            dict(query_seq_lengths=lengths(r.integers(0, T + 1, VB)),
                 key_value_seq_lengths=lengths(r.integers(0, S + 1, VB))),
            dict(),
            dict(local_window_size=(3, 1), diagonal_alignment="bottom_right"),
        ),  # fmt: skip
        "segments": (
            dict(q_segment_ids=jnp.asarray(np.tile(qs, (VB, 1))), kv_segment_ids=jnp.asarray(np.tile(ks, (VB, 1)))),
            dict(),
            dict(is_causal=True),
        ),
    }


VMAP_CASES = list(_vmap_cases())


def _vmapped_and_batched(impl, case):
    mapped, shared, static = _vmap_cases()[case]
    names = list(mapped)

    def per_example(q, k, v, *m):
        kw = dict(zip(names, m, strict=True))
        bias, mask = kw.pop("bias", None), kw.pop("mask", None)
        return attnlib.attention(q, k, v, bias, mask, implementation=impl, return_residual=True,
                                 **kw, **shared, **static)  # fmt: skip

    return per_example, [mapped[n] for n in names]


@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_matches_batched_call(impl, case):
    q, k, v = _inputs(batch=(VB,))
    f, mapped = _vmapped_and_batched(impl, case)
    out_v, lse_v = jax.jit(jax.vmap(f))(q, k, v, *mapped)
    # the batched call: the same function on [VB, ...] arrays (unbatched per-example shapes -> batched shapes)
    out_b, lse_b = jax.jit(f)(q, k, v, *mapped)
    assert out_v.shape == out_b.shape == (VB, T, N, HV)
    assert lse_v.shape == lse_b.shape == (VB, T, N)
    np.testing.assert_allclose(np.asarray(out_v), np.asarray(out_b), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse_v), np.isneginf(lse_b))
    fin = np.isfinite(np.asarray(lse_b))
    np.testing.assert_allclose(np.asarray(lse_v)[fin], np.asarray(lse_b)[fin], rtol=1e-6, atol=1e-6)


def test_nested_vmap_matches_extra_batch_dims(impl):
    q, k, v = _inputs(batch=(3, VB))
    f = lambda q, k, v: attnlib.attention(q, k, v, implementation=impl, **OPTIONS)
    nested = jax.jit(jax.vmap(jax.vmap(f)))(q, k, v)
    batched = jax.jit(f)(q, k, v)
    np.testing.assert_allclose(np.asarray(nested), np.asarray(batched), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------------
# vmap: lowered HLO is one batched computation


def _count_ops(text: str) -> dict:
    return {
        "while": len(re.findall(r"stablehlo\.while\b", text)),
        "dot": len(re.findall(r"stablehlo\.dot_general\b", text)) + len(re.findall(r"stablehlo\.dot\b", text)),
        "call_sites": len(re.findall(r"\bcall @", text)),
    }


def _dot_result_types(text: str) -> list[str]:
    return re.findall(r"stablehlo\.dot_general.*-> tensor<([0-9x]+)x[a-z0-9]+>", text)


@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_lowers_to_one_batched_computation(impl, case):
    q, k, v = _inputs(batch=(VB,))
    f, mapped = _vmapped_and_batched(impl, case)
    vmapped = jax.jit(jax.vmap(f)).lower(q, k, v, *mapped).as_text()
    single = jax.jit(f).lower(q[0], k[0], v[0], *[m[0] for m in mapped]).as_text()
    cv, cs = _count_ops(vmapped), _count_ops(single)
    if impl == "xla":
        assert cv["while"] == 0, f"xla lowered a loop under vmap ({cv['while']} while ops)"
    # no loop over the batch, no per-example copies of the computation
    assert cv["while"] == cs["while"], f"vmap changed the number of while loops: {cs['while']} -> {cv['while']}"
    assert cv["dot"] == cs["dot"], f"vmap changed the number of dot ops: {cs['dot']} -> {cv['dot']}"
    # every dot product carries the vmapped batch dim
    dims = _dot_result_types(vmapped)
    assert dims, "no dot_general found in the lowered HLO"
    for d in dims:
        assert str(VB) in d.split("x"), f"a dot_general result tensor<{d}x...> has no batch dim of size {VB}"


# ------------------------------------------------------------------------------------------------------------------
# vmap ∘ grad


def test_vmap_of_grad(impl):
    q, k, v, bias, sinks, cot = _grad_inputs(batch=(VB,))
    loss = _loss(impl, **OPTIONS)
    argnums = (0, 1, 2, 4)
    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=argnums), in_axes=(0, 0, 0, None, None, 0)))(
        q, k, v, bias, sinks, cot
    )
    batched = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias, sinks, cot)
    # the batched loss is the sum of the per-example losses: q/k/v gradients are the per-example ones, the shared
    # sinks gradient is their sum
    for a, b in zip(per_example[:3], batched[:3], strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(per_example[3]).sum(0), np.asarray(batched[3]), rtol=1e-5, atol=1e-5)


def test_vmap_of_grad_lowering_has_no_batch_loop(impl):
    q, k, v, bias, sinks, cot = _grad_inputs(batch=(VB,))
    g = jax.grad(_loss(impl, **OPTIONS), argnums=(0, 1, 2))
    vmapped = jax.jit(jax.vmap(g, in_axes=(0, 0, 0, None, None, 0))).lower(q, k, v, bias, sinks, cot).as_text()
    single = jax.jit(g).lower(q[0], k[0], v[0], bias, sinks, cot[0]).as_text()
    cv, cs = _count_ops(vmapped), _count_ops(single)
    if impl == "xla":
        assert cv["while"] == 0
    assert cv["while"] == cs["while"] and cv["dot"] == cs["dot"], (cs, cv)


def test_vmap_over_thd(impl):
    # vmap over a micro-batch of THD packs, each with its own cu_seqlens, equals one call per pack
    r = np.random.default_rng(6)
    q, k, v = normal(r, (3, T, N, 8)), normal(r, (3, S, 2, 8)), normal(r, (3, S, 2, HV))
    cu_q = lengths([[0, 3, 3, 7, 11], [0, 13, 13, 13, 13], [0, 1, 2, 3, 4]])
    cu_kv = lengths([[0, 5, 5, 5, 14], [0, 17, 17, 17, 17], [0, 4, 8, 12, 16]])

    def f(q, k, v, cq, ck):
        return attnlib.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck, is_causal=True,
                                 diagonal_alignment="bottom_right", implementation=impl,
                                 return_residual=True)  # fmt: skip

    out, lse = jax.jit(jax.vmap(f))(q, k, v, cu_q, cu_kv)
    single = jax.jit(f)
    for i in range(3):
        o, l = single(q[i], k[i], v[i], cu_q[i], cu_kv[i])
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(o), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse[i])), np.isneginf(np.asarray(l)))


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
def test_shard_map_with_varying_inputs(implementation):
    """Inside `shard_map` the inputs vary over the mesh axis; loop carries must vary with them (fwd and bwd)."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("b",))
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 11, 4, 8))
    k = jax.random.normal(keys[1], (2, 13, 2, 8))
    v = jax.random.normal(keys[2], (2, 13, 2, 8))
    seg_q = jnp.array([[1] * 5 + [2] * 6, [3] * 11])
    seg_k = jnp.array([[1] * 6 + [2] * 7, [3] * 9 + [0] * 4])
    options = dict(
        is_causal=True, diagonal_alignment="bottom_right", sinks=jnp.zeros((4,)), implementation=implementation
    )

    def local(q, k, v, seg_q, seg_k):
        return attnlib.attention(q, k, v, q_segment_ids=seg_q, kv_segment_ids=seg_k, **options)

    spec = P("b")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, seg_q, seg_k) ** 2)
    out, grads = jax.jit(jax.value_and_grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    expected, expected_grads = jax.jit(jax.value_and_grad(loss(local), argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
