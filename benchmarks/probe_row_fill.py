"""Probe (H200): Pallas Mosaic GPU candidates for attnlib's row fill (`row_fill.set_rows`), checked and timed.

Usage: python benchmarks/probe_row_fill.py              H200: check every candidate against XLA's scatter, time it
       python benchmarks/probe_row_fill.py --interpret  any machine: check the Mosaic GPU candidates in Pallas' GPU
                                                        interpreter on small shapes (no timing)
       python benchmarks/probe_row_fill.py --lower      any machine: lower the Mosaic GPU candidates for CUDA on the
                                                        benchmark's shapes (Pallas -> Mosaic GPU MLIR, no PTX)
       --fori: time with a `lax.fori_loop` instead of an unrolled chain; --calls N: fills per timed chain (20);
       --only TEXT ...: the cases whose label (spaces as _) contains one; --candidates NAME ...: those candidates only;
       --profile: after timing a case, each candidate's kernels per fill and the chain's span (JAX's profiler;
                 with --thd: each variant's forward, kernels and span per call)
       --backward: the fills of a ragged backward instead (dQ, dK, dV: three results, two flag pairs), per call
       --thd: attnlib's THD attention (forward, forward + backward) with each way of filling rows, per call

`row_fill.py` ran a kernel on Pallas' Triton backend (here `set_rows_triton`, the "before"), which jax 0.11.2
deprecates. `set_rows(x, zero, nan)` must keep costing what the rows set cost, not a pass over `x`. Both candidates
keep `x` aliased to the result: they hand `pl.kernel` a GMEM `Ref` of it, which becomes an input/output alias of the
Mosaic GPU custom call (jax 0.11.2 lowers Mosaic GPU kernels only through `pl.kernel` / `plgpu.kernel`;
`pl.pallas_call` no longer reaches Mosaic GPU).

- `set_rows_mosaic` (A, read-modify-write): `x` viewed as `[T, C]`; a program per block of 128 rows and `Cb` columns
  loads its 128 flags (one per thread) and, only if one is set, TMA-copies the block GMEM -> SMEM, computes
  `where(flag == NaN, nan, where(flag == ZERO, 0, x))` in registers (WGMMA layout, the flags broadcast along rows),
  stores it to SMEM and TMA-copies it back. The last block's copies stop at row T (static sizes).
- `mosaic_b` (B, store-only): the library's kernel, `row_fill.set_rows_kernel` (its docstring says how it works):
  the flags packed into two 32-bit masks per 32 rows, bulk copies of 0 / NaN from SMEM into the flagged rows only,
  `x` never read.
- `mosaic_b1`, `mosaic_b2`, `mosaic_b4`, `mosaic_b8`: B with 1, 2, 4 or 8 programs per 32-row word, which split a
  wholly flagged word's copies and a partly flagged word's rows between them (`row_fill._run_kernel(parts=...)`; B
  runs `row_fill.PROGRAMS_PER_WORD`, 4 since 2026-12-03; it ran 1 before).
- `where` (C, XLA): `where(nan, NaN, where(zero, 0, x))` over the whole result, one elementwise fusion in place on
  the donated `x`: a pass over `x` (read and write) whatever the number of rows set, but no custom call.
- `mosaic_b_fill2k`, `mosaic_b_fill4k`, `mosaic_b_fill8k`: B with fill buffers (and so copies) of at most 2, 4 or 8
  KiB instead of `row_fill.FILL_BYTES` (16 KiB): less shared memory per program for more copies.

`--backward` times the three fills of a ragged backward as one step: `triton` and `scatter` (one per result),
`per_result` (the Mosaic GPU kernel once per result, as the library ran them until 2026-12-04), `many` (one kernel
call over the three, `row_fill.set_rows_kernel_many`) and `library` (`row_fill.set_rows_many`: the scatter where the
results of a dtype hold at most `SCATTER_MAX_BYTES` together, else one kernel call). `--thd` times
`attnlib.attention` on packed sequences (random lengths 64-1024 filling 90 % of the tokens, causal, the rest of the
rows outside every sequence) with the row fill of `library`, `per_result` and `triton`, traced in turn, round robin.

Both need rows of `C * itemsize` bytes, a multiple of 16 (TMA strides, bulk copy sizes and addresses), and
`T * C < 2**31` (int32 offsets); other shapes (e.g. `[1000, 7, 5]` f16: 70-byte rows) go to `set_rows_scatter`, marked
with `*` in the table.

Timing: each fill under `jax.jit` with `x` donated, as a chain of `--calls` fills in one `jit`, each on the previous
result (the aliasing is exercised, no fresh `x` is needed); an `optimization_barrier` before each fill keeps XLA from
merging or hoisting the flags' preparation of the calls. 2 warm-up chains, then the best of 10 repetitions of 5
chains ending in one `block_until_ready`, divided by the number of fills. The chain is unrolled (a `fori_loop` with
`unroll=True`, in effect): XLA's GPU while loop can add a cost per iteration of its own, which `--fori` shows. The
`loop` column is the harness alone (an identity fill). Each candidate is first checked against `set_rows_scatter`
bit for bit except NaN payloads: a wrong one is reported "wrong", not timed; one that fails to lower or run is
reported with the first lines of its exception.
"""

import argparse
import functools
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from kernel_profile import kernel_profile

from attnlib._src.backends.cudnn import row_fill


_KEEP, _ZERO, _NAN = 0, 1, 2  # as in row_fill
_BLOCK_ROWS = 128  # rows per program (A): a multiple of 64 (WGMMA layout) and 128 (one flag per thread)
_TILE_BYTES = 32 * 1024  # SMEM of a block (A)


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu  # imported on first use, as in row_fill

    return plgpu


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpret_params():
    """Pallas' GPU interpreter: `plgpu.InterpretGPUParams` in jax 0.11.2, private in 0.10.2."""
    plgpu = _plgpu()
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def reset_interpreter() -> None:
    """After an exception in a kernel, Pallas' GPU interpreter must be reset before it runs another."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    interpret_pallas_call.reset_gpu_interpret_mode_state()


def _layout_cast(x, layout, interpret):
    """`plgpu.layout_cast`, left out in the interpreter (jax 0.10.2's has no rule for it; layouts are not values)."""
    return x if interpret is not None else _plgpu().layout_cast(x, layout)


def _load(ref, layout, optimized=True, interpret=None):
    """`plgpu.load` into a layout (jax 0.11.2 deprecates the separate index that 0.10.2 requires). In the interpreter
    a plain `ref[...]`: jax 0.10.2's interpreter fails on `plgpu.load` (an assertion in its abstract evaluation)."""
    plgpu = _plgpu()
    if interpret is not None:
        return ref[...]
    try:
        return plgpu.load(ref, layout=layout, optimized=optimized)
    except TypeError:  # jax 0.10.2: `idx` positional and required
        return plgpu.load(ref, (), layout=layout, optimized=optimized)


def _rows_aligned(x: jax.Array) -> bool:
    """Whether the Mosaic GPU candidates take `x`: 16-byte rows, int32 offsets."""
    rows, columns = x.shape[0], math.prod(x.shape[1:])
    return rows > 0 and columns > 0 and columns * x.dtype.itemsize % 16 == 0 and rows * columns < 2**31


def _in_place(body, operands, x_flat: jax.Array, grid: dict[str, int], scratch: tuple, name: str, interpret):
    """Runs `body(*operand_refs, x_ref, *scratch_refs)` in each program of `grid` on a GMEM `Ref` of `x_flat`; returns
    its final value. The `Ref` makes `pl.kernel` alias `x_flat`'s buffer to the result (no copy if it was donated)."""
    from jax.experimental import pallas as pl

    plgpu = _plgpu()

    def kernel(*refs):  # scratch through `run_scoped`, as `plgpu.kernel` does (Barrier types included)
        pl.run_scoped(lambda *scratch_refs: body(*refs, *scratch_refs), *scratch)

    x_ref = jax.new_ref(x_flat, memory_space=plgpu.GMEM)
    mesh = plgpu.Mesh(grid=tuple(grid.values()), grid_names=tuple(grid), kernel_name=name)
    pl.kernel(kernel, out_type=(), mesh=mesh, compiler_params=plgpu.CompilerParams(),
              interpret=interpret or False)(*operands, x_ref)  # fmt: skip
    return jax.freeze(x_ref)


# --- A: read-modify-write of the row blocks that hold a flagged row --------------------------------------------------


def _column_tile(columns: int, itemsize: int) -> int | None:
    """A's tile width: divides `columns`, at most 256 (a TMA box side), a multiple of 8 (WGMMA layout) and of 16
    bytes, and a block of `_BLOCK_ROWS` rows of it fits `_TILE_BYTES`."""
    limit = min(256, _TILE_BYTES // (_BLOCK_ROWS * itemsize))
    for tile in range(limit - limit % 8, 0, -8):
        if columns % tile == 0 and tile * itemsize % 16 == 0:
            return tile
    return None


def _takes_a(x: jax.Array) -> bool:
    return _rows_aligned(x) and _column_tile(math.prod(x.shape[1:]), x.dtype.itemsize) is not None


def _body_a(flags_ref, x_ref, tile, flags_smem, barrier, *, rows: int, tile_columns: int, interpret):
    from jax.experimental import pallas as pl

    plgpu = _plgpu()
    block = jax.lax.axis_index("rows")
    first = block * _BLOCK_ROWS
    columns = pl.ds(jax.lax.axis_index("columns") * tile_columns, tile_columns)
    flags = flags_ref[pl.ds(first, _BLOCK_ROWS)]  # one per thread (the flags are padded to whole blocks)

    def read_modify_write(count: int):  # the block's first `count` rows (static)
        target = x_ref.at[pl.ds(first, count), columns]
        plgpu.copy_gmem_to_smem(target, tile.at[pl.ds(0, count)], barrier)
        flags_smem[...] = flags
        plgpu.barrier_wait(barrier)
        row_flags = _load(flags_smem, plgpu.Layout.WGMMA.reduce(1), interpret=interpret)
        block_flags = _layout_cast(jax.lax.broadcast_in_dim(row_flags, tile.shape, (0,)), plgpu.Layout.WGMMA, interpret)
        values = _load(tile, plgpu.Layout.WGMMA, optimized=False, interpret=interpret)
        values = jnp.where(block_flags == _NAN, jnp.asarray(jnp.nan, tile.dtype),
                           jnp.where(block_flags == _ZERO, jnp.asarray(0, tile.dtype), values))  # fmt: skip
        tile[...] = values  # rows from `count` on are not copied back
        plgpu.commit_smem()  # the SMEM stores, visible to the TMA engine
        plgpu.copy_smem_to_gmem(tile.at[pl.ds(0, count)], target)
        plgpu.wait_smem_to_gmem(0)

    full, tail = divmod(rows, _BLOCK_ROWS)

    @pl.when(jnp.max(flags) > _KEEP)
    def _fill():
        # The last block's copies stop at row T rather than lean on TMA's out-of-bounds handling (zero-filled loads,
        # dropped stores), which Pallas' interpreter does not model.
        if tail:
            pl.when(block < full)(lambda: read_modify_write(_BLOCK_ROWS))
            pl.when(block == full)(lambda: read_modify_write(tail))
        else:
            read_modify_write(_BLOCK_ROWS)


def set_rows_mosaic(x: jax.Array, zero: jax.Array, nan: jax.Array, *, interpret=None) -> jax.Array:
    """Design A: `x` `[T, ...]` with rows `zero` set to 0 and rows `nan` to NaN (`nan` wins), by a read-modify-write
    of each block of 128 rows that holds one (Mosaic GPU, TMA); XLA's scatter where rows are not 16-byte aligned.
    `interpret`: Pallas' GPU interpreter params (`interpret_params()`), to run anywhere."""
    plgpu = _plgpu()
    if not _takes_a(x):
        return row_fill.set_rows_scatter(x, zero, nan)
    rows, columns = x.shape[0], math.prod(x.shape[1:])
    tile_columns = _column_tile(columns, x.dtype.itemsize)
    blocks = cdiv(rows, _BLOCK_ROWS)
    flags = jnp.where(nan, _NAN, jnp.where(zero, _ZERO, _KEEP)).astype(jnp.int32)
    flags = jnp.pad(flags, (0, blocks * _BLOCK_ROWS - rows))
    scratch = (plgpu.SMEM((_BLOCK_ROWS, tile_columns), x.dtype), plgpu.SMEM((_BLOCK_ROWS,), jnp.int32),
               plgpu.Barrier())  # fmt: skip
    body = functools.partial(_body_a, rows=rows, tile_columns=tile_columns, interpret=interpret)
    grid = {"rows": blocks, "columns": columns // tile_columns}
    out = _in_place(body, (flags,), jnp.reshape(x, (rows, columns)), grid, scratch, "attnlib_set_rows_a", interpret)
    return jnp.reshape(out, x.shape)


# --- the Triton kernel these candidates replace (row_fill.py before the move), the "before" column ------------------


def _triton_fill_kernel(flag_ref, x_ref, out_ref, *, rows: int, columns: int, block: tuple[int, int]):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    del x_ref  # aliased to out_ref: rows not stored into keep their values
    block_rows, block_columns = block
    first = pl.program_id(0) * block_rows
    row = first + jnp.arange(block_rows, dtype=jnp.int32)
    flags = pallas_triton.load(flag_ref.at[pl.ds(first, block_rows)], mask=row < rows, other=_KEEP)
    fill = (flags != _KEEP) & (row < rows)
    value = jnp.broadcast_to(jnp.where(flags == _NAN, jnp.nan, 0.0).astype(out_ref.dtype)[:, None], block)

    @pl.when(jnp.max(fill.astype(jnp.int32)) > 0)
    def _store():
        def store_columns(j, carry):
            column = j * block_columns + jnp.arange(block_columns, dtype=jnp.int32)
            target = out_ref.at[pl.ds(first, block_rows), pl.ds(j * block_columns, block_columns)]
            pallas_triton.store(target, value, mask=fill[:, None] & (column < columns)[None, :])
            return carry

        jax.lax.fori_loop(0, pl.cdiv(columns, block_columns), store_columns, 0)


def set_rows_triton(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """The Pallas (Triton) kernel `row_fill.py` ran before: a program per 32 rows stores only into flagged rows."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pallas_triton

    rows, columns = x.shape[0], math.prod(x.shape[1:])
    flat = jnp.reshape(x, (rows, columns))
    block = (32, min(1024, pl.next_power_of_2(columns)))
    flags = jnp.where(nan, _NAN, jnp.where(zero, _ZERO, _KEEP)).astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_triton_fill_kernel, rows=rows, columns=columns, block=block),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(pl.cdiv(rows, block[0]),),
        input_output_aliases={1: 0},
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=1),
        name="attnlib_set_rows_triton",
    )(flags, flat)
    return jnp.reshape(out, x.shape)


# --- checks and timing ----------------------------------------------------------------------------------------------


def _library_kernel(x, zero, nan, *, interpret: bool):
    """B: `row_fill.set_rows` as the library runs it on a GPU (the kernel, or the scatter for rows it cannot copy)."""
    if not row_fill.kernel_takes(x):
        return row_fill.set_rows_scatter(x, zero, nan)
    return row_fill.set_rows_kernel(x, zero, nan, interpret=interpret)


def _library_kernel_parts(x, zero, nan, *, interpret: bool, **options):
    """B with other `row_fill._run_kernel` options: `parts` programs per 32-row word (more programs share a word's
    copies), fill buffers of at most `fill_bytes` (less shared memory per program, more copies)."""
    if not row_fill.kernel_takes(x):
        return row_fill.set_rows_scatter(x, zero, nan)
    return row_fill._run_kernel([x], [(zero, nan)], [0], interpret=interpret, **options)[0]


def mosaic_candidates(interpret=None) -> dict:
    """name -> (fill, takes(x)); `takes` is False where the candidate hands `x` to XLA's scatter."""
    return {
        "mosaic_a": (functools.partial(set_rows_mosaic, interpret=interpret), _takes_a),
        "mosaic_b": (functools.partial(_library_kernel, interpret=interpret is not None), row_fill.kernel_takes),
        **{f"mosaic_b{parts}": (functools.partial(_library_kernel_parts, parts=parts, interpret=interpret is not None),
                                row_fill.kernel_takes) for parts in (1, 2, 4, 8)},
        **{f"mosaic_b_fill{kb}k": (functools.partial(_library_kernel_parts, fill_bytes=kb * 1024,
                                                     interpret=interpret is not None),
                                   row_fill.kernel_takes) for kb in (2, 4, 8)},
    }  # fmt: skip


def set_rows_where(x: jax.Array, zero: jax.Array, nan: jax.Array) -> jax.Array:
    """C: XLA's elementwise select over the whole of `x` (one fusion, in place where `x` is donated)."""
    rows = (x.shape[0],) + (1,) * (x.ndim - 1)
    zero, nan = jnp.reshape(zero, rows), jnp.reshape(nan, rows)
    return jnp.where(nan, jnp.asarray(jnp.nan, x.dtype), jnp.where(zero, jnp.asarray(0, x.dtype), x))


def candidates() -> dict:
    everything = lambda x: True  # noqa: E731
    peers = {"triton": (set_rows_triton, everything), "scatter": (row_fill.set_rows_scatter, everything),
             "where": (set_rows_where, everything)}  # fmt: skip
    return {**peers, **mosaic_candidates()}


def pattern(rows: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Padding-like flags: a run at the end of each quarter of the rows, `fraction` of the rows in all, the runs
    alternately zero and NaN; the first 3 rows of the first run are both (NaN wins)."""
    zero, nan = np.zeros(rows, bool), np.zeros(rows, bool)
    bounds = np.linspace(0, rows, 5).astype(int)
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        start = hi - int(round(fraction * (hi - lo)))
        (zero if s % 2 == 0 else nan)[start:hi] = True
        if s == 0:
            nan[start : min(start + 3, hi)] = True
    return zero, nan


def inputs(shape, dtype, fraction, seed: int = 0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)
    zero, nan = pattern(shape[0], fraction)
    return x, jnp.asarray(zero), jnp.asarray(nan)


def same(a, b) -> bool:
    """Equal bit for bit except NaN payloads (NaN in the same places); pytrees leaf by leaf."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = np.isnan(a.astype(np.float32)), np.isnan(b.astype(np.float32))
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return bool((nan_a == nan_b).all() and (a.view(bits)[~nan_a] == b.view(bits)[~nan_a]).all())


def error_lines(error: BaseException, lines: int = 3) -> str:
    """The exception's first lines, without JAX's note on filtered frames."""
    text = "".join(traceback.format_exception_only(type(error), error)).splitlines()
    text = [line.strip() for line in text if line.strip() and not line.startswith(("---", "For simplicity"))]
    return " | ".join(text[:lines])


def chain(fill, calls: int, fori: bool, donate: bool = True):
    """`calls` fills, each on the previous result, in one `jit` with `x` donated (unless `donate` is False)."""

    def step(x, zero, nan):
        x, zero, nan = jax.lax.optimization_barrier((x, zero, nan))
        return fill(x, zero, nan)

    def run(x, zero, nan):
        if fori:
            return jax.lax.fori_loop(0, calls, lambda i, x: step(x, zero, nan), x)
        for _ in range(calls):
            x = step(x, zero, nan)
        return x

    return jax.jit(run, donate_argnums=0 if donate else ())


def profile_rows(fill, x, zero, nan, calls: int, fori: bool) -> list[str]:
    """Where a fill's device time goes: the kernels of a chain of `calls` fills per fill (the chain is not donated
    here, so one copy of `x` per chain is among them) and the chain's span, first kernel start to last kernel end."""
    profile = kernel_profile(chain(fill, calls, fori, donate=False), (x, zero, nan), calls=3)
    rows = [f"      span {profile['span_us'] / calls:.2f} us per fill, kernels {profile['kernel_us'] / calls:.2f} us"]
    return rows + [f"      {k['us'] / calls:8.2f} us  x{k['launches'] / calls:<5.3g} {k['name'][:90]}"
                   for k in profile["kernels"][:6]]  # fmt: skip


def time_per_fill(fill, x, zero, nan, calls: int, fori: bool, chains: int = 5, reps: int = 10) -> float:
    run = chain(fill, calls, fori)
    x = jax.tree.map(jnp.copy, x)  # donated from here on: each chain takes the previous one's result
    for _ in range(2):
        x = run(x, zero, nan)
    jax.block_until_ready(x)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(chains):
            x = run(x, zero, nan)
        jax.block_until_ready(x)
        best = min(best, (time.perf_counter() - start) / (chains * calls))
    return best


CASES = [  # label, shape, dtype, fraction of the rows flagged
    ("[32768,32,128] bf16 1%", (32768, 32, 128), jnp.bfloat16, 0.01),
    ("[32768,32,128] bf16 25%", (32768, 32, 128), jnp.bfloat16, 0.25),
    ("[32768,32,128] bf16 100%", (32768, 32, 128), jnp.bfloat16, 1.0),
    ("[32768,32] f32 25%", (32768, 32), jnp.float32, 0.25),
    ("[1000,7,5] f16 25%", (1000, 7, 5), jnp.float16, 0.25),
    ("[4097,16,64] bf16 25%", (4097, 16, 64), jnp.bfloat16, 0.25),
    # With the 4 MB and 8 MB cases above: sizes around `row_fill.SCATTER_MAX_BYTES`, where the scatter stops being
    # as fast as the kernel (1 MB, 16 MB, 32 MB).
    ("[8192,32] f32 25%", (8192, 32), jnp.float32, 0.25),
    ("[8192,16,64] bf16 25%", (8192, 16, 64), jnp.bfloat16, 0.25),
    ("[8192,32,64] bf16 25%", (8192, 32, 64), jnp.bfloat16, 0.25),
    # Outputs of 1 to 4 MB with wide rows (fewer rows, more elements per byte than the f32 statistics above).
    ("[512,16,64] bf16 25%", (512, 16, 64), jnp.bfloat16, 0.25),
    ("[1024,16,64] bf16 25%", (1024, 16, 64), jnp.bfloat16, 0.25),
    ("[2048,16,64] bf16 25%", (2048, 16, 64), jnp.bfloat16, 0.25),
    ("[256,16,64] bf16 25%", (256, 16, 64), jnp.bfloat16, 0.25),
    ("[512,8,64] bf16 25%", (512, 8, 64), jnp.bfloat16, 0.25),
    ("[2048,8,64] bf16 25%", (2048, 8, 64), jnp.bfloat16, 0.25),
    ("[128,32,128] bf16 25%", (128, 32, 128), jnp.bfloat16, 0.25),
]

INTERPRET_CASES = [  # the same kinds (a partial last block, narrow rows, odd rows), small enough to interpret
    ("[300,4,32] f32 25%", (300, 4, 32), jnp.float32, 0.25),
    ("[300,4,32] f32 100%", (300, 4, 32), jnp.float32, 1.0),
    ("[200,32] f32 25%", (200, 32), jnp.float32, 0.25),
    ("[161,8,32] bf16 10%", (161, 8, 32), jnp.bfloat16, 0.1),
    ("[70,7,5] f16 25%", (70, 7, 5), jnp.float16, 0.25),
]

WIDTH = 26


def row(label: str, cells) -> str:
    return f"{label:<{WIDTH}}" + "".join(f"{cell:>12}" for cell in cells)


def lower_all() -> None:
    """Lowers each Mosaic GPU candidate for CUDA on each benchmark shape, on any machine."""
    fills = mosaic_candidates()
    print(row("case", fills) + "   [lowered for cuda]")
    problems = []
    for label, shape, dtype, _ in CASES:
        x, flag = jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape[:1], jnp.bool_)
        cells = []
        for name, (fill, takes) in fills.items():
            try:
                jax.jit(fill, donate_argnums=0).trace(x, flag, flag).lower(lowering_platforms=("cuda",))
                cells.append("ok" + ("" if takes(x) else "*"))
            except Exception as error:  # reported, never fatal
                cells.append("error")
                problems.append(f"{label} / {name}: {error_lines(error)}")
        print(row(label, cells), flush=True)
    print("* the candidate hands this shape to XLA's scatter (rows not 16-byte aligned)")
    for problem in problems:
        print("error:", problem)


def chosen(args, candidates: dict, cases: list) -> tuple[dict, list]:
    """The candidates named by `--candidates` and the cases picked by `--only` (all where not given)."""
    if args.candidates:
        candidates = {name: value for name, value in candidates.items() if name in args.candidates}
    if args.only:
        cases = [case for case in cases if any(part in case[0].replace(" ", "_") for part in args.only)]
    return candidates, cases


# --- a ragged backward's three fills as one step (--backward) --------------------------------------------------------


def _per_result(fill):
    """The three fills of a backward, `fill(x, zero, nan)` on each: `xs` (dQ, dK, dV), flags (query, key)."""

    def run(xs, zeros, nans):
        (dq, dk, dv), (q_zero, kv_zero), (q_nan, kv_nan) = xs, zeros, nans
        return fill(dq, q_zero, q_nan), fill(dk, kv_zero, kv_nan), fill(dv, kv_zero, kv_nan)

    return run


def _together(fill_many):
    """The three fills of a backward handed to `fill_many([(x, zero, nan), ...])` at once."""

    def run(xs, zeros, nans):
        (dq, dk, dv), (q_zero, kv_zero), (q_nan, kv_nan) = xs, zeros, nans
        return tuple(fill_many([(dq, q_zero, q_nan), (dk, kv_zero, kv_nan), (dv, kv_zero, kv_nan)]))

    return run


def backward_candidates() -> dict:
    return {
        "triton": _per_result(set_rows_triton),
        "scatter": _per_result(row_fill.set_rows_scatter),
        "per_result": _per_result(row_fill.set_rows),
        "many": _together(row_fill.set_rows_kernel_many),
        "library": _together(row_fill.set_rows_many),
    }


BACKWARD_CASES = [  # label, dQ shape, dK = dV shape, dtype, fraction of the rows flagged
    ("MHA [256,16,64] 0.5MB each", (256, 16, 64), (256, 16, 64), jnp.bfloat16, 0.25),
    ("MHA [512,8,64] 0.5MB each", (512, 8, 64), (512, 8, 64), jnp.bfloat16, 0.25),
    ("MHA [1024,16,64] 2MB each", (1024, 16, 64), (1024, 16, 64), jnp.bfloat16, 0.25),
    ("MHA [2048,16,64] 4MB each", (2048, 16, 64), (2048, 16, 64), jnp.bfloat16, 0.25),
    ("GQA [4097,16,64] dK 2MB", (4097, 16, 64), (4097, 4, 64), jnp.bfloat16, 0.25),
    ("MHA [4097,16,64] 8MB each", (4097, 16, 64), (4097, 16, 64), jnp.bfloat16, 0.25),
    ("MHA [8192,16,64] 16MB each", (8192, 16, 64), (8192, 16, 64), jnp.bfloat16, 0.25),
    ("GQA [32768,32,128] 1%", (32768, 32, 128), (32768, 8, 128), jnp.bfloat16, 0.01),
    ("GQA [32768,32,128] 25%", (32768, 32, 128), (32768, 8, 128), jnp.bfloat16, 0.25),
]


def backward_inputs(q_shape, kv_shape, dtype, fraction):
    (dq, q_zero, q_nan), (dk, kv_zero, kv_nan) = inputs(q_shape, dtype, fraction), inputs(kv_shape, dtype, fraction, 1)
    dv = -dk
    return (dq, dk, dv), (q_zero, kv_zero), (q_nan, kv_nan)


def backward(args) -> None:
    fills, cases = chosen(args, backward_candidates(), BACKWARD_CASES)
    print(row("case", [*fills, "loop"]) + f"   [us per backward's 3 fills, chain of {args.calls}]", flush=True)
    fastest = []
    for label, q_shape, kv_shape, dtype, fraction in cases:
        xs, zeros, nans = backward_inputs(q_shape, kv_shape, dtype, fraction)
        expected = jax.jit(_per_result(row_fill.set_rows_scatter))(xs, zeros, nans)
        cells, times = [], {}
        for name, fill in fills.items():
            try:
                if not same(jax.jit(fill)(xs, zeros, nans), expected):
                    cells.append("wrong")
                    continue
                times[name] = time_per_fill(fill, xs, zeros, nans, args.calls, args.fori) * 1e6
                cells.append(f"{times[name]:.1f}")
            except Exception as error:  # reported, never fatal
                cells.append("error")
                print(f"error: {label} / {name}: {error_lines(error)}", flush=True)
        cells.append(f"{time_per_fill(lambda x, z, n: x, xs, zeros, nans, args.calls, args.fori) * 1e6:.1f}")
        print(row(label, cells), flush=True)
        if args.profile:
            for name in times:
                print(f"    {name}:", flush=True)
                print("\n".join(profile_rows(fills[name], xs, zeros, nans, args.calls, args.fori)), flush=True)
        if times:
            best = min(times, key=times.get)
            fastest.append(f"{label}: {best} {times[best]:.1f} us")
    print("fastest per case: " + "; ".join(fastest))


# --- attnlib's THD attention with each row fill (--thd) ------------------------------------------------------------


THD_CASES = [  # label, tokens, query heads, key heads, head dim
    ("T2048 N16 K16 d64 (O 4MB)", 2048, 16, 16, 64),
    ("T4096 N16 K16 d64 (O 8MB)", 4096, 16, 16, 64),
    ("T4096 N16 K4 d64 (O 8MB)", 4096, 16, 4, 64),
    ("T8192 N16 K16 d64 (O 16MB)", 8192, 16, 16, 64),
    ("T32768 N32 K8 d128 (O 256MB)", 32768, 32, 8, 128),
]


def thd_fill_switches() -> dict:
    """Row fills to trace attnlib's THD path with (`bench_cudnn_ragged.traced_with`)."""
    one = lambda x, *flags: (row_fill.set_rows_kernel if row_fill.runs_kernel(x) else row_fill.set_rows_scatter)(  # noqa: E731
        x, *flags)  # fmt: skip
    per_result = lambda fills: [one(*fill) for fill in fills]  # noqa: E731
    triton = lambda fills: [set_rows_triton(*fill) for fill in fills]  # noqa: E731
    return {
        "library": {},
        "per_result": {"row_fill": {"set_rows_many": per_result}},
        "triton": {"row_fill": {"set_rows": set_rows_triton, "set_rows_many": triton}},
    }


def _close(a, b) -> bool:
    """Gradients: cuDNN's backward accumulates dQ with atomics, so two runs of one function differ in the last bits;
    NaN in the same places, the rest within a bf16 step of the largest value (a wrong row fill leaves whole rows of
    garbage or of the wrong kind)."""
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    scale = float(np.max(np.abs(b[~nan_b]), initial=1.0))
    return bool((nan_a == nan_b).all() and np.allclose(a[~nan_a], b[~nan_b], rtol=2**-7, atol=2**-7 * scale))


def thd(args) -> None:
    from bench_cudnn import best_per_call
    from bench_cudnn_ragged import traced_with

    import attnlib

    switches, cases = chosen(args, thd_fill_switches(), THD_CASES)
    print(row("case", [f"{name} {part}" for name in switches for part in ("fwd", "f+b")]) + "   [us per call]")
    rng = np.random.default_rng(0)
    for label, tokens, n, k, h in cases:
        lengths, total, real = [], 0, int(0.9 * tokens)
        while total < real:
            lengths.append(int(min(rng.integers(64, 1025), real - total)))
            total += lengths[-1]
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        keys = jax.random.split(jax.random.key(tokens), 3)
        q = jax.random.normal(keys[0], (tokens, n, h), jnp.float32).astype(jnp.bfloat16)
        kv = [jax.random.normal(key, (tokens, k, h), jnp.float32).astype(jnp.bfloat16) for key in keys[1:]]
        call = lambda q, k, v, cu: attnlib.attention(q, k, v, cu_seqlens_q=cu, is_causal=True,  # noqa: E731
                                                     max_seqlen_q=1024, implementation="cudnn")  # fmt: skip
        grad = jax.grad(lambda *a: jnp.sum(call(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        fns = {(name, part): jax.jit(traced_with(fn, values))
               for name, values in switches.items() for part, fn in (("fwd", call), ("f+b", grad))}  # fmt: skip
        reference = {part: jax.device_get(fns[("library", part)](q, *kv, cu)) for part in ("fwd", "f+b")}
        best = {}
        for _ in range(3):  # round robin: each variant's best round
            for key, fn in fns.items():
                if not (same if key[1] == "fwd" else _close)(jax.device_get(fn(q, *kv, cu)), reference[key[1]]):
                    best[key] = float("nan")
                    continue
                seconds = best_per_call(fn, (q, *kv, cu), loop=50 if key[1] == "fwd" else 20, reps=10)
                best[key] = min(best.get(key, float("inf")), seconds)
        print(row(label, [f"{best[key] * 1e6:.1f}" if best[key] == best[key] else "wrong" for key in fns]), flush=True)
        if args.profile:  # the forward's device time per call: kernels, and the span first kernel to last
            for name in switches:
                profile = kernel_profile(fns[(name, "fwd")], (q, *kv, cu), calls=5)
                print(f"    {name} fwd: span {profile['span_us']:.1f} us, kernels {profile['kernel_us']:.1f} us",
                      flush=True)  # fmt: skip
                for kernel in profile["kernels"][:8]:
                    print(f"      {kernel['us']:8.2f} us  x{kernel['launches']:<5.3g} {kernel['name'][:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="check in Pallas' GPU interpreter, no timing")
    parser.add_argument("--lower", action="store_true", help="only lower the Mosaic GPU candidates for CUDA")
    parser.add_argument("--fori", action="store_true", help="time with lax.fori_loop instead of an unrolled chain")
    parser.add_argument("--calls", type=int, default=20, help="fills per timed chain")
    parser.add_argument("--only", nargs="*", help="the cases whose label, spaces as _, contains one of these")
    parser.add_argument("--candidates", nargs="*", help="these candidates only")
    parser.add_argument("--profile", action="store_true", help="after timing, each fill's kernels (JAX's profiler)")
    parser.add_argument("--backward", action="store_true", help="a ragged backward's three fills, per call")
    parser.add_argument("--thd", action="store_true", help="attnlib's THD attention with each row fill")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}", flush=True)
    if args.lower:
        return lower_all()
    if (args.backward or args.thd) and jax.default_backend() != "gpu":
        print("no GPU: --backward and --thd time on the H200")
        return
    if args.backward:
        return backward(args)
    if args.thd:
        return thd(args)
    timing = not args.interpret
    if timing and jax.default_backend() != "gpu":
        print("no GPU: timing needs the H200 (--interpret or --lower check the kernels here)")
        return
    interpret = None if timing else interpret_params()
    fills, cases = chosen(args, candidates() if timing else mosaic_candidates(interpret),
                          CASES if timing else INTERPRET_CASES)  # fmt: skip
    mode = f"us per fill, {'fori_loop' if args.fori else 'chain'} of {args.calls}" if timing else "interpreter"
    print(row("case", [*fills, *(["loop"] if timing else [])]) + f"   [{mode}]", flush=True)
    fastest, problems, wrong = [], [], []
    for label, shape, dtype, fraction in cases:
        x, zero, nan = inputs(shape, dtype, fraction)
        expected = jax.jit(row_fill.set_rows_scatter)(x, zero, nan)
        cells, times = [], {}
        for name, (fill, takes) in fills.items():
            try:
                if not same(jax.jit(fill)(x, zero, nan), expected):
                    cells.append("wrong")
                    wrong.append(f"{label} / {name}")
                elif timing:
                    times[name] = time_per_fill(fill, x, zero, nan, args.calls, args.fori) * 1e6
                    cells.append(f"{times[name]:.1f}")
                else:
                    cells.append("ok")
            except Exception as error:  # a candidate that fails to lower or run: reported, never fatal
                cells.append("error")
                problems.append(f"{label} / {name}: {error_lines(error)}")
                if interpret is not None:
                    reset_interpreter()
            cells[-1] += "" if takes(x) else "*"
        if timing:
            cells.append(f"{time_per_fill(lambda x, z, n: x, x, zero, nan, args.calls, args.fori) * 1e6:.1f}")
        print(row(label, cells), flush=True)
        if args.profile:
            for name in times:
                print(f"    {name}:", flush=True)
                print("\n".join(profile_rows(fills[name][0], x, zero, nan, args.calls, args.fori)), flush=True)
        if times:
            best = min(times, key=times.get)
            fastest.append(f"{label}: {best} {times[best]:.1f} us")
    print("* the candidate hands this shape to XLA's scatter (rows not 16-byte aligned)")
    for problem in problems:
        print("error:", problem)
    if timing:
        print("fastest per case: " + "; ".join(fastest))
    else:
        print("interpreter: " + ("all right" if not problems and not wrong else f"{len(problems + wrong)} failures"))


if __name__ == "__main__":
    main()
