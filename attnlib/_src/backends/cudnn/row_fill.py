"""Set chosen rows of a packed result to 0 or NaN in place, at a cost that scales with the rows set.

cuDNN's ragged graphs leave the rows outside every sequence unwritten (`varlen.py`). XLA's scatter, given one index
per row, runs a thread per element of the whole array whether or not the row is set: 160 us on a `[32768, 32, 128]`
bf16 output on the H200, as much as rewriting it (`docs/performance.md`). On a GPU this is a Pallas Mosaic GPU kernel
instead: the flags are packed into two 32-bit masks per 32 rows (rows to zero, rows to NaN); `PROGRAMS_PER_WORD`
programs per mask word return at once when both are 0, else fill a shared-memory buffer with 0 or NaN and bulk-copy it
into their share of the flagged rows only (a run of copies when all 32 rows are flagged alike, else one per row). `x`
is handed to the kernel as a reference, so its buffer is aliased to the result and unflagged rows are never read or
written.

The copies need rows of a multiple of 16 bytes; other rows, results of at most `SCATTER_MAX_BYTES` (where a pass over
the result is cheap) and every platform but a GPU (where the tests emulate cuDNN) take `set_rows_scatter`, the XLA
scatter the kernel replaced (same values; the NaN payload may differ), which is also the benchmarks' "before". The
kernel's own tests run it in Pallas' GPU interpreter on the CPU.
"""

import functools
import logging
import math

import jax
import jax.numpy as jnp

from ... import logs


ROWS_PER_WORD = 32  # rows per mask word
PROGRAMS_PER_WORD = 4  # programs sharing a word's copies (docs/performance.md: 4 measured fastest on the H200)
SCATTER_MAX_BYTES = 4 << 20
"""Results up to this size take XLA's scatter, the faster of the two there (4 MB: 2.9 us, the kernel 5.4; 8 MB: 11.6
against 4.9; docs/performance.md, "H200: packed sequences and paged decoding")."""
FILL_BYTES = 16 * 1024  # shared memory of each of the two fill buffers (0 and NaN)


def _mosaic_gpu():
    from jax.experimental.pallas import mosaic_gpu  # imported on first use: `import attnlib` stays light

    return mosaic_gpu


def _interpret_params():
    """Pallas' GPU interpreter (`InterpretGPUParams`: public from jax 0.11, private before)."""
    mosaic_gpu = _mosaic_gpu()
    if hasattr(mosaic_gpu, "InterpretGPUParams"):
        return mosaic_gpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def runs_kernel(x: jax.Array) -> bool:
    """Whether `set_rows` runs the kernel on `x` on a GPU: rows the kernel can copy, in a result larger than
    `SCATTER_MAX_BYTES`."""
    return kernel_takes(x) and x.size * x.dtype.itemsize > SCATTER_MAX_BYTES


def kernel_takes(x: jax.Array) -> bool:
    """Whether the kernel can fill `x`'s rows: rows of a multiple of 16 bytes (bulk copies), int32 offsets."""
    rows, columns = x.shape[0], math.prod(x.shape[1:])
    return rows > 0 and columns > 0 and columns * x.dtype.itemsize % 16 == 0 and rows * columns < 2**31


def row_masks(zero: jax.Array, nan: jax.Array) -> jax.Array:
    """int32 `[ceil(T / 32), 2]`: bit i of `[w, 0]` / `[w, 1]` set where row `32 w + i` is to be 0 / NaN (NaN wins);
    rows past T unset. One XLA fusion: each row's code (0 kept, 1 zero, 2 NaN) is compared with both kinds at once;
    stacking the two flag arrays instead costs a second kernel (a concatenation) before the fill."""
    rows = zero.shape[0]
    words = -(-rows // ROWS_PER_WORD)
    codes = jnp.where(nan, 2, jnp.where(zero, 1, 0)).astype(jnp.int32)
    codes = jnp.reshape(jnp.pad(codes, (0, words * ROWS_PER_WORD - rows)), (words, ROWS_PER_WORD, 1))
    flags = codes == jnp.array([[[1, 2]]], jnp.int32)  # [words, 32, 2]: to zero, to NaN
    bits = jnp.left_shift(jnp.uint32(1), jnp.arange(ROWS_PER_WORD, dtype=jnp.uint32))[:, None]
    packed = jnp.sum(jnp.where(flags, bits, jnp.uint32(0)), axis=1, dtype=jnp.uint32)
    return jax.lax.bitcast_convert_type(packed, jnp.int32)


def _copy_size(elements: int, itemsize: int, limit: int = FILL_BYTES) -> int:
    """The largest divisor of `elements` of at most `limit` bytes and a multiple of 16 bytes."""
    best = 0
    for d in range(1, math.isqrt(elements) + 1):
        if elements % d == 0:
            for size in (d, elements // d):
                if size * itemsize <= limit and size * itemsize % 16 == 0:
                    best = max(best, size)
    assert best, (elements, itemsize)  # rows of 16-byte multiples always have one
    return best


def _repeat(count: int, fn) -> None:
    """`fn(k)` for k in range(count), unrolled when short."""
    if count <= 8:
        for k in range(count):
            fn(k)
    else:
        jax.lax.fori_loop(0, count, lambda k, carry: (fn(k), carry)[1], 0)


def _part_rows(parts: int) -> int:
    """int32 mask of the rows `i % parts == 0` of a word (shifted left by `part` it selects that part's rows)."""
    bits = sum(1 << (j * parts) for j in range(ROWS_PER_WORD // parts))
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _fill_kernel(masks_ref, x_ref, zeros, nans, *, columns: int, row_copy: int, word_copy: int, parts: int):
    """`parts` programs per mask word: bulk copies of 0 / NaN from shared memory into the word's flagged rows of the
    flat `x_ref`. Part `p` copies the `p`-th `1 / parts` of a wholly flagged word and, of a partly flagged one, the
    rows `i % parts == p`."""
    from jax.experimental import pallas as pl

    mosaic_gpu = _mosaic_gpu()
    word = jax.lax.axis_index("words")
    part = jax.lax.axis_index("parts") if parts > 1 else 0
    zero_mask, nan_mask = masks_ref[word, 0], masks_ref[word, 1]
    first_row = word * ROWS_PER_WORD
    mine = jnp.left_shift(jnp.int32(_part_rows(parts)), part)  # this part's rows of a partly flagged word
    whole = ROWS_PER_WORD * columns // parts  # elements of a wholly flagged word per part

    def store(fill, start, elements: int, size: int):  # x[start : start + elements] = fill, in copies of `size`
        def copy(k):
            mosaic_gpu.copy_smem_to_gmem(fill.at[pl.ds(0, size)], x_ref.at[pl.ds(start + k * size, size)])

        _repeat(elements // size, copy)

    def fill_rows(fill, mask):  # the part's rows of `mask`'s set bits (bit i: row `first_row + i`)
        @pl.when(mask == -1)  # all 32 rows: one contiguous run, split between the parts
        def _whole():
            store(fill, first_row * columns + part * whole, whole, word_copy)

        @pl.when((mask != 0) & (mask != -1))
        def _some():
            def one_row(mask):
                lowest = mask & -mask
                store(fill, (first_row + 31 - jax.lax.clz(lowest)) * columns, columns, row_copy)
                return mask ^ lowest

            jax.lax.while_loop(lambda mask: mask != 0, one_row, mask & mine)

    busy = lambda mask: (mask == -1) | ((mask & mine) != 0)  # noqa: E731

    @pl.when(busy(zero_mask) | busy(nan_mask))
    def _fill():
        @pl.when(busy(zero_mask))
        def _():
            zeros[...] = jnp.zeros(zeros.shape, zeros.dtype)

        @pl.when(busy(nan_mask))
        def _():
            nans[...] = jnp.full(nans.shape, jnp.nan, nans.dtype)

        mosaic_gpu.commit_smem()  # the shared-memory stores, visible to the copy engine
        fill_rows(zeros, zero_mask)
        fill_rows(nans, nan_mask)
        mosaic_gpu.wait_smem_to_gmem(0)  # the buffers must outlive the copies that read them


def _run_kernel(
    x: jax.Array,
    zero: jax.Array,
    nan: jax.Array,
    interpret: bool,
    parts: int = PROGRAMS_PER_WORD,
    fill_bytes: int = FILL_BYTES,
) -> jax.Array:
    """The kernel with `parts` programs per mask word (reduced to a divisor of 32) and fill buffers of at most
    `fill_bytes` (other values than the library's for `benchmarks/probe_row_fill.py`)."""
    from jax.experimental import pallas as pl

    mosaic_gpu = _mosaic_gpu()
    rows, columns = x.shape[0], math.prod(x.shape[1:])
    row_copy = _copy_size(columns, x.dtype.itemsize, fill_bytes)
    parts = math.gcd(parts, ROWS_PER_WORD)
    word_copy = _copy_size(ROWS_PER_WORD * columns // parts, x.dtype.itemsize, fill_bytes)
    buffer = -(-word_copy // 1024) * 1024  # whole vector stores for each of the 128 threads
    masks = row_masks(zero, nan)
    body = functools.partial(_fill_kernel, columns=columns, row_copy=row_copy, word_copy=word_copy, parts=parts)
    scratch = (mosaic_gpu.SMEM((buffer,), x.dtype), mosaic_gpu.SMEM((buffer,), x.dtype))

    def kernel(masks_ref, x_ref):
        pl.run_scoped(lambda zeros, nans: body(masks_ref, x_ref, zeros, nans), *scratch)

    grid, names = ((masks.shape[0],), ("words",)) if parts == 1 else ((masks.shape[0], parts), ("words", "parts"))
    mesh = mosaic_gpu.Mesh(grid=grid, grid_names=names, kernel_name="attnlib_set_rows")
    fill = pl.kernel(kernel, out_type=(), mesh=mesh, compiler_params=mosaic_gpu.CompilerParams(),
                     interpret=_interpret_params() if interpret else False)  # fmt: skip

    # `x` handed to the kernel as a reference, which aliases its buffer to the result (no copy when the caller's `x`
    # is dead). Compiled, `run_state` keeps the reference inside (no effect escapes into `custom_vmap` or the
    # caller); Pallas' GPU interpreter needs the reference's memory space, which only `new_ref` gives.
    flat = jnp.reshape(x, (rows * columns,))
    if interpret:
        x_ref = jax.new_ref(flat, memory_space=mosaic_gpu.GMEM)
        fill(masks, x_ref)
        return jnp.reshape(jax.freeze(x_ref), x.shape)

    def run(refs):
        masks_ref, x_ref = refs
        fill(masks_ref[...], x_ref)

    _, flat = pl.run_state(run)((masks, flat))
    return jnp.reshape(flat, x.shape)


@jax.custom_batching.custom_vmap
def _batchable_kernel(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """The compiled kernel, also under `vmap`: Pallas' kernels take no batch axis, so the mapped axis is folded into
    the rows."""
    if not kernel_takes(x):  # only a fold under `vmap` can grow past int32 offsets
        return set_rows_scatter(x, zero, nan)
    return _run_kernel(x, zero, nan, interpret=False)


@_batchable_kernel.def_vmap
def _fold(axis_size, in_batched, x, zero, nan):
    x, zero, nan = (a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                    for a, batched in zip((x, zero, nan), in_batched))  # fmt: skip
    rows = (-1, *x.shape[2:])
    folded = _batchable_kernel(jnp.reshape(x, rows), jnp.reshape(zero, (-1,)), jnp.reshape(nan, (-1,)))
    return jnp.reshape(folded, x.shape), True


def set_rows_kernel(x: jax.Array, zero: jax.Array, nan: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The Mosaic GPU kernel alone, for `x` that `kernel_takes` (`interpret=True` runs it in Pallas' GPU interpreter
    on any platform, for tests; not under `vmap`)."""
    if not kernel_takes(x):
        raise ValueError(f"row_fill: rows of {x.shape[1:]} {x.dtype} are not a multiple of 16 bytes")
    if interpret:
        return _run_kernel(x, zero, nan, interpret=True)
    return _batchable_kernel(x, zero, nan)


def set_rows_scatter(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """The same with XLA's scatter (a thread per element of `x`)."""
    rows = x.shape[0]
    index = jnp.where(zero | nan, jnp.arange(rows, dtype=jnp.int32), rows)
    value = jnp.where(nan, jnp.nan, 0.0).astype(x.dtype)
    updates = jnp.broadcast_to(jnp.reshape(value, (rows,) + (1,) * (x.ndim - 1)), x.shape)
    return x.at[index].set(updates, mode="drop")


def set_rows(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """`x` `[T, ...]` with rows `zero` set to 0 and rows `nan` to NaN (`nan` wins where both are set).

    Args:
        x: floating `[T, ...]`.
        zero, nan: bool `[T]`.
    """
    # `jax.lax.platform_dependent` would choose at lowering, but leaves a `case` in the lowered module.
    if jax.default_backend() != "gpu":  # the CPU emulation of cuDNN in tests
        return set_rows_scatter(x, zero, nan)
    if x.size == 0:
        return x
    if not kernel_takes(x):
        logs.log_once(("row_fill", "unaligned", x.shape[1:], str(x.dtype)), logging.DEBUG,
                      "attnlib: rows of %s %s are not a multiple of 16 bytes; XLA's scatter sets the rows outside "
                      "THD/packed sequences (a pass over the result).", x.shape[1:], x.dtype)  # fmt: skip
        return set_rows_scatter(x, zero, nan)
    if not runs_kernel(x):  # a small result: the scatter is as fast
        return set_rows_scatter(x, zero, nan)
    try:
        _mosaic_gpu()
    except ImportError as error:  # a JAX without Pallas' Mosaic GPU backend
        logs.log_once(("row_fill", "scatter"), logging.WARNING,
                      "attnlib: Pallas' Mosaic GPU backend is unavailable (%s); the rows outside THD/packed sequences "
                      "are set by XLA's scatter, which costs a pass over each result.", error)  # fmt: skip
        return set_rows_scatter(x, zero, nan)
    return set_rows_kernel(x, zero, nan)
