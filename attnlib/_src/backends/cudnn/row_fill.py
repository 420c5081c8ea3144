"""Set chosen rows of a packed result to 0 or NaN in place, at a cost that scales with the rows set.

cuDNN's ragged graphs leave the rows outside every sequence unwritten (`varlen.py`). XLA's scatter, given one index
per row, runs a thread per element of the whole array whether or not the row is set: 160 us on a `[32768, 32, 128]`
bf16 output on the H200, as much as rewriting it (`docs/performance.md`). On a GPU this is a Pallas (Triton) kernel
instead: each program reads the flags of a block of rows and stores only into flagged rows; the array is aliased to
the result, so unflagged rows are never read or written. `set_rows_scatter` is the XLA scatter it replaced (same
values; the NaN payload may differ): what runs when JAX's default backend is not a GPU (the CPU, where cuDNN is emulated
in tests), the benchmarks' "before", and the fallback should JAX drop Pallas' Triton backend. The kernel's
own tests run it in Pallas' interpreter on the CPU.

jax 0.11.2 deprecates that backend in favour of Mosaic GPU: it emits a `DeprecationWarning` at every lowering of the
kernel (hidden by Python's default filters; the test suite's configuration ignores that one message). attnlib does
not filter warnings itself: a filter set at trace time does not outlive a test's warning context, and a cached trace
lowers again without it. Porting the kernel to Mosaic GPU is the way forward once JAX removes the Triton backend.
"""

import functools
import logging
import math

import jax
import jax.numpy as jnp

from ... import logs


ROWS_PER_PROGRAM = 32
COLUMNS_PER_PROGRAM = 1024

_KEEP, _ZERO, _NAN = 0, 1, 2


def _fill_kernel(flag_ref, x_ref, out_ref, *, rows: int, columns: int, block: tuple[int, int]):
    """One program per block of rows: reads their flags and, only if one is set, stores into the flagged rows."""
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


def set_rows_kernel(x: jax.Array, zero: jax.Array, nan: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The Pallas kernel alone (`interpret=True` runs it on any platform, for tests)."""
    from jax.experimental import pallas as pl  # imported on first use: `import attnlib` stays light
    from jax.experimental.pallas import triton as pallas_triton

    rows, columns = x.shape[0], math.prod(x.shape[1:])
    if rows == 0 or columns == 0:
        return x
    flat = jnp.reshape(x, (rows, columns))
    block = (ROWS_PER_PROGRAM, min(COLUMNS_PER_PROGRAM, pl.next_power_of_2(columns)))
    flags = jnp.where(nan, _NAN, jnp.where(zero, _ZERO, _KEEP)).astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_fill_kernel, rows=rows, columns=columns, block=block),
        out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
        grid=(pl.cdiv(rows, block[0]),),
        input_output_aliases={1: 0},
        interpret=interpret,
        compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=1),  # Triton, not Mosaic GPU
        name="attnlib_set_rows",
    )(flags, flat)
    return jnp.reshape(out, x.shape)


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
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError as error:  # a JAX without Pallas' Triton backend
        logs.log_once(("row_fill", "scatter"), logging.WARNING,
                      "attnlib: Pallas' Triton backend is unavailable (%s); the rows outside THD/packed sequences are "
                      "set by XLA's scatter, which costs a pass over each result.", error)  # fmt: skip
        return set_rows_scatter(x, zero, nan)
    # `jax.lax.platform_dependent` would choose at lowering, but leaves a `case` in the lowered module.
    if jax.default_backend() != "gpu":  # the CPU emulation of cuDNN in tests
        return set_rows_scatter(x, zero, nan)
    return set_rows_kernel(x, zero, nan)
