"""`attnlib.context_parallel` on TPUs: compiled for a deviceless `v5e:2x4` slice, and its numbers in interpret mode.

Compiles (`tpu_compile`: libtpu on this host, no TPU attached): the ring and all-gather strategies with
`implementation=attnlib.PallasTpu()` inside `jax.shard_map(..., check_vma=False)` over every axis of a 2 x 4 mesh of the
slice (the sequence over `sp`, the batch or the heads over the other axis), forward and `value_and_grad`, in bfloat16.
Each compiled program holds Mosaic kernels (`tpu_custom_call`) on one chip's shapes, not a plain-JAX fallback, and
only the collectives its strategy names (counted in `compiled.as_text()`): the ring permutes key/value blocks (and, in
the backward, the dK/dV accumulators); all-gather gathers K and V and reduce-scatters dK and dV; the query is never
gathered. The only other collective is the loss's scalar sum over the mesh (outside `shard_map`). Nothing runs.

Numbers: `test_interpret_mode_cases` runs `tests/cp_tpu_cases.py` in a subprocess with 8 simulated CPU devices, the
kernels in Pallas interpret mode, against the unsharded call and the float64 reference.

What `shard_map(check_vma=True)` (JAX's default) does: `pallas_tpu` declines every step there (this JAX's Pallas
kernels give their outputs no varying-axes type), so with `PallasTpu()` alone the call raises, naming
`check_vma=False` (`test_check_vma_true_is_declined`). A `shard_map` over the sequence axis only, the batch left to
the automatic axes (`axis_names={"sp"}`), compiles with each chip's kernels on its own batch rows
(`test_sequence_only_shard_map_compiles_for_a_v5e_slice`).
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_a_simulated_tpu, run_pytest_on_simulated_devices

import attnlib
import attnlib.context_parallel as cp


P = jax.sharding.PartitionSpec
MOSAIC = "tpu_custom_call"

# Global shapes of the compile tests: the sequence over 4 chips (512 tokens each, load-balanced chunks of 256), the
# batch or the heads over 2. No local dim equals the global length 2048.
B, T, N, K, H = 4, 2048, 8, 2, 128
SP = 4


# ------------------------------------------------------------------------------------------------------------------
# Numbers: interpret mode on 8 simulated CPU devices (subprocess)


def test_interpret_mode_cases():
    run_pytest_on_simulated_devices("cp_tpu_cases.py", 8)


@pytest.mark.full
def test_interpret_mode_cases_full_matrix():
    run_pytest_on_simulated_devices("cp_tpu_cases.py", 8, tier="full")


# ------------------------------------------------------------------------------------------------------------------
# Compiled for a deviceless v5e:2x4 slice


@pytest.fixture(scope="module")
def v5e_slice_devices() -> np.ndarray:
    """The 8 chips of a deviceless `v5e:2x4` slice."""
    from jax.experimental import topologies

    with pytest.MonkeyPatch.context() as env:
        env.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chip is used: pytest-xdist workers may share libtpu
        return np.asarray(topologies.get_topology_desc("v5e:2x4", "tpu").devices)


@pytest.fixture
def compile_for_a_tpu(monkeypatch):
    """`PallasTpu()` serves as on a TPU (none is attached)."""
    on_a_simulated_tpu(monkeypatch)


def _mesh(devices: np.ndarray, axes: dict[str, int]) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(devices.reshape(tuple(axes.values())), tuple(axes))


def _program(mesh, strategy: str, *, grad: bool, load_balanced: bool = True, segments: bool = False,
             implementation=None, check_vma: bool = False, axis_names=None, **kwargs):  # fmt: skip
    """`(fn, abstract args)`: `cp.attention` inside `shard_map` over `mesh` (sequence over `sp`; batch over `data`,
    heads over `model` where the mesh has them), forward or `value_and_grad` of a loss of the output."""
    batch = "data" if "data" in mesh.axis_names else None
    heads = "model" if "model" in mesh.axis_names else None
    spec, seg_spec = P(batch, "sp", heads), P(batch, "sp")
    if axis_names is not None:  # the axes outside `axis_names` stay automatic: the specs name only `sp`
        spec, seg_spec = P(None, "sp"), P(None, "sp")
    named = lambda s: jax.sharding.NamedSharding(mesh, s)  # noqa: E731
    args = [jax.ShapeDtypeStruct((B, T, n, H), jnp.bfloat16, sharding=named(spec)) for n in (N, K, K)]
    specs = [spec] * 3
    if segments:
        args.append(jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=named(seg_spec)))
        specs.append(seg_spec)
    implementation = attnlib.PallasTpu() if implementation is None else implementation

    def local(q, k, v, *ids):
        more = {"q_segment_ids": ids[0]} if ids else {}
        return cp.attention(q, k, v, axis_name="sp", strategy=strategy, load_balanced=load_balanced,
                            implementation=implementation, **kwargs, **more)  # fmt: skip

    extra = {} if axis_names is None else {"axis_names": frozenset(axis_names)}
    sharded = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=spec, check_vma=check_vma, **extra)
    if not grad:
        return sharded, args
    loss = lambda q, k, v, *ids: jnp.sum(sharded(q, k, v, *ids).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), args


def _compiled_text(fn, args, device) -> str:
    """The compiled program for the slice. Traced off the TPU (splash builds its mask tables as host arrays), lowered
    with a chip as the default device (Mosaic lowers integer `//` and `%` by the default device's TPU generation)."""
    traced = jax.jit(fn).trace(*args)
    with jax.default_device(device):
        return traced.lower().compile().as_text()


_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|collective-permute|all-reduce|all-to-all|collective-broadcast)"
    r"(-start)?\("
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([0-9,]*)\]")


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """`(dtype, dims)` of every array type in `text` (layouts dropped)."""
    found = _SHAPE.findall(re.sub(r"\{[^}]*\}", "", text))
    return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found]


def _collectives(text: str) -> dict[str, list]:
    """Per collective op: the array types (`_shapes`) of each one's results (an async `-start` holds its operands,
    then its results, then context scalars)."""
    found = collections.defaultdict(list)
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            shapes = _shapes(m.group(1))
            if m.group(3):
                shapes = [s for s in shapes if s != ("u32", ())]
                shapes = shapes[len(shapes) // 2 :]
            found[m.group(2)].append(shapes)
    return dict(found)


def _kernels(text: str) -> list[tuple[str, list]]:
    """`(name, result types)` of every Mosaic kernel call."""
    calls = []
    for line in text.splitlines():
        if MOSAIC in line and "custom-call(" in line:
            m = re.search(r"%([A-Za-z_]+?)(?:\.\d+)? = (\(.*?\)|\S+) custom-call\(", line)
            assert m, line
            calls.append((m.group(1), _shapes(m.group(2))))
    return calls


def _flat(dims: tuple[int, ...]) -> tuple[int, ...]:
    """`(B, S, rest)`: the batch and sequence dims, the others flattened (keys, values and ids are gathered so)."""
    return (*dims[:2], int(np.prod(dims[2:], dtype=np.int64)))


def _loss_sum_only(found: dict[str, list]) -> None:
    """The program's only all-reduce is the loss's scalar sum."""
    assert [s for group in found.pop("all-reduce", []) for s in group] in ([], [("f32", ())]), found


def _check_kernels(text: str, names: set[str], batch: int, kv_len: int | None) -> list:
    """Mosaic kernels of `names` only, every one on `batch` rows (one chip's) and, given `kv_len`, none on more than
    `kv_len` tokens (splash's results are per head: `[B, N, T, D]`; the flex kernel's hold a GQA group's rows)."""
    calls = _kernels(text)
    assert calls, "no Mosaic kernel in the compiled program (a plain-JAX fallback?)"
    assert {name for name, _ in calls} <= names, {name for name, _ in calls}
    for name, shapes in calls:
        assert all(dims[0] == batch for _, dims in shapes if len(dims) >= 3), (name, shapes)
        if kv_len is not None:
            assert all(max(dims) <= max(kv_len, 128) for _, dims in shapes if dims), (name, shapes)
    return calls


SPLASH = {"splash_mha_fwd_residuals", "splash_mha_fwd_segmented_residuals", "splash_mha_dkv_no_residuals",
          "splash_mha_dq_no_residuals", "splash_mha_dkv_segmented_no_residuals", "splash_mha_dq_segmented_no_residuals"}
FLEX = {"attnlib_flex_forward", "attnlib_flex_dkv", "attnlib_flex_dq"}
KV_BLOCK = (B // 2, T // SP, K, H)
"""One chip's key/value block on the data x sequence mesh."""


@pytest.mark.tpu_compile
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_ring_compiles_for_a_v5e_slice(grad, v5e_slice_devices, compile_for_a_tpu):
    """Causal GQA, load-balanced ring over 4 chips, batch over 2: splash kernels on one chip's batch rows and
    chunks; collective-permutes of one chip's K/V block only: 2 (K, V) per step after the first forward; the
    backward's K/V ring is the forward's (XLA keeps those blocks), the dK/dV accumulators travel with theirs (float32)
    and go home once after the last step."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    text = _compiled_text(*_program(mesh, "ring", grad=grad, is_causal=True), v5e_slice_devices.flat[0])
    _check_kernels(text, SPLASH, B // 2, T // SP)
    found = _collectives(text)
    permutes = found.pop("collective-permute")
    if grad:
        _loss_sum_only(found)
    assert found == {}, found  # no all-gather (of q or anything), no reduce-scatter
    assert all(len(p) == 1 and p[0][1] == KV_BLOCK for p in permutes), permutes
    forward = 2 * (SP - 1)
    if not grad:
        assert len(permutes) == forward and all(p[0][0] == "bf16" for p in permutes), permutes
    else:
        # at least: K/V forward ring (shared with the backward) + dK/dV per step + dK/dV home;
        # at most: the backward's K/V ring again
        assert forward + 2 * (SP - 1) + 2 <= len(permutes) <= 2 * forward + 2 * (SP - 1) + 2, len(permutes)
        assert sum(p[0][0] == "f32" for p in permutes) >= 2 * (SP - 1), permutes  # the travelling accumulators


@pytest.mark.tpu_compile
@pytest.mark.parametrize("load_balanced", [True, False], ids=["lb", "contiguous"])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "value_and_grad"])
def test_all_gather_compiles_for_a_v5e_slice(grad, load_balanced, v5e_slice_devices, compile_for_a_tpu):
    """Causal GQA, all-gather: one all-gather each of K and V (never of the query), dK and dV reduce-scattered back
    (the contiguous layout's too: `all_gather._gather` says why it could become an all-reduce); splash kernels on one
    chip's batch rows (keys up to the whole gathered sequence)."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    fn, args = _program(mesh, "all_gather", grad=grad, load_balanced=load_balanced, is_causal=True)
    text = _compiled_text(fn, args, v5e_slice_devices.flat[0])
    _check_kernels(text, SPLASH, B // 2, T)
    found = _collectives(text)
    if grad:
        _loss_sum_only(found)
    gathered = [[(dtype, _flat(dims)) for dtype, dims in g] for g in found.pop("all-gather")]
    assert gathered == [[("bf16", (B // 2, T, K * H))]] * 2, gathered  # K and V: 2 heads, the query has 8
    if grad:  # dK and dV, in their dtype (the transpose of the bfloat16 all-gather)
        scattered = [[(dtype, _flat(dims)) for dtype, dims in r] for r in found.pop("reduce-scatter")]
        assert scattered == [[("bf16", (B // 2, T // SP, K * H))]] * 2, scattered
    assert found == {}, found


@pytest.mark.tpu_compile
def test_heads_over_a_model_axis_compile_for_a_v5e_slice(v5e_slice_devices, compile_for_a_tpu):
    """The sequence over 4 chips and the heads over 2 (GQA 8 / 2 -> 4 / 1 per chip), ring, forward + backward."""
    mesh = _mesh(v5e_slice_devices, {"sp": SP, "model": 2})
    text = _compiled_text(*_program(mesh, "ring", grad=True, is_causal=True), v5e_slice_devices.flat[0])
    calls = _check_kernels(text, SPLASH, B, T // SP)
    heads = {dims[1] for _, shapes in calls for _, dims in shapes if len(dims) == 4}
    assert heads <= {N // 2, K // 2}, heads  # each chip's query heads (4) and key/value head (1)
    found = _collectives(text)
    permutes = found.pop("collective-permute")
    _loss_sum_only(found)
    assert found == {}, found
    assert all(len(p) == 1 and p[0][1] == (B, T // SP, K // 2, H) for p in permutes), permutes


@pytest.mark.tpu_compile
def test_window_skips_ring_steps_for_a_v5e_slice(v5e_slice_devices, compile_for_a_tpu):
    """A causal window of 700 tokens on the contiguous layout reaches one previous chip (512 tokens each) or two: the
    ring takes 3 of the 4 steps, so fewer permutes than plain causal; the window steps run splash."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    device = v5e_slice_devices.flat[0]
    counts = {}
    for name, kw in {"causal": {}, "window": {"local_window_size": (700, 0)}}.items():
        text = _compiled_text(*_program(mesh, "ring", grad=True, load_balanced=False, is_causal=True, **kw), device)
        _check_kernels(text, SPLASH, B // 2, T // SP)
        found = _collectives(text)
        counts[name] = len(found.pop("collective-permute"))
        _loss_sum_only(found)
        assert found == {}, found
    assert counts["window"] < counts["causal"], counts


@pytest.mark.tpu_compile
@pytest.mark.full  # about 1.5 CPU-minutes: the flex kernels and their device-side block maps
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_packed_rows_compile_on_the_flex_kernel_for_a_v5e_slice(strategy, v5e_slice_devices, compile_for_a_tpu):
    """Segment ids: every step carries a boolean mask (global ids and positions), which splash declines and the flex
    kernel serves; the key segment ids travel (or are gathered) with the keys."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    fn, args = _program(mesh, strategy, grad=True, segments=True, is_causal=True)
    text = _compiled_text(fn, args, v5e_slice_devices.flat[0])
    calls = _check_kernels(text, FLEX, B // 2, None)
    assert {dims[1] for _, shapes in calls for _, dims in shapes if len(dims) == 4} == {K}  # [B, K, G · T_sub, D]
    found = _collectives(text)
    _loss_sum_only(found)
    if strategy == "ring":
        permutes = found.pop("collective-permute")
        assert all(len(p) == 1 and p[0][1] in (KV_BLOCK, (B // 2, T // SP)) for p in permutes), permutes
    else:
        gathered = sorted(_flat(g[0][1]) for g in found.pop("all-gather"))
        assert gathered == sorted([(B // 2, T, K * H)] * 2 + [(B // 2, T, 1)]), gathered  # K, V, key segment ids
        assert [_flat(r[0][1]) for r in found.pop("reduce-scatter")] == [(B // 2, T // SP, K * H)] * 2, found
    assert found == {}, found


SEQUENCE_ONLY_ALL_GATHER = (
    "inside `shard_map(axis_names={'sp'})` libtpu 0.0.42 gathers K and V over the automatic `data` axis before their "
    "all-gather over `sp` (2 more all-gathers, bf16[4,512,256], and 2 of dK / dV, bf16[4,2048,256], in the "
    "backward): every chip then holds every batch row's keys and values"
)


@pytest.mark.tpu_compile
@pytest.mark.parametrize(
    "strategy",
    ["ring", pytest.param("all_gather", marks=(pytest.mark.full,
                                               pytest.mark.xfail(strict=True, reason=SEQUENCE_ONLY_ALL_GATHER)))],
)  # fmt: skip
def test_sequence_only_shard_map_compiles_for_a_v5e_slice(strategy, v5e_slice_devices, compile_for_a_tpu):
    """`shard_map` over `sp` only (`axis_names={"sp"}`), the batch left to the automatic `data` axis: each kernel
    call wraps itself in a `shard_map` over `data` (`pallas_tpu/mesh_call.py`), so every chip's kernels run on its own
    2 batch rows. The ring moves only one chip's K/V blocks; all-gather's gathers take the whole batch first
    (`SEQUENCE_ONLY_ALL_GATHER`)."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    fn, args = _program(mesh, strategy, grad=True, axis_names={"sp"}, is_causal=True)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, P("data", "sp")))
            for a in args]  # fmt: skip
    text = _compiled_text(fn, args, v5e_slice_devices.flat[0])
    _check_kernels(text, SPLASH, B // 2, T // SP if strategy == "ring" else T)
    found = _collectives(text)
    _loss_sum_only(found)
    if strategy == "ring":
        permutes = found.pop("collective-permute")
        assert all(len(p) == 1 and p[0][1] == KV_BLOCK for p in permutes), permutes
    else:
        gathered = [_flat(g[0][1]) for g in found.pop("all-gather")]
        assert gathered == [(B // 2, T, K * H)] * 2, gathered
        assert [_flat(r[0][1]) for r in found.pop("reduce-scatter")] == [(B // 2, T // SP, K * H)] * 2, found
    assert found == {}, found


@pytest.mark.tpu_compile
def test_check_vma_true_is_declined(v5e_slice_devices, compile_for_a_tpu):
    """Inside `shard_map(check_vma=True)` (JAX's default) `pallas_tpu` declines every step: with it alone the call
    raises at trace time, naming `check_vma=False`."""
    mesh = _mesh(v5e_slice_devices, {"data": 2, "sp": SP})
    fn, args = _program(mesh, "ring", grad=False, check_vma=True, is_causal=True)
    with pytest.raises(NotImplementedError, match=r"check_vma=True.*pass check_vma=False"):
        jax.jit(fn).trace(*args)
