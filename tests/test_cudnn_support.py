"""CPU tests of the cuDNN support policy, the plan pinning and the blob guard (no GPU, no cuDNN import)."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

import attnlib
from attnlib._src.backends.cudnn import autotune, executor, graph_spec, graphs, support
from attnlib._src.config import AttentionConfig


H100 = ((9, 0), 91900)
BASE = AttentionConfig(
    layout="dense", batch_shape=(2,), unbatched=False, q_len=128, kv_len=128, num_q_heads=8, num_kv_heads=2,
    head_dim=128, value_head_dim=128, dtype=np.dtype("float16"),
    scale=0.125, is_causal=False, diagonal_alignment="top_left", window=None, bias_shape=None, mask_shape=None,
    has_q_lengths=False, has_kv_lengths=False, has_segments=False, max_segments_per_row=None, num_sequences=None,
    max_seqlen_q=None, max_seqlen_kv=None, page_size=None, pages_per_seq=None, num_pages=None, logits_soft_cap=None,
    has_sinks=False, dropout_rate=0.0, return_residual=False, deterministic_backward=False,
)


def _config(**changes) -> AttentionConfig:
    import jax.numpy as jnp

    changes.setdefault("dtype", np.dtype(jnp.bfloat16))
    return dataclasses.replace(BASE, **changes)


def _reason(config, capability=H100[0], version=H100[1]):
    return support.policy_reason(config, capability, version)


SUPPORTED = [
    ("plain", {}),
    ("float16", {"dtype": np.dtype("float16")}),
    ("causal_gqa", {"is_causal": True}),
    ("mla", {"head_dim": 192, "value_head_dim": 128}),
    ("d256", {"head_dim": 256, "value_head_dim": 256}),
    ("window", {"window": (63, 0), "is_causal": True}),
    ("two_sided_window", {"window": (16, 8)}),
    ("padding", {"has_q_lengths": True, "has_kv_lengths": True}),
    ("bias", {"bias_shape": (1, 8, 128, 128)}),
    ("sinks", {"has_sinks": True}),
    ("dropout", {"dropout_rate": 0.1}),
    ("bottom_right_t_lt_s", {"is_causal": True, "diagonal_alignment": "bottom_right", "q_len": 64}),
    ("bottom_right_t_gt_s_sliced", {"is_causal": True, "diagonal_alignment": "bottom_right", "kv_len": 64}),
    ("bottom_right_square_with_bias", {"is_causal": True, "diagonal_alignment": "bottom_right",
                                       "bias_shape": (128, 128)}),
    ("deterministic", {"deterministic_backward": True}),
    # A boolean mask reaches the graph as an additive bias; a soft cap as a score modifier holding every mask.
    ("mask", {"mask_shape": (128, 128)}),
    ("mask_padding_causal", {"mask_shape": (1, 1, 128, 128), "has_kv_lengths": True, "is_causal": True}),
    ("softcap", {"logits_soft_cap": 30.0}),
    ("softcap_causal_window_sinks_dropout", {"logits_soft_cap": 30.0, "is_causal": True, "window": (40, 0),
                                             "has_sinks": True, "dropout_rate": 0.1}),
    ("softcap_padding", {"logits_soft_cap": 30.0, "has_q_lengths": True, "has_kv_lengths": True}),
    ("softcap_bottom_right_t_gt_s", {"logits_soft_cap": 30.0, "is_causal": True, "diagonal_alignment": "bottom_right",
                                     "kv_len": 64}),
    ("softcap_window_t_gt_s", {"logits_soft_cap": 30.0, "window": (4, 4), "kv_len": 64}),
    ("softcap_mask", {"logits_soft_cap": 30.0, "mask_shape": (128, 128)}),
    # Packed rows or per-sequence alignment with a mask or modifier: the sequence structure is an additive bias.
    ("softcap_segments", {"has_segments": True, "logits_soft_cap": 30.0, "is_causal": True}),
    ("mask_segments", {"has_segments": True, "mask_shape": (128, 128)}),
    # Packed rows without `max_segments_per_row`: the bound is derived (concrete ids, or 16 under jit).
    ("segments_without_a_bound", {"has_segments": True}),
    ("softcap_padding_bottom_right_bias_route", {"logits_soft_cap": 30.0, "has_kv_lengths": True, "is_causal": True,
                                                  "diagonal_alignment": "bottom_right"}),
]


@pytest.mark.parametrize("changes", [c[1] for c in SUPPORTED], ids=[c[0] for c in SUPPORTED])
def test_supported_on_hopper(changes):
    assert _reason(_config(**changes)) is None


DECLINED = [
    ("thd", {"layout": "thd"}, "THD"),
    ("paged", {"layout": "paged"}, "page_table"),
    ("mask_thd", {"layout": "thd", "num_sequences": 2, "mask_shape": (128, 128)}, "boolean `mask` with THD"),
    ("softcap_thd", {"layout": "thd", "num_sequences": 2, "logits_soft_cap": 30.0}, "logits_soft_cap"),
    ("softcap_bias", {"logits_soft_cap": 30.0, "bias_shape": (128, 128)}, "bias"),
    ("mask_bottom_right", {"mask_shape": (64, 128), "is_causal": True, "diagonal_alignment": "bottom_right",
                           "q_len": 64}, "boolean `mask`"),
    ("float32", {"dtype": np.dtype("float32")}, "float32"),
    ("head_dim_not_multiple_of_8", {"head_dim": 36, "value_head_dim": 36}, "multiples of 8"),
    ("head_dim_above_256", {"head_dim": 320, "value_head_dim": 320}, "above 256"),
    ("t1_s1", {"q_len": 1, "kv_len": 1}, "T = S = 1"),
    ("sinks_decode", {"has_sinks": True, "q_len": 1}, "T = 1"),
    ("bottom_right_bias", {"is_causal": True, "diagonal_alignment": "bottom_right", "q_len": 64,
                           "bias_shape": (64, 128)}, "bias"),
    ("bottom_right_dropout", {"is_causal": True, "diagonal_alignment": "bottom_right", "q_len": 64,
                              "dropout_rate": 0.1}, "dropout"),
    ("bottom_right_t_gt_s_padding", {"is_causal": True, "diagonal_alignment": "bottom_right", "kv_len": 64,
                                     "has_kv_lengths": True}, "T > S"),
    ("bottom_right_t_gt_s_right_window", {"window": (4, 4), "diagonal_alignment": "bottom_right", "kv_len": 64},
     "T > S"),
    ("window_t_gt_s", {"window": (4, 0), "kv_len": 64}, "local_window_size"),
]


@pytest.mark.parametrize("changes,match", [(c[1], c[2]) for c in DECLINED], ids=[c[0] for c in DECLINED])
def test_declined_with_reason(changes, match):
    reason = _reason(_config(**changes))
    assert reason is not None and match in reason, reason
    assert reason.startswith("cudnn: ") and reason.endswith(".")


def test_architecture_and_version_limits():
    assert "compute capability 8.0" in _reason(_config(), (7, 5))
    assert "MLA" in _reason(_config(head_dim=192, value_head_dim=128), (8, 0))
    assert "above 128" in _reason(_config(head_dim=256, value_head_dim=256), (8, 9))
    assert _reason(_config(head_dim=192, value_head_dim=128), (10, 0)) is None
    assert "9.23" in _reason(_config(head_dim=256, value_head_dim=256), (10, 0), 92200)
    assert _reason(_config(head_dim=256, value_head_dim=256), (10, 0), 92300) is None
    assert "9.13" in _reason(_config(has_sinks=True), (9, 0), 91200)
    assert "cuDNN 9" in _reason(_config(), (9, 0), 8900)
    assert "bias or dropout" in _reason(_config(deterministic_backward=True, dropout_rate=0.1), (10, 0), 91900)


def test_decline_reason_on_this_machine_never_imports_cudnn():
    code = (
        "import sys, jax, jax.numpy as jnp, attnlib\n"
        "q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)\n"
        "e = attnlib.explain(q, q, q)\n"
        "has_gpu = any(d.platform == 'gpu' for d in jax.devices())\n"
        "assert has_gpu or 'cudnn' in e.declined, e\n"
        "assert has_gpu or 'cudnn' not in sys.modules, 'the cuDNN frontend was imported on a CPU machine'\n"
        "print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_backend_plan_indices_skip_python_engines():
    is_backend = lambda engine_id: 0 <= engine_id < 10000
    assert graphs.backend_plan_indices([5, 20001], is_backend) == [0]
    assert graphs.backend_plan_indices([20001, 20002, 7, 9], is_backend) == [2, 3]
    assert graphs.backend_plan_indices([20001, -1], is_backend) == [1]
    with pytest.raises(NotImplementedError, match="Python-engine"):
        graphs.backend_plan_indices([20001, 20002], is_backend)


@pytest.mark.parametrize("value, selection, wanted", [
    (None, "autotuned", 4), ("1", "autotuned", 4), ("0", "heuristics", 1), ("off", "heuristics", 1),
    ("False", "heuristics", 1), ("all", "autotuned_all", 1 << 30), (" ALL ", "autotuned_all", 1 << 30),
])  # fmt: skip
def test_autotune_switch_and_cache_key(monkeypatch, value, selection, wanted):
    if value is None:
        monkeypatch.delenv("ATTNLIB_CUDNN_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("ATTNLIB_CUDNN_AUTOTUNE", value)
    assert autotune.autotune_enabled() is (selection != "heuristics")
    device = support.Device(name="NVIDIA H200", compute_capability=(9, 0), cudnn_version=91900)
    spec = graphs.GraphSpec(direction="fwd", dtype="bfloat16", b=2, t=65, s=33, n=6, k=2, h=24, hv=40, scale=0.2)
    key = graphs.cache_key(spec, device)
    assert key["plan_selection"] == selection
    assert autotune._candidates_wanted(spec) == wanted
    mode = {"autotuned_all": "all"}.get(selection, selection)
    assert attnlib.Cudnn().autotune == mode  # the field's default reads the variable
    assert attnlib.Cudnn(autotune="heuristics").graph_executor() == executor.FfiExecutor(
        autotune="heuristics", cache_dir=attnlib.Cudnn().cache_dir
    )
    assert graphs.cache_key(spec, device, "heuristics")["plan_selection"] == "heuristics"


def test_cudnn_options_default_to_the_environment_and_are_checked(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLIB_CACHE_DIR", str(tmp_path))
    assert attnlib.Cudnn().cache_dir == str(tmp_path)
    monkeypatch.setenv("ATTNLIB_CACHE_DIR", "")
    assert attnlib.Cudnn().cache_dir is None  # memory only
    assert attnlib.Cudnn(cache_dir="/x") == attnlib.Cudnn(cache_dir="/x") != attnlib.Cudnn()
    with pytest.raises(ValueError, match="`autotune` must be"):
        attnlib.Cudnn(autotune="fast")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`ragged_stats` must be"):
        attnlib.Cudnn(ragged_stats="sometimes")  # pyright: ignore[reportArgumentType]


def test_timing_tensors_describe_every_graph_tensor():
    spec = graphs.GraphSpec(direction="bwd", dtype="float16", b=3, t=64, s=128, n=6, k=2, h=24, hv=40, scale=0.2,
                            padding=True, ragged=True, t_total=1024, s_total=1024)
    tensors = {uid: (size, data) for uid, size, data in autotune.timing_tensors(spec)}
    assert set(tensors) == {int(u) for u in spec.in_uids() + spec.out_uids()}
    assert tensors[int(graphs.Uid.Q)] == (3 * 64 * 6 * 24 * 2, b"")  # b full sequences of t tokens, zeros
    assert tensors[int(graphs.Uid.STATS)][0] == 3 * 6 * 64 * 4
    # Keys: 128 rows per sequence would exceed the backward's token capacity (1024 // 3 = 341 per sequence: fits).
    assert tensors[int(graphs.Uid.DV)][0] == 3 * 128 * 2 * 40 * 2
    seq_kv = np.frombuffer(tensors[int(graphs.Uid.SEQ_KV)][1], np.int32)
    np.testing.assert_array_equal(seq_kv, [128, 128, 128])
    off_v = np.frombuffer(tensors[int(graphs.Uid.OFF_V)][1], np.int64)  # little-endian int64 = (low, high) int32
    np.testing.assert_array_equal(off_v, np.arange(4) * 128 * 2 * 40)
    capped = dataclasses.replace(spec, b=16, s=512, s_total=1024)  # 16 sequences of 64 keys fill the capacity
    seq_kv = dict((u, d) for u, _, d in autotune.timing_tensors(capped))[int(graphs.Uid.SEQ_KV)]
    np.testing.assert_array_equal(np.frombuffer(seq_kv, np.int32), [64] * 16)
    paged = graphs.GraphSpec(direction="fwd", dtype="bfloat16", b=2, t=1, s=48, n=4, k=2, h=16, hv=16, scale=0.25,
                             padding=True, pages=(5, 16, 3))
    table = dict((u, d) for u, _, d in autotune.timing_tensors(paged))[int(graphs.Uid.PT_K)]
    np.testing.assert_array_equal(np.frombuffer(table, np.int32).reshape(2, 3), [[0, 1, 2], [3, 4, 0]])


def test_python_engine_blob_is_rejected():
    with pytest.raises(NotImplementedError, match="CUDNN_FE_PYPLAN"):
        graphs.check_blob(b"CUDNN_FE_PYPLAN\0{...}")
    graphs.check_blob(b"{U\x0cjson_version")


def test_graph_spec_uid_tables():
    spec = graphs.GraphSpec("bwd", "bfloat16", 2, 64, 96, 8, 2, 64, 32, 0.1, padding=True, bias_b=1, bias_n=8,
                            dropout=0.1, sinks=True, memset_rows=True)
    assert [int(u) for u in spec.in_uids()] == [1, 2, 3, 4, 6, 5, 10, 12, 13, 21, 22, 23]
    assert [int(u) for u in spec.out_uids()] == [7, 8, 9, 11]
    assert spec.zero_fill() == (0, 1, 2, 3)  # padded top-left: dQ, dK, dV rows past the lengths, and dBias
    assert dataclasses.replace(spec, memset_rows=False).zero_fill() == (3,)  # the default: cuDNN's zeros
    bottom_right = dataclasses.replace(spec, alignment="bottom_right")
    assert bottom_right.zero_fill() == (3,)  # rows that see no key are masked in JAX instead
    assert dataclasses.replace(spec, padding=False, direction="fwd").zero_fill() == ()
    assert spec.shape(graphs.Uid.V) == ((2, 96, 2, 32), "bfloat16")
    assert spec.shape(graphs.Uid.STATS) == ((2, 8, 64), "float32")
    dim, stride = graph_spec._layout(graphs.Uid.Q, spec)
    assert dim == [2, 8, 64, 64] and stride == [64 * 8 * 64, 64, 8 * 64, 1]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [None, (0, 0), (3, 0), (5, 2), (2, 7)], ids=str)
def test_trimmed_query_lengths_keep_exactly_the_rows_that_see_a_key(causal, window):
    """Padded top-left graphs get trimmed query lengths instead of a masking pass: the rows below them must be
    exactly the rows that exist and see a key, for every pair of lengths."""
    import jax.numpy as jnp

    from attnlib._src.backends.cudnn import attention as dense

    T, S = 13, 9
    config = dataclasses.replace(
        BASE, q_len=T, kv_len=S, is_causal=causal, window=window, has_q_lengths=True, has_kv_lengths=True,
        batch_shape=((T + 1) * (S + 1),),
    )
    plan = dense.make_plan(config, (T + 1) * (S + 1), T, None)
    # No memset: cuDNN writes zeros past the trimmed lengths (`probe_unwritten_rows.py`).
    assert plan.rows_by_length and plan.fwd.zero_fill() == () and plan.bwd.zero_fill() == ()
    q_len, kv_len = (jnp.asarray(x.ravel(), jnp.int32) for x in np.meshgrid(np.arange(T + 1), np.arange(S + 1)))
    valid = np.asarray(dense._row_valid(plan, q_len, kv_len))[..., 0]  # [B, T, 1]: one row mask for every head
    trimmed = np.asarray(dense._graph_seq_q(plan, q_len, kv_len))
    np.testing.assert_array_equal(valid, np.arange(T)[None, :] < trimmed[:, None])
    # A sequence without keys runs with one key and no query rows, so cuDNN writes its rows as zeros.
    graph_kv = np.asarray(dense._graph_seq_kv(plan, kv_len))
    np.testing.assert_array_equal(graph_kv, np.maximum(np.asarray(kv_len), 1))
    assert np.all(trimmed[np.asarray(kv_len) == 0] == 0)
    assert 0 < valid.sum() < valid.size  # the grid has rows that see no key and rows that do


def test_bottom_right_padded_graphs_mask_rows_instead():
    from attnlib._src.backends.cudnn import attention as dense

    config = dataclasses.replace(
        BASE, is_causal=True, diagonal_alignment="bottom_right", has_q_lengths=True, has_kv_lengths=True
    )
    plan = dense.make_plan(config, 2, 128, None)
    assert not plan.rows_by_length and plan.fwd.zero_fill() == () and plan.bwd.zero_fill() == ()


def test_score_mod_policies():
    """Dense calls with a score_mod are served when cuDNN can express them; otherwise the reason names why."""
    import jax.numpy as jnp

    from attnlib._src import modifiers

    def config(score_mod=None, mask_mod=None, args=(), **changes):
        return _config(modifiers=modifiers.describe(score_mod, mask_mod, args), **changes)

    alibi = lambda s, b, h, i, j, slope: s - slope * jnp.abs(i - j).astype(jnp.float32)
    assert _reason(config(alibi, args=(jnp.ones((8, 1, 1)),), is_causal=True)) is None
    assert _reason(config(mask_mod=lambda b, h, i, j: i // 16 == j // 16, logits_soft_cap=30.0)) is None
    assert "exp" in _reason(config(lambda s, b, h, i, j: jnp.exp(s)))
    assert "batch dims" in _reason(config(alibi, args=(jnp.ones((2, 8, 1, 1)),), batch_shape=(2,)))
    masked = lambda s, b, h, i, j: jnp.where(j <= i, s, -jnp.inf)
    assert _reason(config(masked)) is None
    assert "-inf" in _reason(config(masked, logits_soft_cap=30.0))
    assert "bias" in _reason(config(mask_mod=lambda b, h, i, j: j <= i, bias_shape=(128, 128)))
    reads_q = lambda b, h, i, j: i // 16 == j // 16
    assert "q_idx" in _reason(config(mask_mod=reads_q, has_segments=True))
    assert "q_idx" in _reason(config(mask_mod=reads_q, has_kv_lengths=True, diagonal_alignment="bottom_right"))
    assert _reason(config(mask_mod=lambda b, h, i, j: h > 0, has_segments=True, is_causal=True)) is None


def test_graph_rejected_at_build_falls_back_unless_named_alone(monkeypatch, caplog):
    """A cuDNN graph that the policy accepted but cuDNN refuses at build time: an automatic choice (or a sequence)
    runs the next implementation and logs it; `implementation="cudnn"` alone raises."""
    import logging

    import jax.numpy as jnp

    import attnlib
    from attnlib._src import dispatch

    @dataclasses.dataclass(frozen=True)
    class Refusing:  # a graph executor (`attnlib.Cudnn(executor=...)`) whose cuDNN refuses every graph
        def get_entry(self, spec):
            raise graphs.GraphRejected("cudnn: cuDNN rejected the fwd graph (test): no engine")

        def call(self, spec, entry, *operands, tokens=None):
            raise AssertionError("no graph was built")

    device = support.Device(compute_capability=(9, 0), name="NVIDIA H200", cudnn_version=91900)
    refusing = attnlib.Cudnn(executor=Refusing(), device=device)
    monkeypatch.setitem(dispatch.REGISTRY, "cudnn", lambda: refusing)
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    expected = attnlib.attention(q, q, q, implementation="xla")
    with caplog.at_level(logging.WARNING, logger="attnlib"):
        out = attnlib.attention(q, q, q)  # the next candidate in the automatic order: xla_chunked
    np.testing.assert_array_equal(np.asarray(out), np.asarray(attnlib.attention(q, q, q, implementation="xla_chunked")))
    assert any("failed to build its kernel" in r.getMessage() for r in caplog.records)
    out = attnlib.attention(q, q, q, implementation=["cudnn", "xla"])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    with pytest.raises(graphs.GraphRejected, match="no engine"):
        attnlib.attention(q, q, q, implementation="cudnn")
