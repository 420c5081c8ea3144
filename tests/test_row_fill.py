"""`row_fill.set_rows`: chosen rows of a packed result set to 0 or NaN, every other bit untouched.

The Pallas kernel is checked on the CPU in Pallas' GPU interpreter and on the GPU compiled (Mosaic GPU), each against
a NumPy reference written from the definition, and bit for bit against the XLA scatter it replaces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    actual = jax.jit(lambda *a: row_fill._run_kernel(*a, interpret=True, parts=parts))(x, zero, nan)
    _check(actual, x, zero, nan)
    np.testing.assert_array_equal(_bits(actual), _bits(row_fill.set_rows_scatter(x, zero, nan)))


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
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
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
@pytest.mark.parametrize("shape", SHAPES + UNALIGNED + [(4099, 32, 128), (4099, 8)], ids=str)
def test_kernel_on_the_gpu(shape, dtype):
    """Compiled on the GPU: `set_rows` runs the Mosaic GPU kernel on results over `SCATTER_MAX_BYTES` whose rows it can
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


@pytest.mark.parametrize("shape", SHAPES + UNALIGNED + [(4099, 32, 128), (4099, 8), (2053, 64, 32)], ids=str)
def test_set_rows_lowers_to_the_kernel_exactly_where_chosen(shape, monkeypatch):
    """Lowered for CUDA on this machine (as JAX on a GPU traces it): the Mosaic GPU kernel where `runs_kernel`, XLA's
    scatter elsewhere, never both."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, zero, nan = _case(shape, jnp.float32)
    lowered = jax.jit(row_fill.set_rows).trace(x, zero, nan).lower(lowering_platforms=("cuda",)).as_text()
    kernel = "custom_call @mosaic_gpu" in lowered
    assert kernel == row_fill.runs_kernel(x)
    assert kernel != ("stablehlo.scatter" in lowered)


def test_small_results_take_the_scatter():
    """The kernel runs only on results larger than `SCATTER_MAX_BYTES` whose rows it can copy."""
    limit = row_fill.SCATTER_MAX_BYTES
    at_limit = jax.ShapeDtypeStruct((limit // 256, 64), jnp.float32)  # 256-byte rows
    above = jax.ShapeDtypeStruct((limit // 256 + 1, 64), jnp.float32)
    unaligned = jax.ShapeDtypeStruct((limit // 6 + 1, 3), jnp.float16)  # 6-byte rows, over the limit
    assert row_fill.kernel_takes(at_limit) and not row_fill.runs_kernel(at_limit)
    assert row_fill.runs_kernel(above)
    assert not row_fill.kernel_takes(unaligned) and not row_fill.runs_kernel(unaligned)


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
def test_kernel_under_vmap_on_the_gpu():
    for kernel, scatter, args in _vmapped_cases():
        np.testing.assert_array_equal(_bits(jax.jit(kernel)(*args)), _bits(jax.jit(scatter)(*args)))


@pytest.mark.gpu
def test_kernel_on_the_gpu_writes_in_place():
    """The input buffer is donated to the kernel: no copy of the array in the compiled module."""
    x, zero, nan = _case((4099, 32, 128), jnp.bfloat16, seed=3)
    compiled = jax.jit(row_fill.set_rows, donate_argnums=0).lower(x, zero, nan).compile().as_text()
    assert " copy(" not in compiled and "copy-start" not in compiled, compiled[:2000]


def test_falls_back_to_the_scatter_without_pallas_mosaic_gpu(monkeypatch, caplog):
    """A JAX without Pallas' Mosaic GPU backend (on a GPU): the scatter runs, and says so once at WARNING."""
    import sys

    import jax.experimental.pallas as pallas

    from attnlib._src import logs

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.mosaic_gpu", None)  # import fails
    monkeypatch.delattr(pallas, "mosaic_gpu", raising=False)
    monkeypatch.setattr(logs, "_logged", set())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x, zero, nan = _case((2053, 64, 32), jnp.float32)  # over SCATTER_MAX_BYTES: the kernel's
    assert row_fill.runs_kernel(x)
    with caplog.at_level("WARNING", logger="attnlib"):
        actual = row_fill.set_rows(x, zero, nan)
        row_fill.set_rows(x, zero, nan)
    _check(actual, x, zero, nan)
    warnings = [r.getMessage() for r in caplog.records if "Mosaic GPU backend is unavailable" in r.getMessage()]
    assert len(warnings) == 1, warnings
