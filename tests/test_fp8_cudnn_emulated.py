"""CPU tests of the cuDNN FP8 wrapper (`fp8=` on `implementation="cudnn"`): quantization, the scale operands, the
dequantized output and the 16-bit backward, against an emulated `sdpa_fp8` graph.

`emulate_fp8` models cuDNN's FP8 forward from its documented contract (real = fp8 × descale; P quantized with
`scale_s`, O with `scale_o`, written as float8_e4m3fn; rows past the query lengths never written: NaN), and the 16-bit
graphs as `test_cudnn_dense_emulated.emulate`. The wrapper must then give the FP8 semantics of docs/fp8.md, checked
against the independent float64 reference `tests/reference.py::reference_fp8_attention` as `test_fp8.py` checks the
plain-JAX emulation, and gradients of attention at the dequantized inputs. What this cannot show is that cuDNN
behaves like the model: `test_fp8_gpu.py` checks that on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cudnn_emulation import install
from helpers import assert_close, normal, rng, Tol
from reference import reference_attention_vjp, reference_fp8_attention
from test_cudnn_dense_emulated import _unwritten, emulate
from test_cudnn_ragged import _mask
from test_fp8 import _inputs as fp8_inputs, _quantized, _ref_kwargs, assert_fp8_close

import attnlib
from attnlib._src import validation
from attnlib._src.backends.cudnn import support
from attnlib._src.backends.cudnn.graphs import GraphSpec, Uid


E4M3 = jnp.float8_e4m3fn
SPECS: list[GraphSpec] = []


def _e4m3(x):
    return jnp.clip(x, -448.0, 448.0).astype(E4M3)


def emulate_fp8(spec: GraphSpec, entry, *operands, tokens=None):
    """A plain-JAX `sdpa_fp8` forward graph (and the 16-bit graphs otherwise), in `spec.out_uids()` order."""
    SPECS.append(spec)
    if not spec.fp8:
        return emulate(spec, entry, *operands, tokens=tokens)
    vals = dict(zip(spec.in_uids(), operands, strict=True))
    scale = lambda uid: vals[uid].astype(jnp.float32)[0]
    b, t, s, g = spec.b, spec.t, spec.s, spec.n // spec.k
    seq_q = vals.get(Uid.SEQ_Q, jnp.full((b,), t, jnp.int32))
    seq_kv = vals.get(Uid.SEQ_KV, jnp.full((b,), s, jnp.int32))
    heads_first = lambda x, d: jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3)) * scale(d)
    q = heads_first(vals[Uid.Q], Uid.DESCALE_Q)
    k = jnp.repeat(heads_first(vals[Uid.K], Uid.DESCALE_K), g, axis=1)
    v = jnp.repeat(heads_first(vals[Uid.V], Uid.DESCALE_V), g, axis=1)
    logits = jnp.einsum("bnih,bnjh->bnij", q, k, precision="highest") * spec.scale
    logits = jnp.where(_mask(spec, seq_q, seq_kv), logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - m)
    p8 = _e4m3(p * scale(Uid.SCALE_S)).astype(jnp.float32) * scale(Uid.DESCALE_S)
    den = jnp.sum(p, axis=-1, keepdims=True)  # a row that sees nothing: 0 / 0 = NaN, as a careless kernel
    o = jnp.einsum("bnij,bnjh->bnih", p8, v, precision="highest") / den
    o8 = _e4m3(o * scale(Uid.SCALE_O))
    out = _unwritten(jnp.transpose(o8.astype(jnp.float32), (0, 2, 1, 3)), t, seq_q, False).astype(E4M3)
    stats = jnp.where(jnp.arange(t)[None, None, :] < seq_q[:, None, None], (m + jnp.log(den))[..., 0], jnp.nan)
    amaxes = (jnp.max(p)[None], jnp.max(jnp.abs(o))[None])
    return ((out, stats) if spec.stats else (out,)) + amaxes


@pytest.fixture
def emulated(monkeypatch):
    """Route dense `implementation="cudnn"` calls through `emulate_fp8`, as on an H200 with cuDNN 9.19."""
    SPECS.clear()
    return install(monkeypatch, emulate_fp8)


CASES = {
    "gqa_full": dict(t=37, s=53, h=32),
    "causal": dict(t=48, s=48, h=32, kw=dict(is_causal=True)),
    "bottom_right_t_gt_s": dict(t=45, s=29, h=16, kw=dict(is_causal=True, diagonal_alignment="bottom_right")),
    "padding": dict(t=40, s=56, h=32, kw=dict(query_seq_lengths=[40, 23], key_value_seq_lengths=[50, 0])),
    "window": dict(t=64, s=64, h=32, kw=dict(local_window_size=(9, 2))),
}


def _inputs(case, dtype, seed=0):
    return fp8_inputs(case, dtype, seed, cases={name: {**c, "hv": c["h"]} for name, c in CASES.items()})


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", list(CASES))
def test_current_matches_the_float64_reference(emulated, case, dtype):
    q, k, v, kw = _inputs(case, dtype)
    out, lse = attnlib.attention(q, k, v, fp8="current", implementation="cudnn", return_residual=True, **kw)
    assert [spec.fp8 for spec in SPECS] == [True], "one FP8 forward graph"
    assert out.dtype == dtype and out.shape == q.shape
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    r_out, r_lse = reference_fp8_attention(q8, k8, v8, scales=(dq, dk, dv), **_ref_kwargs(kw))
    assert_fp8_close(out, r_out, v8, dv, dtype)
    assert_close(np.asarray(lse, np.float64), r_lse, Tol(atol=2e-5, rtol=2e-6), what="lse")


def test_prequantized_inputs_equal_current_with_the_same_scales(emulated):
    q, k, v, kw = _inputs("causal", jnp.bfloat16)
    scales = [jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0 for x in (q, k, v)]
    q8, k8, v8 = ((x.astype(jnp.float32) / s).astype(E4M3) for x, s in zip((q, k, v), scales, strict=True))
    given = attnlib.Fp8Scales(q=scales[0], k=scales[1].reshape(1), v=scales[2], output_dtype=jnp.bfloat16)
    out = attnlib.attention(q8, k8, v8, fp8=given, implementation="cudnn", **kw)
    current = attnlib.attention(q, k, v, fp8="current", implementation="cudnn", **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(current, np.float32))


@pytest.mark.parametrize("case", ["causal", "padding", "bottom_right_t_gt_s"])
def test_gradients_are_those_of_attention_at_the_dequantized_inputs(emulated, case):
    """The 16-bit backward graph runs at q̂, k̂, v̂ with the FP8 forward's output and statistics; the quantizers are
    straight-through, so the gradient is attention's at the dequantized inputs up to the forward's rounding."""
    q, k, v, kw = _inputs(case, jnp.bfloat16, seed=3)
    d_out = normal(rng(4), q.shape, jnp.float32)
    loss = lambda q, k, v: jnp.sum(
        attnlib.attention(q, k, v, fp8="current", implementation="cudnn", **kw).astype(jnp.float32) * d_out
    )
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert [(spec.direction, spec.fp8, spec.dtype) for spec in SPECS] == [("fwd", True, "bfloat16"),
                                                                         ("bwd", False, "bfloat16")]  # fmt: skip
    (q8, dq), (k8, dk), (v8, dv) = _quantized(q), _quantized(k), _quantized(v)
    ref = reference_attention_vjp(q8 * dq, k8 * dk, v8 * dv, d_out=np.asarray(d_out, np.float64), **_ref_kwargs(kw))
    for name, g in zip(("query", "key", "value"), grads, strict=True):
        assert g.dtype == jnp.bfloat16
        expected = ref[name]
        err = np.max(np.abs(np.asarray(g, np.float64) - expected)) / np.max(np.abs(expected))
        assert err < 2.0**-3, f"d{name}: relative error {err:.3g}"


def test_vmap_gives_each_example_its_own_scales(emulated):
    q, k, v, kw = _inputs("causal", jnp.bfloat16)
    call = lambda q, k, v: attnlib.attention(q, k, v, fp8="current", implementation="cudnn", **kw)  # noqa: E731
    mapped = jax.jit(jax.vmap(call))(q[:, None], k[:, None], v[:, None])
    one = call(q[1:], k[1:], v[1:])
    np.testing.assert_array_equal(np.asarray(mapped[1], np.float32), np.asarray(one, np.float32))


def test_the_amax_outputs_survive_a_folded_vmap(emulated):
    """Mapping only the query (key, value and so every scale shared) folds the mapped axis into one graph call,
    whose amax outputs are per call."""
    q, k, v, _ = _inputs("causal", jnp.bfloat16)
    q8, k8, v8 = (x.astype(E4M3) for x in (q, k, v))
    one = jnp.float32(1.0)
    call = lambda q: attnlib.attention(  # noqa: E731
        q, k8, v8, fp8=attnlib.Fp8Scales(q=one, k=one, v=one), implementation="cudnn", is_causal=True
    )
    mapped = jax.vmap(call)(jnp.stack([q8, q8[::-1]]))
    assert [spec.b for spec in SPECS if spec.fp8][-1] == 4, "one folded graph call runs"
    np.testing.assert_array_equal(np.asarray(mapped[1], np.float32), np.asarray(call(q8[::-1]), np.float32))


def _config(dtype=jnp.bfloat16, h=64, hv=64, fp8="current", **kw):
    q = jax.ShapeDtypeStruct((1, 32, 4, h), dtype)
    v = jax.ShapeDtypeStruct((1, 32, 2, hv), dtype)
    k = jax.ShapeDtypeStruct((1, 32, 2, h), dtype)
    args = dict(
        scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
        return_residual=False, diagonal_alignment="top_left", q_segment_ids=None, kv_segment_ids=None,
        max_segments_per_row=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
        page_table=None, logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_key=None,
        deterministic_backward=False, fp8=fp8,
    )  # fmt: skip
    bias = kw.pop("bias", None)
    args.update(kw)
    return validation.validate(q, k, v, bias, None, **args)[0]


def test_policy_serves_fp8_on_hopper_and_names_each_limit():
    assert support.policy_reason(_config(is_causal=True), (9, 0), 91900) is None
    assert support.policy_reason(_config(is_causal=True), (10, 0), 91900) is None
    limits = {
        "compute capability 9.0": (_config(), (8, 9)),
        "H=64, Hv=32": (_config(hv=32), (9, 0)),
        "H=256": (_config(h=256, hv=256), (9, 0)),
        "multiples of 16": (_config(h=72, hv=72), (9, 0)),
        "`logits_soft_cap`": (_config(logits_soft_cap=30.0), (9, 0)),
        "a `bias`": (_config(bias=jax.ShapeDtypeStruct((1, 4, 32, 32), jnp.bfloat16)), (9, 0)),
        "`sinks`": (_config(sinks=jax.ShapeDtypeStruct((4,), jnp.float32)), (9, 0)),
        "float32": (_config(dtype=jnp.float32), (9, 0)),
        "needs Blackwell": (_config(is_causal=True, diagonal_alignment="bottom_right",
                                    key_value_seq_lengths=jax.ShapeDtypeStruct((1,), jnp.int32)), (9, 0)),
    }
    for needle, (config, capability) in limits.items():
        reason = support.policy_reason(config, capability, 91900)
        assert reason is not None and needle in reason, (needle, reason)


def test_an_fp8_graph_spec_with_dropout_cannot_be_built():
    """The graph builder never emits cuDNN's FP8 graph with dropout (it faulted on an H200), even past validation."""
    with pytest.raises(NotImplementedError, match="FP8 graph with dropout"):
        GraphSpec("fwd", "bfloat16", 1, 32, 32, 4, 4, 64, 64, 0.125, dropout=0.1, fp8=True)
    GraphSpec("fwd", "bfloat16", 1, 32, 32, 4, 4, 64, 64, 0.125, fp8=True)
    GraphSpec("fwd", "bfloat16", 1, 32, 32, 4, 4, 64, 64, 0.125, dropout=0.1)


@pytest.mark.parametrize("mode", ["current", "prequantized"])
def test_automatic_dispatch_on_a_gpu_without_fp8_runs_cudnn_in_16_bits_and_warns(monkeypatch, caplog, mode):
    """On a GPU whose cuDNN cannot run the call in FP8 (here: no FP8 tensor cores, sm_80), `implementation=None`
    runs the same call on cuDNN without quantization and says so; an explicit `implementation="cudnn"` refuses."""
    install(monkeypatch, emulate_fp8, capability=(8, 0))  # automatic dispatch's cuDNN: this emulated sm_80
    SPECS.clear()
    q, k, v, kw = _inputs("causal", jnp.bfloat16)
    if mode == "current":
        args, fp8 = (q, k, v), "current"
        plain = (q, k, v)
    else:
        scales = [jnp.float32(0.01), jnp.float32(0.005), jnp.float32(0.02)]
        args = tuple((x.astype(jnp.float32) / s).astype(E4M3) for x, s in zip((q, k, v), scales, strict=True))
        fp8 = attnlib.Fp8Scales(q=scales[0], k=scales[1], v=scales[2], output_dtype=jnp.float16)
        plain = tuple((x.astype(jnp.float32) * s).astype(jnp.float16) for x, s in zip(args, scales, strict=True))
    explanation = attnlib.explain(*args, fp8=fp8, **kw)
    assert explanation.implementation == "cudnn" and "FP8 tensor cores" in explanation.without_fp8
    assert "without FP8" in str(explanation)
    with caplog.at_level("WARNING", logger="attnlib"):
        out = attnlib.attention(*args, fp8=fp8, **kw)
    assert any("without FP8 quantization" in r.getMessage() for r in caplog.records)
    assert not any(spec.fp8 for spec in SPECS)
    expected = attnlib.attention(*plain, implementation="cudnn", **kw)
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    with pytest.raises(NotImplementedError, match="FP8 tensor cores"):
        attnlib.attention(*args, fp8=fp8, implementation="cudnn", **kw)
