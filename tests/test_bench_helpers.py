"""CPU checks of benchmark helpers whose results feed a decision (the per-kernel profile of `hlo_and_traces.py`, the
timing loops and checks of `harness.py`), of `bench_tpu.py` (its case table, FLOP convention and `--smoke` mode) and of
the `--smoke` modes of `bench_tpu_decode.py` and `bench_peers.py --suite decode`."""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def _load(name: str, monkeypatch):
    """`benchmarks/{name}.py` as a module, its imports of sibling scripts resolved as when it runs as a script."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_profile(monkeypatch):
    return _load("hlo_and_traces", monkeypatch)


def test_span_per_call_separates_calls_at_the_longest_gaps(monkeypatch):
    """Three calls of two kernels each: 10 us apart inside a call, 1000 us between calls."""
    profile = _kernel_profile(monkeypatch)
    intervals = []
    for call in range(3):
        start = call * 2000.0
        intervals += [(start, start + 5.0), (start + 15.0, start + 20.0 + call)]
    assert profile._span_per_call(intervals, 3) == pytest.approx((20.0 + 21.0 + 22.0) / 3)


def test_kernel_profile_reads_the_trace_on_the_cpu(monkeypatch):
    """On the CPU the jitted computation shows up on the host plane; the parser finds its events."""
    f = jax.jit(lambda x: jnp.sin(x) @ x)
    result = _kernel_profile(monkeypatch).kernel_profile(f, (jnp.ones((128, 128)),), calls=3, plane_prefix="/host:CPU")
    assert result["launches"] > 0 and result["kernel_us"] > 0
    assert any("sin" in kernel["name"] for kernel in result["kernels"])


def test_harness_timing_loops_and_reference_check(monkeypatch):
    """`best_per_call` and `time_calls` time a call; `checked` marks an output beyond the tolerance as wrong, rows
    outside `rows` not compared; `normal` draws as `jax.random.split` then `jax.random.normal` do."""
    harness = _load("harness", monkeypatch)
    f = jax.jit(lambda x: x + 1)
    assert harness.best_per_call(f, (jnp.ones(4),), loop=2, reps=2) > 0
    assert len(harness.time_calls(f, (jnp.ones(4),), loops=3, target_s=1e-4)) == 3
    reference = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert harness.tolerance(reference) == 4 * 2.0**-7 * 4  # 4 eps(bf16) max|ref|
    assert harness.checked(reference + 0.0625, reference, harness.tolerance(reference)) == {"max_err": 0.0625}
    out = reference + np.array([[0.0, 0.0], [1.0, 1.0]], np.float32)
    assert harness.checked(out, reference, 0.1)["wrong"] == "max |err| 1 > 0.1"
    assert "wrong" not in harness.checked(out, reference, 0.1, rows=np.array([[True], [False]]))
    q, k = harness.normal((2, 3), (4,), seed=1, dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(1), 2)
    assert (q == jax.random.normal(keys[0], (2, 3))).all() and (k == jax.random.normal(keys[1], (4,))).all()


def test_bench_tpu_case_table_and_flop_convention(monkeypatch):
    bench = _load("bench_tpu", monkeypatch)
    assert {name: (c.b, c.s, c.n, c.k, c.h, c.causal, c.window) for name, c in bench.CASES.items()} == {
        "mha_causal_4k": (4, 4096, 16, 16, 128, True, None),
        "mha_causal_16k": (1, 16384, 16, 16, 128, True, None),
        "gqa_causal_8k": (2, 8192, 32, 8, 128, True, None),
        "mha_full_2k": (8, 2048, 16, 16, 128, False, None),
        "gqa_window_8k": (2, 8192, 16, 4, 128, True, 1024),
        "small_512": (8, 512, 16, 16, 64, True, None),
    }
    small = bench.Case(1, 5, 1, 1, 2)
    assert bench.harness.visible_pairs(5) == 15  # 1 + 2 + 3 + 4 + 5
    assert bench.harness.visible_pairs(5, window=1) == 9  # 1 + 2 + 2 + 2 + 2
    assert bench.harness.visible_pairs(5, causal=False) == 25
    fwd, fwd_bwd = bench.flops(small)
    assert fwd == 2 * 15 * (2 + 2) and fwd_bwd == 3.5 * fwd


def test_bench_tpu_smoke_runs_one_case_on_the_cpu(tmp_path, monkeypatch):
    """`--smoke` on the CPU: splash interpreted, every variant checked against the reference before it is timed; an
    implementation this build lacks is reported, not fatal."""
    out = tmp_path / "bench.json"
    variants = ["attnlib", "attnlib_pallas_tpu", "attnlib_xla_chunked", "splash", "splash_grouped"]
    bench = _load("bench_tpu", monkeypatch)
    bench.main(["--smoke", "--only", "smoke_gqa_window", "--variants", *variants, "--flex-blocks", "64x128",
                "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["smoke"] and "visible" in result["flops"]
    row = result["cases"]["smoke_gqa_window"]
    assert row["attnlib_pick"] in ("xla_chunked", "xla", "pallas_tpu")
    assert set(row["variants"]) == {*variants, "attnlib_flex@64x128"}
    for label in ("attnlib", "attnlib_xla_chunked", "splash", "splash_grouped", "attnlib_flex@64x128"):
        r = row["variants"][label]
        assert r["max_err"] <= row["tolerance"], r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_tflops"] > 0, r
    pallas = row["variants"]["attnlib_pallas_tpu"]
    assert "fwd_ms" in pallas or "error" in pallas
    assert set(row["attnlib_vs_splash"]) == set(row["attnlib_vs_splash_grouped"]) == {"fwd", "fwd_bwd"}


def test_bench_splash_wirings_agree_on_segment_ids(monkeypatch):
    """Raw splash's two GQA wirings (the MQA kernel per key/value head, the MHA kernel over all heads) give the same
    result on one call with segment ids `[B, T]` (interpreted): the model benchmark's `splash` and `splash_grouped`."""
    bench = _load("bench_tpu", monkeypatch)
    case = bench.Case(2, 256, 4, 2, 64)
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 256, n, 64), jnp.bfloat16) for i, n in enumerate((4, 2, 2)))
    ids = jnp.asarray(np.repeat(np.array([[1, 2], [3, 3]]), 128, axis=1), jnp.int32)
    per_kv_head = bench.splash_fn(case, default=False, interpret=True, per_kv_head=True)(q, k, v, ids)
    grouped = bench.splash_fn(case, default=False, interpret=True, grouped=True)(q, k, v, ids)
    np.testing.assert_allclose(np.asarray(grouped, np.float32), np.asarray(per_kv_head, np.float32), atol=2e-2)
    plain = bench.splash_fn(case, default=False, interpret=True, grouped=True)(q, k, v)
    assert np.max(np.abs(np.asarray(plain, np.float32) - np.asarray(grouped, np.float32))) > 0.1  # the ids matter


def test_bench_tpu_feature_rows(tmp_path, monkeypatch):
    """The rows of what splash cannot serve: attnlib checked against its full-precision plain-JAX path, splash timed on
    its nearest call (not checked: another computation); the FLOPs count each feature's visible pairs."""
    bench = _load("bench_tpu", monkeypatch)
    assert bench.flops(bench.Case(1, 5, 1, 1, 2, causal=False, feature="prefix_lm"))[0] == 2 * 25 * 4  # all: 5 < 1024
    prefix_lm = bench.Case(1, 2048, 1, 1, 2, causal=False, feature="prefix_lm")
    assert bench.flops(prefix_lm)[0] == 2 * (2048 * 2049 // 2 + 1024 * 1023 // 2) * 4
    docs = bench.Case(1, 2048, 1, 1, 2, causal=False, feature="documents")
    assert bench.flops(docs)[0] == 2 * 4 * 512**2 * 4
    assert bench.flops(bench.Case(1, 5, 1, 1, 4, feature="mla", hv=2))[0] == 2 * 15 * (4 + 2)
    out = tmp_path / "bench.json"
    args = ["--smoke", "--only", "smoke_alibi", "smoke_bias", "--variants", "attnlib", "splash", "--json", str(out)]
    bench.main(args)
    for name, row in json.loads(out.read_text())["cases"].items():
        assert row["variants"]["attnlib"]["max_err"] <= row["tolerance"], name
        assert row["variants"]["attnlib"]["fwd_bwd_ms"] > 0 and row["variants"]["splash"]["fwd_ms"] > 0
        assert "unchecked" in row["variants"]["splash"]


def test_bench_tpu_decode_smoke_runs_on_the_cpu(tmp_path, monkeypatch):
    """`bench_tpu_decode.py --smoke`: attnlib's paged decode (head-major, token-major, xla) and the raw paged kernel
    in TPU interpret mode, each checked against the reference before it is timed."""
    bench = _load("bench_tpu_decode", monkeypatch)
    out = tmp_path / "decode.json"
    bench.main(["--smoke", "--json", str(out)])
    row = json.loads(out.read_text())["cases"]["smoke_gqa"]
    assert set(row["variants"]) == set(bench.DECODE_ONLY + bench.RAGGED_KERNEL)
    for name, r in row["variants"].items():
        if name in bench.RAGGED_KERNEL:
            assert "interpret mode cannot run" in r["skipped"]
            continue
        assert r["max_err"] <= row["tolerance"] and r["ms"] > 0, (name, r)


def test_bench_decode_smoke_runs_a_mixed_step_on_the_cpu(tmp_path, monkeypatch):
    """`bench_peers.py --suite decode --smoke`: a tiny mixed prefill + decode step, attnlib on a token-major cache and
    jax.nn on the same tokens as one dense call, each checked against the reference before it is timed; the variants
    that name cuDNN report their error off a GPU."""
    bench = _load("bench_peers", monkeypatch)
    out = tmp_path / "decode.json"
    with jax.numpy_dtype_promotion("standard"):  # as the script runs (jax.nn's XLA path mixes bfloat16 and float32)
        bench.main(["--suite", "decode", "--smoke", "--rounds", "1", "--mixed-layers", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["smoke"] and result["shapes"] == {}
    row = result["mixed"]["smoke_mixed"]
    assert set(row["variants"]) == {"attnlib", "attnlib_dense", *bench.MIXED_PEERS}
    on_gpu = jax.default_backend() == "gpu"
    assert row["attnlib_pick"] == ("cudnn" if on_gpu else "xla_chunked")
    for name, r in row["variants"].items():
        if "cudnn" in name and not on_gpu:
            assert "error" in r, (name, r)
            continue
        assert r["max_err"] <= row["tolerance"] and r["step_ms"] > 0 and r["step_ms_min_graph_1"] > 0, (name, r)
    assert row["speed_vs_best_peer"] > 0 and row["speed_vs_jax_nn"] > 0
