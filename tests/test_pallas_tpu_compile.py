"""`attnlib.PallasTpu` compiled for a TPU v5e with no TPU attached: Mosaic lowers and libtpu compiles every kernel call.

Interpret mode (`test_pallas_tpu.py`, `test_pallas_tpu_paged.py`) checks the numbers on a CPU but not what only the
TPU compiler checks (block shapes, VMEM, Mosaic's layouts). With `libtpu` installed (`pip install "jax[tpu]"`) JAX
compiles ahead of time for a TPU topology without one (`jax.experimental.topologies`): these tests compile the same
feature cases, JAX's paged-attention decode and the benchmark shapes (`benchmarks/bench_tpu.py`) for one v5e chip
of a `v5e:2x2` topology, check that the compiled program holds the Mosaic kernels (not a fallback) and, for the
benchmark shapes, that it fits the chip's 15.7 GiB. Serving on a mesh (a ragged step on a cache split over its
key/value heads): each chip's call as attnlib's rule splits it compiles for a v5e chip, and the step on a `v5e:2x4`
slice compiles inside `jax.shard_map` with no all-gather; the same step under plain `jit` waits on libtpu reaching
`custom_partitioning` (jax-ml/jax#38196: xfails until then). Nothing runs: the numbers are the interpret-mode and `tpu`
tests' job. Skipped without libtpu and on a machine with a TPU (the `tpu` tests run there); `.ci/run` installs
libtpu in a venv of its own and runs this file there with `ATTNLIB_REQUIRE_LIBTPU=1` (a skip fails).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
import test_pallas_tpu as dense_cases
import test_pallas_tpu_paged as paged_cases
from helpers import on_a_simulated_tpu

import attnlib


pytestmark = pytest.mark.tpu_compile  # skipped without libtpu and on a TPU machine (conftest.py)

V5E_HBM_BYTES = int(15.7 * 2**30)
MOSAIC = "tpu_custom_call"


@pytest.fixture(scope="module")
def v5e_chip() -> jax.sharding.Sharding:
    """One chip of a deviceless `v5e:2x2` topology (the smallest libtpu describes for a v5e)."""
    from jax.experimental import topologies

    with pytest.MonkeyPatch.context() as env:
        # libtpu takes a machine-wide lock when it loads; no chip is used here, so pytest-xdist workers may share it.
        env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        devices = topologies.get_topology_desc("v5e:2x2", "tpu").devices
    # (`jax.sharding.SingleDeviceSharding` itself is deprecated in JAX 0.12.1)
    return jax.sharding.make_single_device_sharding(devices[0])


@pytest.fixture(autouse=True)
def compile_for_a_tpu(monkeypatch):
    """`PallasTpu()` serves when a TPU is visible; here the program is lowered for one that is not attached."""
    on_a_simulated_tpu(monkeypatch)


def _abstract(x: jax.Array, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _compile(fn, args, sharding):
    """`(lowered text, compiled)` of `jax.jit(fn)` for the TPU chip `sharding` names."""
    lowered = jax.jit(fn).trace(*(_abstract(x, sharding) for x in args)).lower()
    return lowered.as_text(), lowered.compile()


def _gradient_program(case, implementation):
    """`(fn, primals)`: the gradients of a loss that reads both `out` and the finite `lse`, with respect to query,
    key, value (and the sinks where the case has them)."""
    q, k, v = dense_cases._arrays(case, jnp.bfloat16)
    kw = dense_cases._kwargs(case)
    sinks = kw.pop("sinks", None)
    primals = (q, k, v) if sinks is None else (q, k, v, sinks)

    def loss(q, k, v, *sinks):
        kw_sinks = dict(sinks=sinks[0]) if sinks else {}
        out, lse = attnlib.attention(q, k, v, implementation=implementation, return_residual=True, **kw, **kw_sinks)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.grad(loss, argnums=tuple(range(len(primals)))), primals


@pytest.mark.parametrize("name", list(dense_cases.CASES))
def test_feature_cases_compile_for_a_v5e(name, v5e_chip):
    """Every interpret-mode feature case in bfloat16: the gradients through `out` and `lse` (three Mosaic kernel
    calls: the forward with residuals, dK/dV, dQ), and the forward that drops `lse` (one call)."""
    case = dense_cases.CASES[name]
    fn, primals = _gradient_program(case, attnlib.PallasTpu())
    text, _ = _compile(fn, primals, v5e_chip)
    assert text.count(MOSAIC) == 3, text.count(MOSAIC)
    kw = dense_cases._kwargs(case)
    text, _ = _compile(lambda q, k, v: attnlib.attention(q, k, v, implementation=attnlib.PallasTpu(), **kw),
                       dense_cases._arrays(case, jnp.bfloat16), v5e_chip)  # fmt: skip
    assert text.count(MOSAIC) == 1, text.count(MOSAIC)


@pytest.mark.parametrize("name", list(paged_cases.CASES))
def test_paged_decode_compiles_for_a_v5e(name, v5e_chip):
    """JAX's paged-attention kernel on attnlib's operands (pages of at least 16 tokens, as a TPU takes them)."""
    case = paged_cases._on_tpu(paged_cases.CASES[name])
    q, k, v, table, lengths = paged_cases._arrays(case)
    kw = paged_cases._kwargs(case, table, lengths)
    kw.pop("page_table"), kw.pop("key_value_seq_lengths")

    def decode(q, k, v, table, lengths):
        return attnlib.attention(q, k, v, page_table=table, key_value_seq_lengths=lengths,
                                 implementation=attnlib.PallasTpu(), **kw)  # fmt: skip

    text, _ = _compile(decode, (q, k, v, table, lengths), v5e_chip)
    assert text.count(MOSAIC) == 1, text.count(MOSAIC)


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_decode_page_and_head_sizes_compile_for_a_v5e(page_size, head_dim, v5e_chip):
    """A 4096-token cache per sequence, GQA 32/8, every page size a TPU takes and the usual head dims."""
    B, pages_per_seq = 8, 4096 // page_size
    q = jnp.zeros((B, 1, 32, head_dim), jnp.bfloat16)
    pool = jnp.zeros((B * pages_per_seq + 3, page_size, 8, head_dim), jnp.bfloat16)
    table, lengths = jnp.zeros((B, pages_per_seq), jnp.int32), jnp.zeros((B,), jnp.int32)

    def decode(q, k, v, table, lengths):
        return attnlib.attention(q, k, v, page_table=table, key_value_seq_lengths=lengths, is_causal=True,
                                 diagonal_alignment="bottom_right", implementation=attnlib.PallasTpu())  # fmt: skip

    text, _ = _compile(decode, (q, pool, pool, table, lengths), v5e_chip)
    assert text.count(MOSAIC) == 1


BENCHMARK_SHAPES = {  # benchmarks/bench_tpu.py's cases: (B, T, N, K, H, kwargs)
    "mha_causal_4k": (4, 4096, 16, 16, 128, {"is_causal": True}),
    "mha_causal_16k": (1, 16384, 16, 16, 128, {"is_causal": True}),
    "gqa_causal_8k": (2, 8192, 32, 8, 128, {"is_causal": True}),
    "mha_full_2k": (8, 2048, 16, 16, 128, {}),
    "gqa_window_8k": (2, 8192, 16, 4, 128, {"local_window_size": (1024, 0)}),
}


@pytest.mark.parametrize("name", list(BENCHMARK_SHAPES))
def test_benchmark_shapes_pick_pallas_tpu_and_fit_a_v5e(name, v5e_chip):
    """Automatic dispatch (`implementation=None`) compiles the TPU kernels for the benchmark shapes, forward and
    forward + backward, and the compiled program's arguments, outputs and temporaries fit one v5e's HBM."""
    B, T, N, K, H, kw = BENCHMARK_SHAPES[name]
    q, kv = jnp.zeros((B, T, N, H), jnp.bfloat16), jnp.zeros((B, T, K, H), jnp.bfloat16)

    def forward(q, k, v):
        return attnlib.attention(q, k, v, **kw)

    def gradients(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2), (0, 1, 2))(q, k, v)

    for fn, kernels in ((forward, 1), (gradients, 3)):
        text, compiled = _compile(fn, (q, kv, kv), v5e_chip)
        assert text.count(MOSAIC) == kernels, (fn.__name__, text.count(MOSAIC))
        memory = compiled.memory_analysis()
        used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
        assert used < V5E_HBM_BYTES, (fn.__name__, used / 2**30)


def test_the_topology_is_a_v5e(v5e_chip):
    (device,) = v5e_chip.device_set
    assert device.platform == "tpu" and "v5" in device.device_kind.lower(), device.device_kind


SETTINGS = {
    "default": lambda: contextlib.nullcontext(),
    "x64": lambda: jax.enable_x64(True),
    "highest": lambda: jax.default_matmul_precision("highest"),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("layout", ["combined", "head_major"])
def test_cache_layouts_compile_for_a_v5e(layout, setting, v5e_chip, monkeypatch):
    """A mixed prefill + decode batch on a `"combined"` cache (JAX's ragged paged-attention kernel) and a decode on a
    `"head_major"` one (its paged-attention kernel, the pools as they are: no copy of them in the program), under a
    user's global settings. The ragged kernel reads its tuned blocks by the attached TPU's generation: here none is
    attached, so it is told a v5e's."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: 5)
    monkeypatch.setattr(tuned_block_sizes, "get_device_name", lambda num_devices=None: "TPU v5")
    B, pages_per_seq, page, K, H = 6, 64, 32, 8, 64
    cache = attnlib.PagedKVCache.create(B, B * pages_per_seq, page, K, H, max_pages_per_seq=pages_per_seq,
                                        layout=layout)  # fmt: skip
    decode = layout == "head_major"
    q = jnp.zeros((B, 1, 32, H) if decode else (1500, 32, H), jnp.bfloat16)
    cu = jnp.asarray([0, 1000, 1200, 1201, 1202, 1203, 1204], jnp.int32)

    def attend(q, pool, table, lengths):
        full = dataclasses.replace(cache, pools=(pool, pool) if decode else (pool,), page_table=table,
                                   lengths=lengths)  # fmt: skip
        return full.attend(q, implementation=attnlib.PallasTpu(), **({} if decode else {"cu_seqlens_q": cu}))

    # Mosaic lowers the ragged kernel's `sign` by the default device's TPU generation: the deviceless v5e chip's.
    with SETTINGS[setting](), jax.default_device(next(iter(v5e_chip.device_set))):
        text, _ = _compile(attend, (q, cache.pools[0], cache.page_table, cache.lengths), v5e_chip)
    assert text.count(MOSAIC) == 1, text.count(MOSAIC)
    assert "transpose" not in text  # the pools are read in the layout they are held in


# ------------------------------------------------------------------------------------------------------------------
# serving on a mesh: a ragged step on a "combined" cache split over its key/value heads (tensor parallelism)

SERVING = dict(B=8, pages_per_seq=64, page=32, N=32, K=8, H=128)
SERVING_CU = (0, 1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007)  # one prefill chunk and 7 decodes
SERVING_T = 1024  # packed query rows: the step's 1007 tokens and padding


@pytest.fixture
def v5e_tuned_blocks(monkeypatch):
    """The ragged kernel reads its tuned blocks by the attached TPU's generation: none is attached, it is told a
    v5e's."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: 5)
    monkeypatch.setattr(tuned_block_sizes, "get_device_name", lambda num_devices=None: "TPU v5")


def _serving_step(num_kv_heads: int):
    """`(step, cache)`: a serving step (append the step's keys and values, attend) on an empty cache of
    `num_kv_heads` heads in the `"combined"` layout."""
    s = SERVING
    cache = attnlib.PagedKVCache.create(s["B"], s["B"] * s["pages_per_seq"], s["page"], num_kv_heads, s["H"],
                                        max_pages_per_seq=s["pages_per_seq"], layout="combined")  # fmt: skip
    cu = jnp.asarray(SERVING_CU, jnp.int32)

    def step(q, k_new, v_new, cache):
        cache = cache.append(k_new, v_new, cu_seqlens=cu)
        return cache.attend(q, cu_seqlens_q=cu, implementation=attnlib.PallasTpu()), cache

    return step, cache


@pytest.mark.parametrize("model", [2, 4, 8])
def test_ragged_shard_calls_compile_for_a_v5e(model, v5e_chip, v5e_tuned_blocks):
    """Tensor parallelism over `model` chips of a v5e slice: attnlib's rule gives each chip the ragged kernel call on
    its `N / model` query heads and `K / model` key/value heads (`2K / model` pool slots, down to one key and one
    value); that per-chip step compiles for a v5e chip with one Mosaic kernel and no copy of the pool."""
    from attnlib._src.backends import partition_rules as rules
    from attnlib._src.backends.pallas_tpu import partitioning, ragged

    N, K = SERVING["N"], SERVING["K"]

    class Mesh:
        shape = {"model": model}

    q_dims = partitioning.dims("packed_q", N, K)
    split = rules.choose_split(Mesh(), q_dims, ((), ("model",), ()), SERVING_T, N, K, partitioning.SPLITTABLE,
                               kv_heads_ok=lambda k: ragged._kv_heads_tile(k, jnp.dtype(jnp.bfloat16)))  # fmt: skip
    assert split.kv_heads == ("model",), split  # the rule splits the key/value heads over every chip
    step, cache = _serving_step(K // model)
    q = jnp.zeros((SERVING_T, N // model, SERVING["H"]), jnp.bfloat16)
    kv = jnp.zeros((SERVING_T, K // model, SERVING["H"]), jnp.bfloat16)
    with jax.default_device(next(iter(v5e_chip.device_set))):
        lowered = jax.jit(step, donate_argnums=(3,)).trace(
            *(_abstract(x, v5e_chip) for x in (q, kv, kv)), jax.tree.map(lambda x: _abstract(x, v5e_chip), cache)
        ).lower()
        text = lowered.as_text()
        lowered.compile()
    assert text.count(MOSAIC) == 1, text.count(MOSAIC)
    assert "transpose" not in text


@pytest.fixture(scope="module")
def v5e_slice() -> jax.sharding.Mesh:
    """A deviceless `v5e:2x4` slice (8 chips) as a `data` x `model` mesh of 2 x 4."""
    import numpy as np
    from jax.experimental import topologies

    with pytest.MonkeyPatch.context() as env:
        env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        devices = topologies.get_topology_desc("v5e:2x4", "tpu").devices
    return jax.sharding.Mesh(np.asarray(devices).reshape(2, 4), ("data", "model"))


def test_sharded_serving_step_compiles_for_a_v5e_slice(v5e_slice, v5e_tuned_blocks):
    """The whole step on the slice, the cache's pools split over `model` along their key/value-head axis: no
    all-gather, and each chip's program holds one Mosaic kernel on its 8 query heads and 2 key/value heads.

    Expected to fail in JAX 0.10.2 with libtpu 0.0.42: libtpu's compiler never reaches JAX's `custom_partitioning`
    callbacks ("Custom emitter for CustomSPMDPartitioning not found", jax-ml/jax#38196: reported there for
    multi-chip TPUs too, not only for this deviceless compile; registering JAX's partitioner with libtpu's PJRT API
    by hand does not change it). The test then xfails on that error and checks the rest once it compiles."""
    import re

    P = jax.sharding.PartitionSpec
    named = lambda spec: jax.sharding.NamedSharding(v5e_slice, spec)  # noqa: E731
    step, cache = _serving_step(SERVING["K"])
    q = jnp.zeros((SERVING_T, SERVING["N"], SERVING["H"]), jnp.bfloat16)
    kv = jnp.zeros((SERVING_T, SERVING["K"], SERVING["H"]), jnp.bfloat16)
    heads = named(P(None, "model"))
    cache_abstract = jax.tree.map(lambda x: _abstract(x, named(P(None, None, "model") if x.ndim == 4 else P())), cache)
    with jax.default_device(v5e_slice.devices.flat[0]):
        lowered = jax.jit(step, donate_argnums=(3,)).trace(
            *(_abstract(x, heads) for x in (q, kv, kv)), cache_abstract
        ).lower()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as error:
            if "CustomSPMDPartitioning" not in str(error):
                raise
            pytest.xfail("libtpu does not reach custom_partitioning's callbacks (jax-ml/jax#38196)")
    text = compiled.as_text()
    assert not re.search(r"\ball-gather(?:-start)?\(", text), text
    calls = [line for line in text.splitlines() if MOSAIC in line]
    assert len(calls) == 1 and "bf16[1024,8,128]" in calls[0], calls  # the chip's 8 of the 32 query heads


def test_serving_step_in_shard_map_compiles_for_a_v5e_slice(v5e_slice, v5e_tuned_blocks):
    """What runs on a TPU slice today: the same step inside `jax.shard_map` over the slice (each chip's call is
    local there, so no `custom_partitioning` callback is needed): no all-gather, one Mosaic kernel per chip on its 8
    query heads."""
    import re

    P = jax.sharding.PartitionSpec
    named = lambda spec: jax.sharding.NamedSharding(v5e_slice, spec)  # noqa: E731
    step, cache = _serving_step(SERVING["K"])
    cache_specs = jax.tree.map(lambda x: P(None, None, "model") if x.ndim == 4 else P(), cache)
    heads = P(None, "model")
    sharded = jax.shard_map(step, mesh=v5e_slice, in_specs=(heads, heads, heads, cache_specs),
                            out_specs=(heads, cache_specs), check_vma=False)  # fmt: skip
    q = jnp.zeros((SERVING_T, SERVING["N"], SERVING["H"]), jnp.bfloat16)
    kv = jnp.zeros((SERVING_T, SERVING["K"], SERVING["H"]), jnp.bfloat16)
    cache_abstract = jax.tree.map(lambda x, spec: _abstract(x, named(spec)), cache, cache_specs)
    with jax.default_device(v5e_slice.devices.flat[0]):
        compiled = jax.jit(sharded, donate_argnums=(3,)).trace(
            *(_abstract(x, named(heads)) for x in (q, kv, kv)), cache_abstract
        ).lower().compile()
    text = compiled.as_text()
    assert not re.search(r"\ball-gather(?:-start)?\(", text), text
    calls = [line for line in text.splitlines() if MOSAIC in line]
    assert len(calls) == 1 and "bf16[1024,8,128]" in calls[0], calls


# attnlib's flex kernel (where splash declines): every feature case, forward and gradients, compiled for a v5e


def _flex_cases():
    import test_pallas_tpu_flex as flex_cases

    return flex_cases


FLEX_CASES = [
    "dense_gqa", "causal_bottom_right_empty_rows", "lengths_causal", "segments_causal", "thd_window",
    "sinks_soft_cap_mqa", "array_scale", "score_mod_alibi", "mask_mod_prefix_lm", "score_mod_tanh",
    "score_mod_nested_ops", "modifiers_with_args", "thd_modifiers_by_sequence", "bias_heads", "bias_mha",
    "bias_keys_only", "mask_array", "mla", "bottom_right_lengths", "kv_segments_own_structure", "thd_kv_own_structure",
]  # fmt: skip


def _flex_program(case, dtype, **more):
    """`(fn, primals)`: the gradients of a loss reading `out` and the finite `lse` with respect to query, key, value
    and the case's differentiated extras."""
    flex_cases = _flex_cases()
    q, k, v = flex_cases._arrays(case, dtype)
    kw, names, extras = flex_cases._split(case, {**flex_cases._kwargs(case), **more})

    def loss(q, k, v, *extras):
        full = flex_cases.with_extras(kw, names, extras)
        out, lse = attnlib.attention(q, k, v, implementation=attnlib.PallasTpu(), return_residual=True, **full)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    primals = (q, k, v, *extras)
    return jax.grad(loss, argnums=tuple(range(len(primals)))), primals


def _force_flex(monkeypatch):
    from attnlib._src.backends.pallas_tpu import implementation

    original = implementation.PallasTpu.splash_reason
    monkeypatch.setattr(implementation.PallasTpu, "splash_reason",
                        lambda self, config: original(self, config) or "forced to the flex kernel by the test")


@pytest.mark.parametrize("name", FLEX_CASES)
def test_flex_cases_compile_for_a_v5e(name, v5e_chip, monkeypatch):
    """The flex forward, dK/dV and dQ kernels (three Mosaic calls) of every feature case in bfloat16, with 128-blocks
    and head dims padded to 128 lanes."""
    _force_flex(monkeypatch)
    case = _flex_cases().CASES[name]
    fn, primals = _flex_program(case, jnp.bfloat16)
    text, _ = _compile_tree(fn, primals, v5e_chip)
    assert text.count(MOSAIC) == 3, text.count(MOSAIC)


def _compile_tree(fn, args, sharding):
    """`_compile` for a tree of arguments. Mosaic lowers integer `//` and `%` (through `sign`) by the default device's
    TPU generation: the deviceless v5e chip's here."""
    abstract = jax.tree.map(lambda x: _abstract(x, sharding), args)
    with jax.default_device(next(iter(sharding.device_set))):
        lowered = jax.jit(fn).trace(*abstract).lower()
        return lowered.as_text(), lowered.compile()


@pytest.mark.parametrize("feature", ["dropout", "float32_highest", "deterministic"])
def test_flex_features_compile_for_a_v5e(feature, v5e_chip, monkeypatch):
    case = _flex_cases().CASES["causal_top_left"]
    more, dtype, setting = {}, jnp.bfloat16, contextlib.nullcontext()
    if feature == "dropout":
        more = dict(dropout_rate=0.25, dropout_key=jax.random.key(3))
    elif feature == "float32_highest":
        dtype, setting = jnp.float32, jax.default_matmul_precision("highest")
    else:
        more = dict(deterministic_backward=True)
    fn, primals = _flex_program(case, dtype, **more)
    with setting:
        text, _ = _compile_tree(fn, primals, v5e_chip)
    assert text.count(MOSAIC) == 3, text.count(MOSAIC)


FLEX_SHAPES = {  # (B, T, S, N, K, H, Hv, kwargs): realistic shapes on the flex kernel
    "alibi_causal_gqa8_4k": (2, 4096, 4096, 32, 4, 128, 128, "alibi"),
    "mla_192_128_causal_2k": (2, 2048, 2048, 16, 16, 192, 128, "causal"),
    "bias_dropout_2k": (2, 2048, 2048, 16, 16, 64, 64, "bias_dropout"),
    "bias_per_tile_4k": (2, 4096, 4096, 16, 16, 128, 128, "bias"),  # bench_tpu's row: dbias written in place
    "document_mask_mod_8k": (1, 8192, 8192, 16, 8, 128, 128, "documents"),
}


@pytest.mark.parametrize("name", list(FLEX_SHAPES))
def test_flex_realistic_shapes_compile_and_fit_a_v5e(name, v5e_chip):
    """Forward + backward of realistic flex shapes compile for a v5e (VMEM included) and fit its HBM."""
    B, T, S, N, K, H, Hv, kind = FLEX_SHAPES[name]
    q = jnp.zeros((B, T, N, H), jnp.bfloat16)
    k, v = jnp.zeros((B, S, K, H), jnp.bfloat16), jnp.zeros((B, S, K, Hv), jnp.bfloat16)
    extra, kw = (), {}
    if kind == "alibi":
        extra = (jnp.zeros((N, 1, 1), jnp.float32),)
        kw = dict(is_causal=True, score_mod=lambda s, b, h, i, j, m: s + m * (j - i).astype(jnp.float32))
    elif kind == "causal":
        kw = dict(is_causal=True)
    elif kind == "bias_dropout":
        extra = (jnp.zeros((1, N, T, S), jnp.bfloat16),)
        kw = dict(dropout_rate=0.1, dropout_key=jax.random.key(0))
    elif kind == "bias":
        extra = (jnp.zeros((B, N, T, S), jnp.bfloat16),)
    else:
        kw = dict(mask_mod=lambda b, h, i, j: (i // 1024 == j // 1024) & (j <= i))

    flex = attnlib.PallasTpu(kernel="flex")  # MLA alone would run on splash

    def loss(q, k, v, *extra):
        if kind == "alibi":
            out = attnlib.attention(q, k, v, score_mod_args=extra, implementation=flex, **kw)
        else:
            out = attnlib.attention(q, k, v, *extra, implementation=flex, **kw)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    fn = jax.grad(loss, argnums=tuple(range(3 + len(extra))))
    text, compiled = _compile_tree(fn, (q, k, v, *extra), v5e_chip)
    assert text.count(MOSAIC) == 3, text.count(MOSAIC)
    memory = compiled.memory_analysis()
    used = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert used < V5E_HBM_BYTES, used / 2**30
