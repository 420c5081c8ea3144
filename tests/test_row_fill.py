"""`row_fill.set_rows`: chosen rows of a packed result set to 0 or NaN, every other bit untouched.

The Pallas kernel is checked on the CPU in Pallas' GPU interpreter and on the GPU compiled (Mosaic GPU), each against
a NumPy reference written from the definition, and bit for bit against the XLA scatter it replaces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import place_calls_on

from attnlib._src.backends.cudnn import row_fill


# Rows of a multiple of 16 bytes (what the kernel takes) in odd counts: not a multiple of the kernel's 32-row word;
# one row of 16 bytes; rows of 1224 elements (several copies per row and per word, copies of odd sizes).
SHAPES = [(37, 3, 8), (100, 5, 16), (1, 1, 8), (53, 9, 136)]
# Rows the kernel does not take (not a multiple of 16 bytes): `set_rows` uses the scatter there.
UNALIGNED = [(37, 3, 6), (100, 5, 3), (1, 1, 1)]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _case(shape, dtype, seed=0):
    """Random flags (`nan` may overlap `zero`: NaN wins), plus rows 32-63 all zero and 64-95 all NaN where there are
    that many: whole 32-row words take the kernel's one-run path."""
    a, b, c = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(a, shape).astype(dtype)
    zero = jax.random.bernoulli(b, 0.3, shape[:1]).at[32:64].set(True)
    nan = jax.random.bernoulli(c, 0.2, shape[:1]).at[32:64].set(False).at[64:96].set(True)
    return x, zero, nan


def _bits(x):
    """The bits of `x`, with every NaN given one payload (XLA's and the kernel's NaN constants may differ)."""
    bits = np.asarray(jax.lax.bitcast_convert_type(x, {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]))
    return np.where(np.isnan(np.asarray(x.astype(jnp.float32))), 0, bits)


def _check(actual, x, zero, nan):
    x, zero, nan = np.asarray(x.astype(jnp.float32)), np.asarray(zero), np.asarray(nan)
    actual32 = np.asarray(actual.astype(jnp.float32))
    assert np.isnan(actual32[nan]).all()
    assert (actual32[zero & ~nan] == 0).all() and not np.signbit(actual32[zero & ~nan]).any()
    kept = ~(zero | nan)
    np.testing.assert_array_equal(actual32[kept], x[kept])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_in_the_interpreter(shape, dtype):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")  # without it `set_rows` falls back (tested below)
    x, zero, nan = _case(shape, dtype)
    actual = jax.jit(lambda *a: row_fill.set_rows_kernel(*a, interpret=True))(x, zero, nan)
    assert actual.shape == x.shape and actual.dtype == x.dtype
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), _bits(row_fill.set_rows_scatter(x, zero, nan)))


@pytest.mark.parametrize("parts", [2, 4, 32])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], (129, 2, 16)], ids=str)
def test_kernel_with_several_programs_per_word_in_the_interpreter(shape, parts):
    """The kernel's `parts` programs per 32-row word (measured by `benchmarks/probe_row_fill.py`): each sets its
    share of a whole word and its rows of a partly flagged one, together exactly the flagged rows."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    x, zero, nan = _case(shape, jnp.bfloat16, seed=parts)
    kernel = lambda x, zero, nan: row_fill._run_kernel([x], [(zero, nan)], [0], interpret=True, parts=parts)[0]  # noqa: E731
    actual = jax.jit(kernel)(x, zero, nan)
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), _bits(row_fill.set_rows_scatter(x, zero, nan)))


def _several(dtype=jnp.bfloat16, seed=5):
    """Fills as a ragged backward hands them over: dQ `[Tq, N, H]` with its flags, dK `[Tkv, K, H]` and dV
    `[Tkv, K, Hv]` sharing theirs (the same arrays), plus a fourth result on flags of its own; odd row counts."""
    dq, q_zero, q_nan = _case((37, 3, 8), dtype, seed)
    dk, kv_zero, kv_nan = _case((100, 5, 16), dtype, seed + 1)
    dv = jax.random.normal(jax.random.key(seed + 2), (100, 5, 8)).astype(dtype)
    other = _case((53, 9, 136), dtype, seed + 3)
    return [(dq, q_zero, q_nan), (dk, kv_zero, kv_nan), (dv, kv_zero, kv_nan), other]


@pytest.mark.parametrize("parts", [1, 4])
def test_one_kernel_call_fills_several_results_in_the_interpreter(parts):
    """`set_rows_kernel_many`: one call over the mask words of every result, each word's programs filling only their
    own result's rows from that result's flags; results sharing flags share one set of masks."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    fills = _several()
    pairs, owners = row_fill._flag_pairs(fills)
    assert owners == (0, 1, 1, 2) and len(pairs) == 3

    def kernel(fills):
        fills[2] = (fills[2][0], *fills[1][1:])  # one traced value for the shared flags, as in a backward
        pairs, owners = row_fill._flag_pairs(fills)
        assert owners == (0, 1, 1, 2)
        return row_fill._run_kernel([x for x, _, _ in fills], pairs, owners, interpret=True, parts=parts)

    actual = jax.jit(kernel)(fills)
    for result, (x, zero, nan) in zip(actual, fills, strict=True):
        assert result.shape == x.shape and result.dtype == x.dtype
        _check(result, x, zero, nan)
        np.testing.assert_array_equal(_bits(result), _bits(row_fill.set_rows_scatter(x, zero, nan)))
    library = jax.jit(lambda fills: row_fill.set_rows_kernel_many(fills, interpret=True))(fills)
    for result, expected in zip(library, actual):
        np.testing.assert_array_equal(_bits(result), _bits(expected))


def test_one_kernel_call_refuses_mixed_dtypes_and_unaligned_rows():
    (x, zero, nan), (y, *flags) = _several()[:2]
    with pytest.raises(ValueError, match="one dtype"):
        row_fill.set_rows_kernel_many([(x, zero, nan), (y.astype(jnp.float32), *flags)])
    with pytest.raises(ValueError, match="16 bytes"):
        row_fill.set_rows_kernel_many([(x, zero, nan), (jnp.ones((100, 3), jnp.bfloat16), *flags)])


def test_kernel_share_counts_the_bytes_of_a_dtype_together():
    """Results the kernel takes go to it when those of their dtype hold more than `SCATTER_MAX_BYTES` together (rows
    of 128 bytes here): a backward's dQ, dK and dV of 2 MB each take one call where each alone would take the
    scatter; other dtypes and unaligned rows count apart."""
    half = row_fill.SCATTER_MAX_BYTES // 2
    bf16 = jax.ShapeDtypeStruct((half // 128, 64), jnp.bfloat16)  # 2 MB each, 128-byte rows
    f32 = jax.ShapeDtypeStruct((half // 128, 32), jnp.float32)  # 2 MB
    unaligned = jax.ShapeDtypeStruct((half // 6, 3), jnp.bfloat16)
    assert row_fill.kernel_share([bf16]) == [False]
    assert row_fill.kernel_share([bf16, bf16]) == [False, False]  # exactly the limit
    assert row_fill.kernel_share([bf16, bf16, bf16]) == [True, True, True]
    assert row_fill.kernel_share([bf16, f32, bf16, unaligned, bf16]) == [True, False, True, False, True]


def test_kernel_share_of_wide_rows_from_a_smaller_size():
    """Rows of at least `WIDE_ROW_BYTES` (outputs, gradients): the kernel from `WIDE_SCATTER_MAX_BYTES`; a narrow
    result in the group brings back the general limit."""
    wide_row = row_fill.WIDE_ROW_BYTES // 2  # bf16 elements
    limit = row_fill.WIDE_SCATTER_MAX_BYTES
    at_limit = jax.ShapeDtypeStruct((limit // row_fill.WIDE_ROW_BYTES, 4, wide_row // 4), jnp.bfloat16)
    above = jax.ShapeDtypeStruct((limit // row_fill.WIDE_ROW_BYTES + 1, 4, wide_row // 4), jnp.bfloat16)
    narrower = jax.ShapeDtypeStruct((limit // row_fill.WIDE_ROW_BYTES * 2, 4, wide_row // 8), jnp.bfloat16)  # same size
    assert row_fill.kernel_share([at_limit]) == [False] and row_fill.kernel_share([above]) == [True]
    assert row_fill.kernel_share([narrower]) == [False]
    assert row_fill.kernel_share([at_limit, at_limit]) == [True, True]
    assert row_fill.kernel_share([at_limit, narrower]) == [False, False]  # 2 MB, one narrow: the 4 MiB limit


@pytest.mark.parametrize("shape", [(2053, 64, 32), (1025, 32, 32)], ids=str)
def test_set_rows_many_lowers_to_one_kernel_per_dtype(shape, monkeypatch):
    """Lowered for CUDA (as JAX on a GPU traces it): one Mosaic GPU call for the results of a dtype over the limit
    together (8 MB alone, or 2 MB each: three together), XLA's scatter for the unaligned one, each result aliased."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    place_calls_on(monkeypatch, "gpu")
    x, zero, nan = _case(shape, jnp.bfloat16)
    y = _case(shape[:1] + (3,), jnp.bfloat16, seed=1)[0]
    fills = lambda x, y, zero, nan: row_fill.set_rows_many([(x, zero, nan), (-x, zero, nan), (y, zero, nan),  # noqa: E731
                                                            (2 * x, ~zero, nan)])  # fmt: skip
    lowered = jax.jit(fills).trace(x, y, zero, nan).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("custom_call @mosaic_gpu") == 1 and lowered.count("\"stablehlo.scatter\"(") == 1


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_scatter_and_default(shape):
    """The scatter (the benchmark's "before") against the definition, and `set_rows` (the scatter when JAX runs on a
    CPU) against it."""
    x, zero, nan = _case(shape, jnp.bfloat16, seed=1)
    _check(row_fill.set_rows_scatter(x, zero, nan), x, zero, nan)
    np.testing.assert_array_equal(_bits(jax.jit(row_fill.set_rows)(x, zero, nan)),
                                  _bits(row_fill.set_rows_scatter(x, zero, nan)))  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "gpu"], ids=["scatter_path", "kernel_path"])
def test_empty_arrays(backend, monkeypatch):
    """Nothing to fill: `x` back as it is, on the CPU's path (the scatter) and the GPU's (no kernel)."""
    place_calls_on(monkeypatch, backend)
    for shape in [(0, 4, 8), (5, 0, 8)]:
        x = jnp.ones(shape, jnp.bfloat16)
        flags = jnp.ones(shape[:1], bool)
        actual = row_fill.set_rows(x, flags, flags)
        assert actual.shape == shape and actual.dtype == x.dtype


def test_kernel_refuses_rows_it_cannot_copy():
    """Rows not a multiple of 16 bytes: the kernel says so (`set_rows` hands them to the scatter)."""
    for shape in UNALIGNED:
        assert not row_fill.kernel_takes(jnp.ones(shape, jnp.bfloat16))
        flags = jnp.ones(shape[:1], bool)
        with pytest.raises(ValueError, match="16 bytes"):
            row_fill.set_rows_kernel(jnp.ones(shape, jnp.bfloat16), flags, flags)
    assert all(row_fill.kernel_takes(jnp.ones(shape, jnp.bfloat16)) for shape in SHAPES)


def test_row_masks_bits():
    """Bit i of word w is row 32 w + i; NaN wins; rows past T are unset."""
    zero = np.zeros(70, bool)
    nan = np.zeros(70, bool)
    zero[[0, 31, 33, 69]] = True
    nan[[31, 40]] = True
    masks = np.asarray(row_fill.row_masks(jnp.asarray(zero), jnp.asarray(nan))).view(np.uint32)
    assert masks.shape == (3, 2)
    assert masks[0].tolist() == [1, 1 << 31] and masks[1].tolist() == [1 << 1, 1 << 8]
    assert masks[2].tolist() == [1 << 5, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES + UNALIGNED + [(4099, 32, 128), (4099, 8), (1025, 16, 64)], ids=str)
def test_kernel_on_the_gpu(shape, dtype):
    """Compiled on the GPU: `set_rows` runs the Mosaic GPU kernel on results over its limit whose rows it can
    copy, the scatter elsewhere; the kernel itself runs on every shape it takes. Both bit-identical to the scatter."""
    x, zero, nan = _case(shape, dtype, seed=2)
    lowered = jax.jit(row_fill.set_rows).lower(x, zero, nan).as_text()
    kernel = "custom_call @mosaic_gpu" in lowered
    assert kernel == row_fill.runs_kernel(x), "the kernel runs exactly where it is chosen"
    assert kernel != ("stablehlo.scatter" in lowered)
    expected = _bits(jax.jit(row_fill.set_rows_scatter)(x, zero, nan))
    actual = jax.jit(row_fill.set_rows)(x, zero, nan)
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), expected)
    if row_fill.kernel_takes(x):
        forced = jax.jit(row_fill.set_rows_kernel)(x, zero, nan)
        np.testing.assert_array_equal(_bits(forced), expected)


@pytest.mark.parametrize("shape", SHAPES + UNALIGNED + [(4099, 32, 128), (4099, 8), (2053, 64, 32), (1025, 16, 64)],
                         ids=str)
def test_set_rows_lowers_to_the_kernel_exactly_where_chosen(shape, monkeypatch):
    """Lowered for CUDA on this machine (as JAX on a GPU traces it): the Mosaic GPU kernel where `runs_kernel`, XLA's
    scatter elsewhere, never both."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    place_calls_on(monkeypatch, "gpu")
    x, zero, nan = _case(shape, jnp.float32)
    lowered = jax.jit(row_fill.set_rows).trace(x, zero, nan).lower(lowering_platforms=("cuda",)).as_text()
    kernel = "custom_call @mosaic_gpu" in lowered
    assert kernel == row_fill.runs_kernel(x)
    assert kernel != ("stablehlo.scatter" in lowered)


def test_small_results_take_the_scatter():
    """The kernel runs only on results larger than `SCATTER_MAX_BYTES` (`WIDE_SCATTER_MAX_BYTES` for rows of at least
    `WIDE_ROW_BYTES`) whose rows it can copy."""
    limit = row_fill.SCATTER_MAX_BYTES
    at_limit = jax.ShapeDtypeStruct((limit // 256, 64), jnp.float32)  # 256-byte rows
    above = jax.ShapeDtypeStruct((limit // 256 + 1, 64), jnp.float32)
    unaligned = jax.ShapeDtypeStruct((limit // 6 + 1, 3), jnp.float16)  # 6-byte rows, over the limit
    wide = jax.ShapeDtypeStruct((1025, 16, 64), jnp.bfloat16)  # 2 KiB rows, 2 MB
    assert row_fill.kernel_takes(at_limit) and not row_fill.runs_kernel(at_limit)
    assert row_fill.runs_kernel(above)
    assert not row_fill.kernel_takes(unaligned) and not row_fill.runs_kernel(unaligned)
    assert row_fill.runs_kernel(wide) and not row_fill.runs_kernel(jax.ShapeDtypeStruct((512, 16, 64), jnp.bfloat16))


def _vmapped_cases():
    """(function, arguments) pairs: `set_rows_kernel` under `vmap`, with all or only `x` mapped, and nested."""
    x, zero, nan = _case((3 * 37, 3, 8), jnp.bfloat16, seed=4)
    x, zero, nan = x.reshape(3, 37, 3, 8), zero.reshape(3, 37), nan.reshape(3, 37)
    return [
        (jax.vmap(row_fill.set_rows_kernel), jax.vmap(row_fill.set_rows_scatter), (x, zero, nan)),
        (jax.vmap(row_fill.set_rows_kernel, in_axes=(0, None, None)),
         jax.vmap(row_fill.set_rows_scatter, in_axes=(0, None, None)), (x, zero[0], nan[0])),
        (jax.vmap(jax.vmap(row_fill.set_rows_kernel), in_axes=(0, None, None)),
         jax.vmap(jax.vmap(row_fill.set_rows_scatter), in_axes=(0, None, None)), (jnp.stack([x, -x]), zero, nan)),
    ]  # fmt: skip


def test_kernel_under_vmap_lowers_to_one_kernel_in_place():
    """Pallas' kernels take no batch axis: `vmap` folds the mapped axes into the rows, one kernel, `x` still aliased
    to the result (lowered for CUDA on any machine; values on the GPU below)."""
    for kernel, _, args in _vmapped_cases():
        lowered = jax.jit(kernel, donate_argnums=0).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert lowered.count("custom_call @mosaic_gpu") == 1 and "stablehlo.scatter" not in lowered
        assert "tf.aliasing_output = 0" in lowered, "x not aliased to the result"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4099, 37], ids=lambda r: f"rows{r}")
def test_several_results_in_one_call_on_the_gpu(rows):
    """Compiled: one kernel call filling results of different shapes and flags (and, with 4099 rows, over the limit
    through `set_rows_many`), each bit-identical to the scatter; under `vmap` too."""
    fills = _several(seed=rows)
    if rows > 100:
        fills = [(jnp.tile(x, (rows // x.shape[0] + 1, 1, 1))[:rows], jnp.resize(z, rows), jnp.resize(n, rows))
                 for x, z, n in fills]  # fmt: skip
    expected = [_bits(jax.jit(row_fill.set_rows_scatter)(*fill)) for fill in fills]
    for run in (row_fill.set_rows_kernel_many, row_fill.set_rows_many):
        actual = jax.jit(run)(fills)
        for result, fill, bits in zip(actual, fills, expected, strict=True):
            _check(result, *fill)
            np.testing.assert_array_equal(_bits(result), bits)
    stacked = [tuple(jnp.stack([a, a]) for a in fill) for fill in fills]
    for result, bits in zip(jax.jit(jax.vmap(row_fill.set_rows_kernel_many))(stacked), expected, strict=True):
        np.testing.assert_array_equal(_bits(result[1]), bits)


@pytest.mark.gpu
def test_kernel_under_vmap_on_the_gpu():
    for kernel, scatter, args in _vmapped_cases():
        np.testing.assert_array_equal(_bits(jax.jit(kernel)(*args)), _bits(jax.jit(scatter)(*args)))


@pytest.mark.gpu
def test_kernel_on_the_gpu_writes_in_place():
    """The input buffer is donated to the kernel: no copy of the array in the compiled module."""
    x, zero, nan = _case((4099, 32, 128), jnp.bfloat16, seed=3)
    compiled = jax.jit(row_fill.set_rows, donate_argnums=0).lower(x, zero, nan).compile().as_text()
    assert " copy(" not in compiled and "copy-start" not in compiled, compiled[:2000]
    fills = lambda xs, zero, nan: row_fill.set_rows_many([(x, zero, nan) for x in xs])  # noqa: E731
    compiled = jax.jit(fills, donate_argnums=0).lower((x, -x, 2 * x), zero, nan).compile().as_text()
    assert compiled.count("custom-call(") == 1, compiled[:2000]
    assert " copy(" not in compiled and "copy-start" not in compiled, compiled[:2000]


def test_falls_back_to_the_scatter_without_pallas_mosaic_gpu(monkeypatch, caplog):
    """A JAX without Pallas' Mosaic GPU backend (on a GPU): the scatter runs, and says so once at WARNING."""
    import sys

    import jax.experimental.pallas as pallas

    from attnlib._src import logs

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.mosaic_gpu", None)  # import fails
    monkeypatch.delattr(pallas, "mosaic_gpu", raising=False)
    monkeypatch.setattr(logs, "_logged", set())
    place_calls_on(monkeypatch, "gpu")
    x, zero, nan = _case((2053, 64, 32), jnp.float32)  # over SCATTER_MAX_BYTES: the kernel's
    assert row_fill.runs_kernel(x)
    with caplog.at_level("WARNING", logger="attnlib"):
        actual = row_fill.set_rows(x, zero, nan)
        row_fill.set_rows(x, zero, nan)
    _check(actual, x, zero, nan)
    warnings = [r.getMessage() for r in caplog.records if "Mosaic GPU backend is unavailable" in r.getMessage()]
    assert len(warnings) == 1, warnings
