"""The Llama-shaped models of `examples/`: the Haiku model (`llama_haiku.py`) equals the Equinox one (`llama.py`) on
the same weights, `train.py` trains both, and `benchmarks/bench_model.py` runs (`--smoke`) and counts FLOPs as its
docstring says; `benchmarks/hlo_and_traces.py`, which it reports with, finds the transposes and copies next to a custom
call in compiled HLO and sums a trace's device ops."""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib


eqx = pytest.importorskip("equinox")
hk = pytest.importorskip("haiku")
optax = pytest.importorskip("optax")

_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(_ROOT / "examples"), str(_ROOT / "benchmarks")]  # the benchmarks import each other as scripts
import data  # noqa: E402
import hlo_and_traces  # noqa: E402
import llama  # noqa: E402
import llama_haiku  # noqa: E402
import train  # noqa: E402


def _bench_model():
    spec = importlib.util.spec_from_file_location("bench_model", _ROOT / "benchmarks" / "bench_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _packed_batch():
    """Two rows of 24 tokens: documents of 9, 7, 5 tokens + 3 padding, and of 13 and 11."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 97, (2, 24)).astype(np.int32)
    segments = np.array([[1] * 9 + [2] * 7 + [3] * 5 + [0] * 3, [1] * 13 + [2] * 11], np.int32)
    return tokens, segments


def test_haiku_equals_equinox_on_the_same_weights():
    """Same weights (converted with `params_from_equinox`): the same parameter tree as Haiku's own init, and logits,
    loss and gradients equal to float32 rounding, on packed documents with padding, a sliding window and per-block
    remat."""
    config = llama.LlamaConfig(sliding_window=4, remat=True, dtype=jnp.float32)
    model = llama.Llama(config, key=jax.random.key(0))
    params = llama_haiku.params_from_equinox(model)
    hk_model = llama_haiku.transform(config)
    tokens, segments = _packed_batch()
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(params) == shapes(jax.eval_shape(hk_model.init, jax.random.key(1), tokens, segments))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))

    def hk_loss(params):
        logits = hk_model.apply(params, tokens, segments)
        return llama_haiku.next_token_loss(logits, tokens, segments), logits

    def eqx_loss(model):
        logits = model(tokens, segments)
        return llama.loss(model, tokens, segments), logits

    grad_hk = jax.value_and_grad(hk_loss, has_aux=True)
    assert str(jax.make_jaxpr(grad_hk)(params)).count("remat") >= config.num_layers  # hk.remat per block
    (loss_hk, logits_hk), grads_hk = jax.jit(grad_hk)(params)
    (loss_eqx, logits_eqx), grads_eqx = eqx.filter_jit(eqx.filter_value_and_grad(eqx_loss, has_aux=True))(model)
    assert logits_eqx.dtype == logits_hk.dtype == jnp.float32
    np.testing.assert_allclose(logits_hk, logits_eqx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_hk, loss_eqx, rtol=1e-6)
    expected = llama_haiku.params_from_equinox(grads_eqx)
    for (path, g), e in zip(jax.tree.leaves_with_path(grads_hk), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_remat_takes_a_name_or_a_policy():
    """`LlamaConfig.remat`: False, True ("full"), a name of `REMAT_POLICIES` or a `jax.checkpoint` policy; anything
    else is refused at construction, naming the argument."""
    assert llama.remat_policy(llama.LlamaConfig()) == (False, None)
    assert llama.remat_policy(llama.LlamaConfig(remat=True)) == (True, jax.checkpoint_policies.nothing_saveable)
    keep = attnlib.checkpoint_policies.save_attention
    assert llama.remat_policy(llama.LlamaConfig(remat="save_attention")) == (True, keep)
    assert llama.remat_policy(llama.LlamaConfig(remat=keep)) == (True, keep)
    with pytest.raises(ValueError, match="`remat` must be.*'save_attention'.*Got 'attention'"):
        llama.LlamaConfig(remat="attention")
    with pytest.raises(TypeError, match="`remat` must be.*Got 3"):
        llama.LlamaConfig(remat=3)


def test_tied_head_has_no_head_parameter():
    config = llama.LlamaConfig(tie_embeddings=True)
    params = llama_haiku.params_from_equinox(llama.Llama(config, key=jax.random.key(0)))
    tokens, segments = _packed_batch()
    own = jax.eval_shape(llama_haiku.transform(config).init, jax.random.key(1), tokens, segments)
    assert set(params["llama"]) == set(own["llama"]) == {"embed"}
    assert jax.tree.structure(params) == jax.tree.structure(own)


def test_pack_fills_rows_and_restarts_segments():
    tokens, segments = data.pack([b"abc", b"de", b"fghij", b"k"], seq_len=4)
    np.testing.assert_array_equal(tokens[0], np.frombuffer(b"abcd", np.uint8))
    np.testing.assert_array_equal(segments, [[1, 1, 1, 2], [1, 2, 2, 2], [1, 1, 2, 0]])
    assert tokens[2, 3] == 0  # padding
    docs = data.load_documents()  # the repository's docs/*.md, split at headings
    assert len(docs) > 20 and all(isinstance(d, bytes) for d in docs)


@pytest.mark.parametrize("framework", ["equinox", "haiku"])
def test_train_tiny_decreases_the_loss(framework, capsys):
    """`train.py --tiny`: a few AdamW steps on packed byte-level documents (bfloat16 compute, float32 parameters)."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes int32 step counts and Python floats
        losses = train.main(["--tiny", "--framework", framework, "--steps", "6", "--seed", "1"])
    assert len(losses) == 6 and np.isfinite(losses).all()
    assert losses[0] > np.log(256) - 1.0  # starts near chance
    assert min(losses[-2:]) < losses[0] - 0.5, losses
    out = capsys.readouterr().out
    assert "step    5  loss" in out and "tokens/s" in out


def test_bench_model_flop_count_and_configs():
    bench = _bench_model()
    flops = bench.model_flops(
        bench.CONFIGS["llama_492m_1x8k"], bench.param_shapes(bench.CONFIGS["llama_492m_1x8k"]), None
    )
    assert 490e6 < flops["params"] < 495e6
    T = 8192
    assert flops["visible_pairs"] == T * (T + 1) // 2
    assert flops["dense"] == 6 * flops["matmul_params"] * T
    assert flops["matmul_params"] == flops["params"] - 32_000 * 2048 - (2 * 8 + 1) * 2048
    assert flops["attention"] == pytest.approx(12 * 8 * T**2 * 2048 / 2, rel=1e-3)
    one_b = bench.CONFIGS["llama_1b_4k"]
    assert 1.0e9 < bench.model_flops(one_b, bench.param_shapes(one_b), None)["params"] < 1.1e9
    assert bench.visible_pairs(np.array([[1, 1, 1, 2, 2]]), 1, 5, None) == 6 + 3
    assert bench.visible_pairs(None, 2, 5, 1) == 2 * (1 + 2 + 2 + 2 + 2)
    _, segments = bench.make_batch(bench.CONFIGS["packed_4x2k"])
    assert segments.shape == (4, 2048) and (segments > 0).all()
    assert all(3 <= row.max() <= 16 for row in segments)  # several documents a row, within cuDNN's default bound


def test_layout_ops_finds_transposes_next_to_a_custom_call():
    """A transposed operand of a custom call (a CPU callback here) is found; the untransposed one is not. A wrapped
    computation (as a GPU command buffer) is followed in and out."""
    callback = lambda y: np.asarray(y) + 1

    def call(transpose):
        def f(x, w):
            q = jnp.einsum("btd,dnh->btnh", x, w)
            q = jnp.transpose(q, (0, 2, 1, 3)) if transpose else q
            return jax.pure_callback(callback, jax.ShapeDtypeStruct(q.shape, q.dtype), q).sum()

        text = jax.jit(f).lower(jnp.ones((2, 8, 4)), jnp.ones((4, 3, 5))).compile().as_text()
        return hlo_and_traces.layout_ops(text, targets="callback")

    transposed, direct = call(True), call(False)
    assert transposed["attention_calls"] == direct["attention_calls"] == 1
    assert transposed["feeding"]["standalone"] + transposed["feeding"]["in_fusion"] == 1, transposed
    assert direct["feeding"] == {"standalone": 0, "standalone_bytes": 0, "in_fusion": 0}, direct
    assert direct["transposes"] == 0, direct

    wrapped = """
%command_buffer (p0: bf16[1,8,2,4], p1: bf16[1,8,2,4]) -> (bf16[1,8,2,4], u8[16]) {
  %p0 = bf16[1,8,2,4]{3,2,1,0} parameter(0)
  %p1 = bf16[1,8,2,4]{3,2,1,0} parameter(1)
  %cc = (bf16[1,8,2,4]{3,2,1,0}, u8[16]{0}) custom-call(%p0, %p1, %p1), custom_call_target="attnlib_cudnn_graph"
  %out = bf16[1,8,2,4]{3,2,1,0} get-tuple-element(%cc), index=0
  %ws = u8[16]{0} get-tuple-element(%cc), index=1
  ROOT %t = (bf16[1,8,2,4]{3,2,1,0}, u8[16]{0}) tuple(%out, %ws)
}

ENTRY %main (x: bf16[1,2,8,4], y: bf16[1,8,2,4]) -> bf16[1,2,8,4] {
  %x = bf16[1,2,8,4]{3,2,1,0} parameter(0)
  %y = bf16[1,8,2,4]{3,2,1,0} parameter(1)
  %copy.1 = bf16[1,8,2,4]{3,2,1,0} copy(%x)
  %call = (bf16[1,8,2,4]{3,2,1,0}, u8[16]{0}) call(%copy.1, %y), to_apply=%command_buffer
  %g = bf16[1,8,2,4]{3,2,1,0} get-tuple-element(%call), index=0
  ROOT %tr = bf16[1,2,8,4]{3,2,1,0} transpose(%g), dimensions={0,2,1,3}
}
"""
    found = hlo_and_traces.layout_ops(wrapped)
    assert found["attention_targets"] == ["attnlib_cudnn_graph"]
    tensor = 1 * 8 * 2 * 4 * 2  # bytes of a bf16[1,8,2,4]
    assert found["feeding"] == {"standalone": 1, "standalone_bytes": tensor, "in_fusion": 0}, found
    assert found["consuming"] == {"standalone": 1, "standalone_bytes": tensor, "in_fusion": 0}, found
    assert (found["transposes"], found["copies"]) == (1, 1)


def test_bench_model_swaps_only_the_attention_core():
    """`build(framework, config, core)`: every layer of either model calls the given core (on `[B, T, N, H]` and
    `[B, T, K, H]`, with the segment ids), from the same weights in both frameworks."""
    bench = _bench_model()
    config = bench.SMOKE_CONFIGS["smoke_packed"]
    tokens, segments = bench.make_batch(config)
    m = config.model
    for framework in bench.FRAMEWORKS:
        calls = []

        def core(q, k, v, segment_ids):
            calls.append((q.shape, k.shape, v.shape, segment_ids.shape))
            return jnp.repeat(v, m.num_heads // m.num_kv_heads, axis=2)

        params, loss_fn = bench.build(framework, config, core)
        jax.make_jaxpr(loss_fn)(params, tokens, segments)
        q, kv = (
            (config.batch, config.seq, m.num_heads, m.head_dim),
            (config.batch, config.seq, m.num_kv_heads, m.head_dim),
        )
        assert calls == [(q, kv, kv, (config.batch, config.seq))] * m.num_layers, framework
    eqx_params, _ = bench.build("equinox", config, None)
    hk_params, _ = bench.build("haiku", config, None)
    assert sorted(x.size for x in jax.tree.leaves(eqx_params)) == sorted(x.size for x in jax.tree.leaves(hk_params))


_HLO = """HloModule step

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %splash_mha_fwd_residuals.3 = (f32[8]{0}, f32[8]{0}) custom-call(f32[8]{0} %p), custom_call_target="tpu_custom_call"
  %get-tuple-element.1 = f32[8]{0} get-tuple-element((f32[8]{0}, f32[8]{0}) %splash_mha_fwd_residuals.3), index=0
  %sort.4 = f32[8]{0} custom-call(f32[8]{0} %p), custom_call_target="TopK"
  ROOT %fusion.2 = f32[8]{0} fusion(f32[8]{0} %get-tuple-element.1, f32[8]{0} %sort.4), kind=kLoop, calls=%fused
}
"""


def test_device_op_times_sums_the_device_ops_and_the_attention_kernels():
    """Events as a TPU trace has them (each named by its HLO line) on the device's "XLA Ops" line, two steps: the
    per-step device time, and the attention custom calls' part (another custom call is not attention; host planes
    and other lines do not count)."""
    from types import SimpleNamespace as NS

    line = lambda name, *events: NS(name=name, events=[NS(name=n, duration_ns=ms * 1e6) for n, ms in events])
    ops = line(
        "XLA Ops",
        ('%splash_mha_fwd_residuals.3 = (f32[8]{0}, f32[8]{0}) custom-call(f32[8]{0} %p), custom_call_target="t"', 3),
        ('%splash_mha_fwd_residuals.3 = (f32[8]{0}, f32[8]{0}) custom-call(f32[8]{0} %p), custom_call_target="t"', 2),
        ("%fusion.2 = f32[8]{0} fusion(f32[8]{0} %get-tuple-element.1), kind=kLoop", 4),
        ('%sort.4 = f32[8]{0} custom-call(f32[8]{0} %p), custom_call_target="TopK"', 1),
    )
    planes = [
        NS(name="/device:TPU:0", lines=[ops, line("XLA Modules", ("jit_step", 100))]),
        NS(name="/host:CPU", lines=[line("XLA Ops", ("%fusion.2", 50))]),
    ]
    times = hlo_and_traces.device_op_times(planes, _HLO, steps=2)
    assert times == {
        "device_ms": 5.0,
        "attention_ms": 2.5,
        "attention_share": 0.5,
        "attention_kernels_ms": {"splash_mha_fwd_residuals": 2.5},
    }
    assert "skipped" in hlo_and_traces.device_op_times(planes[1:], _HLO, steps=2)


def test_bench_model_smoke_writes_json(tmp_path):
    """`--smoke` on the CPU (the Haiku model; the Equinox one takes the same path): attnlib and jax.nn train the tiny
    packed config with equal losses; the GPU and TPU variants are recorded as skipped, with the reason."""
    out = tmp_path / "model.json"
    with jax.numpy_dtype_promotion("standard"):
        _bench_model().main(
            ["--smoke", "--only", "smoke_packed", "--framework", "haiku", "--profile", "--json", str(out)]
        )
    result = json.loads(out.read_text())
    assert result["smoke"] and "6 P tokens" in result["flops"] and "versions" in result
    assert result["remat"] == "save_attention"
    row = result["configs"]["smoke_packed"]
    assert {"model", "batch", "seq", "flops", "attnlib_pick", "frameworks", "documents_per_row"} <= set(row)
    assert row["attnlib_pick"] in ("xla", "xla_chunked")
    assert set(row["frameworks"]) == {"haiku"}
    variants = row["frameworks"]["haiku"]["variants"]
    assert set(variants) == {"attnlib", "jax_nn", "jax_nn_cudnn", "splash", "splash_grouped", "tokamax"}
    for name in ("jax_nn_cudnn", "splash", "splash_grouped", "tokamax"):
        assert "skipped" in variants[name], variants[name]
    for name in ("attnlib", "jax_nn"):
        r = variants[name]
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["mfu"] is None, r
        assert len(r["losses"]) == result["warmup"] + result["steps"] and np.isfinite(r["losses"]).all()
        assert {"compile_s", "compiled_bytes", "peak_bytes_in_use", "hlo", "attention_core"} <= set(r)
        assert {"transposes", "copies", "attention_calls", "feeding", "consuming"} <= set(r["hlo"])
        assert r["attention_core"]["fwd_ms"] > 0 and 0 < r["attention_core"]["share_of_step"]
        assert r["max_loss_diff_vs_attnlib"] < 0.05  # bfloat16 noise
        assert r["profile"] == {"skipped": "the trace has no device 'XLA Ops' line on this backend"}  # a CPU trace
    assert variants["attnlib"]["attention_mask"] == "segment ids"
    assert variants["jax_nn"]["attention_mask"].startswith("dense")
    assert row["frameworks"]["haiku"]["max_loss_diff_vs_attnlib"] == variants["jax_nn"]["max_loss_diff_vs_attnlib"]


def test_bench_model_optimizers():
    """`--optimizer sgd` steps by `-LEARNING_RATE * grad`; `adamw` is `train.make_optimizer`'s; an unknown name is
    refused."""
    bench = _bench_model()
    params = {"w": np.asarray([1.0, -2.0], np.float32)}
    grads = {"w": np.asarray([0.5, 4.0], np.float32)}
    sgd, adamw = bench.make_optimizer("sgd", 5), bench.make_optimizer("adamw", 5)
    with jax.numpy_dtype_promotion("standard"):  # optax's schedules, as in the smoke run
        updates, _ = sgd.update(grads, sgd.init(params), params)
        np.testing.assert_allclose(updates["w"], -bench.LEARNING_RATE * grads["w"], rtol=1e-6)
        updates, _ = adamw.update(grads, adamw.init(params), params)
    assert not np.allclose(updates["w"], -bench.LEARNING_RATE * grads["w"])  # AdamW's first (warm-up) step differs
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        bench.make_optimizer("adam", 5)
