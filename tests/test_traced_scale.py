"""`scale` as a 0-d float array (traced under `jit`, a learned temperature): values, gradients, one graph, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import emulate_graph, emulated_cudnn

import attnlib


B, T, S, N, K, H, Hv = 2, 7, 11, 6, 3, 5, 3


def _qkv(dtype=jnp.float32, h=H, hv=Hv, seed=0):
    r = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(r.normal(size=shape), dtype)
        for shape in ((B, T, N, h), (B, S, K, h), (B, S, K, hv))
    )


def _loss(implementation, **kwargs):
    """A scalar of out and lse whose gradient reaches every output element."""

    def loss(q, k, v, scale):
        out, lse = attnlib.attention(
            q, k, v, scale=scale, implementation=implementation, return_residual=True, **kwargs
        )
        out = out.astype(jnp.float64 if out.dtype == jnp.float64 else jnp.float32)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(jnp.where(jnp.isfinite(lse), lse, 0.0)))

    return loss


PLAIN = {"xla": "xla", "xla_chunked": "xla_chunked", "xla_chunked_block5": attnlib.XlaChunked(block_k=5)}
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bias_window": {"bias": "bias", "local_window_size": (3, 1)},
    "soft_cap": {"logits_soft_cap": 2.5},
    "score_mod": {"score_mod": lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j).astype(s.dtype)},
}


def _options(name, dtype=jnp.float32):
    options = dict(OPTIONS[name])
    if options.get("bias") == "bias":
        options["bias"] = jnp.asarray(np.random.default_rng(7).normal(size=(1, N, T, S)), dtype)
    return options


@pytest.mark.parametrize("implementation", list(PLAIN.values()), ids=list(PLAIN))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_traced_scale_matches_the_float_plain_jax(implementation, option):
    q, k, v = _qkv()
    options = _options(option)
    loss = _loss(implementation, **options)
    value = 0.7
    traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, jnp.float32(value))
    as_float = jax.value_and_grad(lambda q, k, v: loss(q, k, v, value), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(traced[0], as_float[0], rtol=1e-5, atol=1e-5)
    for g_traced, g_float in zip(traced[1][:3], as_float[1], strict=True):
        np.testing.assert_allclose(g_traced, g_float, rtol=1e-5, atol=1e-5)
    out_t, lse_t = jax.jit(lambda s: attnlib.attention(q, k, v, scale=s, implementation=implementation,
                                                       return_residual=True, **options))(jnp.float32(value))
    out_f, lse_f = attnlib.attention(q, k, v, scale=value, implementation=implementation, return_residual=True,
                                     **options)  # fmt: skip
    np.testing.assert_allclose(out_t, out_f, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_t, lse_f, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", list(PLAIN.values()), ids=list(PLAIN))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_scale_gradient_matches_finite_differences_float64(implementation, option):
    if option == "score_mod" and implementation != "xla":
        pytest.skip("a score_mod with float64 inputs runs on xla only")
    with jax.enable_x64(True):
        q, k, v = _qkv(jnp.float64)
        loss = _loss(implementation, **_options(option, jnp.float64))
        grad = jax.grad(loss, argnums=3)(q, k, v, jnp.float64(0.7))
        eps = 1e-6
        fd = (loss(q, k, v, 0.7 + eps) - loss(q, k, v, 0.7 - eps)) / (2 * eps)
        assert grad.dtype == jnp.float64
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6)
        # at scale 0 too (the plain-JAX backwards never divide by the scale)
        grad0 = jax.grad(loss, argnums=3)(q, k, v, jnp.float64(0.0))
        fd0 = (loss(q, k, v, eps) - loss(q, k, v, -eps)) / (2 * eps)
        np.testing.assert_allclose(grad0, fd0, rtol=1e-6, atol=1e-6)


def test_concrete_arrays_outside_jit_and_numpy_scalars():
    q, k, v = _qkv()
    want = attnlib.attention(q, k, v, scale=0.4)
    for scale in (jnp.float32(0.4), jnp.asarray(0.4), np.asarray(0.4, np.float32), np.asarray(0.4)):
        for implementation in PLAIN.values():
            got = attnlib.attention(q, k, v, scale=scale, implementation=implementation)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_no_retrace_for_new_scale_values():
    q, k, v = _qkv()
    traces = []

    @jax.jit
    def f(scale):
        traces.append(None)
        return attnlib.attention(q, k, v, scale=scale, implementation="xla_chunked")

    outs = [f(jnp.float32(s)) for s in (0.3, 0.5, 1.7)]
    assert len(traces) == 1
    assert not np.allclose(outs[0], outs[1])


def test_vmap_over_scale():
    q, k, v = _qkv()
    scales = jnp.asarray([0.3, 0.9], jnp.float32)
    got = jax.vmap(lambda s: attnlib.attention(q, k, v, scale=s, implementation="xla_chunked"))(scales)
    for i, s in enumerate((0.3, 0.9)):
        np.testing.assert_allclose(got[i], attnlib.attention(q, k, v, scale=s), rtol=1e-5, atol=1e-6)


# --- cuDNN, emulated on the CPU -------------------------------------------------------------------------------------


def _counting_cudnn():
    specs = []

    def graph(spec, entry, *operands, tokens=None):
        specs.append(spec)
        return emulate_graph(spec, entry, *operands, tokens=tokens)

    return emulated_cudnn(graph), specs


CUDNN_OPTIONS = ["plain", "soft_cap"]
"""What cuDNN's runtime-scale graphs serve: on an H200 with cuDNN 9.19 (2026-12-05) these matched `xla`; with
`is_causal` the values were wrong, with a bias and a window the graph was refused (`support.runtime_scale_reason`)."""
CUDNN_DECLINED = ["causal", "bias_window", "score_mod"]


@pytest.mark.parametrize("option", CUDNN_DECLINED)
def test_cudnn_declines_runtime_scale_with_masks_and_falls_back(option):
    cudnn, specs = _counting_cudnn()
    q, k, v = _qkv(jnp.bfloat16, h=8, hv=16)
    options = _options(option, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"`scale` as an array .* served only without masks"):
        _loss(cudnn, **options)(q, k, v, jnp.float32(0.7))
    got = jax.value_and_grad(_loss([cudnn, "xla"], **options), argnums=(0, 3))(q, k, v, jnp.float32(0.7))
    want = jax.value_and_grad(_loss("xla", **options), argnums=(0, 3))(q, k, v, jnp.float32(0.7))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert not specs
    # a Python float scale keeps these calls on cuDNN
    _loss(cudnn, **options)(q, k, v, 0.7)
    assert specs


@pytest.mark.parametrize("option", CUDNN_OPTIONS)
def test_emulated_cudnn_traced_scale(option):
    cudnn, specs = _counting_cudnn()
    q, k, v = _qkv(jnp.bfloat16, h=8, hv=16)
    options = _options(option, jnp.bfloat16)
    loss = _loss(cudnn, **options)
    reference = _loss("xla", **options)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    for value in (0.7, 0.25, 1.3):
        got = step(q, k, v, jnp.float32(value))
        want = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(q, k, v, jnp.float32(value))
        # as the float scale does on the same graph path
        as_float = jax.value_and_grad(lambda q, k, v: loss(q, k, v, value), argnums=(0, 1, 2))(q, k, v)
        np.testing.assert_allclose(got[0], as_float[0], rtol=1e-3, atol=1e-3)
        for g, f in zip(got[1][:3], as_float[1], strict=True):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(f, np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got[0], want[0], rtol=5e-2, atol=0.3)  # bf16 outputs, summed
        np.testing.assert_allclose(got[1][3], want[1][3], rtol=2e-2, atol=5e-2)
    # one forward and one backward graph with a runtime scale for every value (the float calls bake theirs in)
    runtime = {s for s in specs if s.scale is None}
    assert len(runtime) == 2 and {s.direction for s in runtime} == {"fwd", "bwd"}, runtime
    assert sorted({s.scale for s in specs} - {None}) == pytest.approx(sorted(
        {(x / 2.5 if option == "soft_cap" else x) for x in (0.7, 0.25, 1.3)}
    ))  # fmt: skip


def test_emulated_cudnn_one_graph_for_eager_arrays_and_scale_operand():
    cudnn, specs = _counting_cudnn()
    q, k, v = _qkv(jnp.float16, h=8, hv=16)
    for value in (0.2, 0.6, 0.9):
        got = attnlib.attention(q, k, v, scale=jnp.float32(value), implementation=cudnn)
        want = attnlib.attention(q, k, v, scale=value, implementation="xla")
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-3)
    assert len(set(specs)) == 1 and next(iter(specs)).scale is None
    assert attnlib._src.backends.cudnn.graphs.Uid.ATTN_SCALE in specs[0].in_uids()
    # a Python float keeps a static scale baked into the graph, as before
    cudnn_float, float_specs = _counting_cudnn()
    attnlib.attention(q, k, v, scale=0.2, implementation=cudnn_float)
    assert float_specs[0].scale == pytest.approx(0.2)
    assert attnlib._src.backends.cudnn.graphs.Uid.ATTN_SCALE not in float_specs[0].in_uids()


def test_emulated_cudnn_declines_runtime_scale_on_thd_layout():
    cudnn, _ = _counting_cudnn()
    q = jnp.ones((12, N, 8), jnp.bfloat16)
    kv = jnp.ones((12, K, 8), jnp.bfloat16)
    cu = jnp.asarray([0, 5, 12], jnp.int32)
    with pytest.raises(NotImplementedError, match="scale"):
        attnlib.attention(q, kv, kv, scale=jnp.float32(0.5), cu_seqlens_q=cu, implementation=cudnn)
    out = attnlib.attention(q, kv, kv, scale=jnp.float32(0.5), cu_seqlens_q=cu, implementation=[cudnn, "xla"])
    assert out.shape == (12, N, 8)


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scale, error, message",
    [
        (jnp.ones((1,), jnp.float32), ValueError, "shape"),
        (jnp.ones((2, 2), jnp.float32), ValueError, "shape"),
        (jnp.asarray(2, jnp.int32), TypeError, "dtype"),
        (jnp.asarray(True), TypeError, "dtype"),
        (np.bool_(True), TypeError, "bool"),
        (True, TypeError, "bool"),
        (jnp.asarray(jnp.inf, jnp.float32), ValueError, "finite"),
        (float("nan"), ValueError, "finite"),
        ("0.5", TypeError, "scale"),
    ],
)  # fmt: skip
def test_bad_scale(scale, error, message):
    q, k, v = _qkv()
    with pytest.raises(error, match=message) as info:
        attnlib.attention(q, k, v, scale=scale)
    assert "scale" in str(info.value)


def test_traced_bool_and_int_scale_raise_under_jit():
    q, k, v = _qkv()
    for value in (jnp.asarray(True), jnp.asarray(3, jnp.int32)):
        with pytest.raises(TypeError, match="`scale`"):
            jax.jit(lambda s: attnlib.attention(q, k, v, scale=s))(value)


def test_traced_scale_with_fp8_is_declined():
    q, k, v = _qkv(h=16, hv=16)
    with pytest.raises(NotImplementedError, match="FP8"):
        jax.jit(lambda s: attnlib.attention(q, k, v, scale=s, fp8="current"))(jnp.float32(0.5))


# --- the real cuDNN -------------------------------------------------------------------------------------------------


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU with cuDNN")
@pytest.mark.parametrize("option", CUDNN_OPTIONS)
def test_cudnn_gpu_traced_scale(option):
    from attnlib._src.backends.cudnn import cache

    q, k, v = _qkv(jnp.bfloat16, h=64, hv=32)
    options = _options(option, jnp.bfloat16)
    loss = _loss("cudnn", **options)
    reference = _loss("xla", **options)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    for value in (0.3, 0.125, 1.1):
        got = step(q, k, v, jnp.float32(value))
        want = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(q, k, v, jnp.float32(value))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-2, atol=2e-2)
        for g, w in zip(got[1], want[1], strict=True):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            np.testing.assert_allclose(g, w, rtol=3e-2, atol=3e-2 * max(1.0, float(np.max(np.abs(w)))))
    del cache
