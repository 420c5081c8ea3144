"""Set chosen rows of a packed result to 0 or NaN in place, at a cost that scales with the rows set.

cuDNN's ragged graphs leave the rows outside every sequence unwritten (`varlen.py`). XLA's scatter, given one index
per row, runs a thread per element of the whole array whether or not the row is set: 160 us on a `[32768, 32, 128]`
bf16 output on the H200, as much as rewriting it (`docs/performance.md`). On a GPU this is a Pallas Mosaic GPU kernel
instead: the flags are packed into two 32-bit masks per 32 rows (rows to zero, rows to NaN); `PROGRAMS_PER_WORD`
programs per mask word return at once when both are 0, else fill a shared-memory buffer with 0 or NaN and bulk-copy it
into their share of the flagged rows only (a run of copies when all 32 rows are flagged alike, else one per row). `x`
is handed to the kernel as a reference, so its buffer is aliased to the result and unflagged rows are never read or
written.

`set_rows_many` fills several results in one kernel call (a ragged backward's dQ, dK and dV): the grid runs over the
mask words of each result in turn, each program filling its word of the result it falls in. The call costs about what
one fill does, so three results take one call instead of three (docs/performance.md).

The copies need rows of a multiple of 16 bytes; other rows, small results (`kernel_share`: where a pass over the
result is cheap) and every platform but a GPU (where the tests emulate cuDNN) take `set_rows_scatter`, the XLA
scatter the kernel replaced (same values; the NaN payload may differ), which is also the benchmarks' "before". The
kernel's own tests run it in Pallas' GPU interpreter on the CPU.
"""

import collections
import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ... import logs
from .. import placement


ROWS_PER_WORD = 32  # rows per mask word
PROGRAMS_PER_WORD = 4  # programs sharing a word's copies (4 measured fastest on the H200; docs/performance.md)
SCATTER_MAX_BYTES = 4 << 20
"""Results of one dtype holding at most this much together take XLA's scatter, the faster of the two there on narrow
rows (a 4 MB `[32768, 32]` f32: 2.7 us, the kernel 5.7; docs/performance.md, "How attnlib's choices were
measured")."""
WIDE_ROW_BYTES = 1 << 10
WIDE_SCATTER_MAX_BYTES = 1 << 20
"""The same limit where every row holds at least `WIDE_ROW_BYTES` (outputs and gradients, `[T, heads, dim]`), where the
scatter slows with the row's width (a 2 MB `[1024, 16, 64]` bf16: 5.5 us, the kernel 3.9)."""
FILL_BYTES = 16 * 1024  # shared memory of each of the two fill buffers (0 and NaN)

Fill = tuple[jax.Array, jax.Array, jax.Array]
"""`(x, zero, nan)`: a result `[T, ...]` and bool `[T]` flags of its rows to set to 0 and to NaN."""


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


def kernel_share(xs: Sequence[jax.Array]) -> list[bool]:
    """Which of `xs` `set_rows_many` hands to the kernel on a GPU: those whose rows it can copy, of a dtype whose
    results of that kind (one kernel call fills them all) hold more than `SCATTER_MAX_BYTES` together, or more than
    `WIDE_SCATTER_MAX_BYTES` where each of their rows holds at least `WIDE_ROW_BYTES`."""
    takes = [kernel_takes(x) for x in xs]
    group_bytes, narrow = collections.Counter(), set()
    for x, kernel in zip(xs, takes):
        if kernel:
            group_bytes[jnp.dtype(x.dtype)] += x.size * x.dtype.itemsize
            if x.size // x.shape[0] * x.dtype.itemsize < WIDE_ROW_BYTES:
                narrow.add(jnp.dtype(x.dtype))
    limit = lambda dtype: SCATTER_MAX_BYTES if dtype in narrow else WIDE_SCATTER_MAX_BYTES  # noqa: E731
    return [kernel and group_bytes[jnp.dtype(x.dtype)] > limit(jnp.dtype(x.dtype)) for x, kernel in zip(xs, takes)]


def runs_kernel(x: jax.Array) -> bool:
    """Whether `set_rows` runs the kernel on `x` on a GPU (`kernel_share` of `x` alone)."""
    return kernel_share([x])[0]


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


def _copy_size(elements: int, itemsize: int) -> int:
    """The largest divisor of `elements` of at most `FILL_BYTES` bytes and a multiple of 16 bytes."""
    best = 0
    for d in range(1, math.isqrt(elements) + 1):
        if elements % d == 0:
            for size in (d, elements // d):
                if size * itemsize <= FILL_BYTES and size * itemsize % 16 == 0:
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


def _fill_word(masks_ref, x_ref, zeros, nans, word, part, *, columns: int, row_copy: int, word_copy: int, parts: int):
    """Part `part` of the `parts` programs of mask word `word` of one result: bulk copies of 0 / NaN from shared
    memory into the word's flagged rows of the flat `x_ref`. Part `p` copies the `p`-th `1 / parts` of a wholly
    flagged word and, of a partly flagged one, the rows `i % parts == p`."""
    from jax.experimental import pallas as pl

    mosaic_gpu = _mosaic_gpu()
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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """One result's share of a kernel call: its mask words `first_word` to `first_word + words` of the call's grid,
    the flags it is set by (`owner`: index into the call's distinct flag pairs), and its static copy sizes."""

    first_word: int
    words: int
    owner: int
    columns: int
    row_copy: int
    word_copy: int


def _fill_kernel(*refs, plans: tuple[_Plan, ...], owners: int, parts: int):
    """A program of the grid (mask words of every result one after another, `parts` programs per word) fills its word
    of the result that owns it. `refs`: the masks of each flag pair, each result, the two fill buffers."""
    from jax.experimental import pallas as pl

    masks_refs, x_refs, (zeros, nans) = refs[:owners], refs[owners:-2], refs[-2:]
    word = jax.lax.axis_index("words")
    part = jax.lax.axis_index("parts") if parts > 1 else 0
    for plan, x_ref in zip(plans, x_refs):
        fill = functools.partial(_fill_word, masks_refs[plan.owner], x_ref, zeros, nans, part=part, parts=parts,
                                 columns=plan.columns, row_copy=plan.row_copy, word_copy=plan.word_copy)  # fmt: skip
        if len(plans) == 1:
            fill(word)
        else:
            local = word - plan.first_word
            pl.when((local >= 0) & (local < plan.words))(functools.partial(fill, local))


def _run_kernel(
    xs: Sequence[jax.Array],
    flags: Sequence[tuple[jax.Array, jax.Array]],
    owners: Sequence[int],
    interpret: bool,
    parts: int = PROGRAMS_PER_WORD,
) -> list[jax.Array]:
    """One kernel call setting the rows of every result in `xs` (one dtype, each one `kernel_takes`): result `i` by the
    flag pair `flags[owners[i]]` (zero, nan). `parts` programs per mask word (reduced to a divisor of 32; the tests
    vary it), fill buffers of at most `FILL_BYTES`."""
    from jax.experimental import pallas as pl

    mosaic_gpu = _mosaic_gpu()
    dtype = xs[0].dtype
    parts = math.gcd(parts, ROWS_PER_WORD)
    plans, words = [], 0
    for x, owner in zip(xs, owners, strict=True):
        columns = math.prod(x.shape[1:])
        row_copy = _copy_size(columns, dtype.itemsize)
        word_copy = _copy_size(ROWS_PER_WORD * columns // parts, dtype.itemsize)
        plans.append(_Plan(first_word=words, words=-(-x.shape[0] // ROWS_PER_WORD), owner=owner, columns=columns,
                           row_copy=row_copy, word_copy=word_copy))  # fmt: skip
        words += plans[-1].words
    buffer = max(-(-plan.word_copy // 1024) * 1024 for plan in plans)  # whole vector stores for each of 128 threads
    masks = tuple(row_masks(zero, nan) for zero, nan in flags)
    body = functools.partial(_fill_kernel, plans=tuple(plans), owners=len(masks), parts=parts)
    scratch = (mosaic_gpu.SMEM((buffer,), dtype), mosaic_gpu.SMEM((buffer,), dtype))

    def kernel(*refs):
        pl.run_scoped(lambda zeros, nans: body(*refs, zeros, nans), *scratch)

    grid, names = ((words,), ("words",)) if parts == 1 else ((words, parts), ("words", "parts"))
    mesh = mosaic_gpu.Mesh(grid=grid, grid_names=names, kernel_name="attnlib_set_rows")
    fill = pl.kernel(kernel, out_type=(), mesh=mesh, compiler_params=mosaic_gpu.CompilerParams(),
                     interpret=_interpret_params() if interpret else False)  # fmt: skip

    # Each result handed to the kernel as a reference, which aliases its buffer to the result (no copy when the
    # caller's `x` is dead). Compiled, `run_state` keeps the references inside (no effect escapes into `custom_vmap`
    # or the caller); Pallas' GPU interpreter needs the references' memory space, which only `new_ref` gives.
    flats = tuple(jnp.reshape(x, (-1,)) for x in xs)
    if interpret:
        x_refs = [jax.new_ref(flat, memory_space=mosaic_gpu.GMEM) for flat in flats]
        fill(*masks, *x_refs)
        flats = tuple(jax.freeze(x_ref) for x_ref in x_refs)
    else:

        def run(refs):
            masks_refs, x_refs = refs
            fill(*(masks_ref[...] for masks_ref in masks_refs), *x_refs)

        _, flats = pl.run_state(run)((masks, flats))
    return [jnp.reshape(flat, x.shape) for flat, x in zip(flats, xs)]


def _kernel_where_it_takes(xs, flags, owners) -> list[jax.Array]:
    """The compiled kernel on the results it takes, XLA's scatter on the others (only a fold under `vmap` can grow a
    result past int32 offsets)."""
    takes = [i for i, x in enumerate(xs) if kernel_takes(x)]
    out = [x if i in takes else set_rows_scatter(x, *flags[owner]) for i, (x, owner) in enumerate(zip(xs, owners))]
    if takes:
        used = sorted({owners[i] for i in takes})
        filled = _run_kernel([xs[i] for i in takes], [flags[o] for o in used], [used.index(owners[i]) for i in takes],
                             interpret=False)  # fmt: skip
        for i, x in zip(takes, filled):
            out[i] = x
    return out


@functools.cache
def _batchable_kernel(owners: tuple[int, ...]):
    """The compiled kernel for results set by flag pairs `owners`, also under `vmap`: Pallas' kernels take no batch
    axis, so the mapped axis is folded into each result's rows."""

    @jax.custom_batching.custom_vmap
    def kernel(xs, flags):
        return tuple(_kernel_where_it_takes(xs, flags, owners))

    @kernel.def_vmap
    def _fold(axis_size, in_batched, xs, flags):
        xs, flags = jax.tree.map(lambda a, batched: a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)),
                                 (xs, flags), tuple(in_batched))  # fmt: skip
        folded = kernel(tuple(jnp.reshape(x, (-1, *x.shape[2:])) for x in xs),
                        jax.tree.map(lambda a: jnp.reshape(a, (-1,)), flags))  # fmt: skip
        return tuple(jnp.reshape(f, x.shape) for f, x in zip(folded, xs)), (True,) * len(xs)

    return kernel


def _flag_pairs(fills) -> tuple[list[tuple[jax.Array, jax.Array]], tuple[int, ...]]:
    """The distinct (zero, nan) pairs of `fills` (the same arrays: one set of masks) and each fill's pair."""
    pairs, owners = [], []
    for _, zero, nan in fills:
        owner = next((i for i, (z, n) in enumerate(pairs) if z is zero and n is nan), len(pairs))
        if owner == len(pairs):
            pairs.append((zero, nan))
        owners.append(owner)
    return pairs, tuple(owners)


def set_rows_kernel_many(fills: Sequence[Fill], *, interpret: bool = False) -> list[jax.Array]:
    """The Mosaic GPU kernel alone, one call for every `(x, zero, nan)` of `fills` (one dtype, each `x` one that
    `kernel_takes`; `interpret=True` runs it in Pallas' GPU interpreter on any platform, for tests; not under
    `vmap`)."""
    for x, _, _ in fills:
        if not kernel_takes(x):
            raise ValueError(f"row_fill: rows of {x.shape[1:]} {x.dtype} are not a multiple of 16 bytes")
    if len({jnp.dtype(x.dtype) for x, _, _ in fills}) > 1:
        raise ValueError(f"row_fill: one kernel call fills results of one dtype, got {[x.dtype for x, _, _ in fills]}")
    pairs, owners = _flag_pairs(fills)
    xs = [x for x, _, _ in fills]
    if interpret:
        return _run_kernel(xs, pairs, owners, interpret=True)
    return list(_batchable_kernel(owners)(tuple(xs), tuple(pairs)))


def set_rows_kernel(x: jax.Array, zero: jax.Array, nan: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`set_rows_kernel_many` on one result."""
    return set_rows_kernel_many([(x, zero, nan)], interpret=interpret)[0]


def set_rows_scatter(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """The same with XLA's scatter (a thread per element of `x`)."""
    rows = x.shape[0]
    index = jnp.where(zero | nan, jnp.arange(rows, dtype=jnp.int32), rows)
    value = jnp.where(nan, jnp.nan, 0.0).astype(x.dtype)
    updates = jnp.broadcast_to(jnp.reshape(value, (rows,) + (1,) * (x.ndim - 1)), x.shape)
    return x.at[index].set(updates, mode="drop")


def set_rows_many(fills: Sequence[Fill]) -> list[jax.Array]:
    """`set_rows` on each `(x, zero, nan)` of `fills`; on a GPU the results the kernel fills (`kernel_share`) take one
    kernel call per dtype, which costs about what one fill does (`docs/performance.md`)."""
    fills = list(fills)
    out = [x for x, _, _ in fills]
    # `jax.lax.platform_dependent` would choose at lowering, but leaves a `case` in the lowered module.
    if placement.placement_platform() != "gpu":  # the CPU emulation of cuDNN in tests
        return [set_rows_scatter(*fill) for fill in fills]
    share = kernel_share(out)
    for i, (x, zero, nan) in enumerate(fills):
        if x.size and not kernel_takes(x):
            logs.log_once(("row_fill", "unaligned", x.shape[1:], str(x.dtype)), logging.DEBUG,
                          "attnlib: rows of %s %s are not a multiple of 16 bytes; XLA's scatter sets the rows outside "
                          "THD/packed sequences (a pass over the result).", x.shape[1:], x.dtype)  # fmt: skip
        if x.size and not share[i]:  # unaligned rows, or small results: the scatter is as fast there
            out[i] = set_rows_scatter(x, zero, nan)
    if any(share):
        try:
            _mosaic_gpu()
        except ImportError as error:  # a JAX without Pallas' Mosaic GPU backend
            logs.log_once(("row_fill", "scatter"), logging.WARNING,
                          "attnlib: Pallas' Mosaic GPU backend is unavailable (%s); the rows outside THD/packed "
                          "sequences are set by XLA's scatter, a pass over each result.", error)  # fmt: skip
            return [set_rows_scatter(*fill) if kernel else x for fill, kernel, x in zip(fills, share, out)]
    groups = collections.defaultdict(list)  # dtype -> the results of one kernel call
    for i, (x, kernel) in enumerate(zip(out, share)):
        if kernel:
            groups[jnp.dtype(x.dtype)].append(i)
    for group in groups.values():
        for i, filled in zip(group, set_rows_kernel_many([fills[i] for i in group])):
            out[i] = filled
    return out


def set_rows(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """`x` `[T, ...]` with rows `zero` set to 0 and rows `nan` to NaN (`nan` wins where both are set).

    Args:
        x: floating `[T, ...]`.
        zero, nan: bool `[T]`.
    """
    return set_rows_many([(x, zero, nan)])[0]
