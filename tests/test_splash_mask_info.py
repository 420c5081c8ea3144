"""Splash's block tables built from the mask's structure (`pallas_tpu/mask_info.py`) against splash's own.

`make_splash_mha` evaluates the mask block by block in Python (quadratic in the length: about 53 s of the first call
at 128k tokens, issue #77); `mask_info` derives the same `MaskInfo`s from the band a causal / local / full mask is.
Here, on the padded shapes attnlib runs (`blocks.padded_lengths`, odd lengths, `T != S`), every table of the
forward, dQ and dK/dV infos equals splash's array for array (values, dtype, shape), the effective mask the tables
describe is the dense mask, the kernels built from either give bitwise the same outputs and gradients (Pallas
interpret mode), and building the tables at 128k and 512k tokens takes well under a second of host time.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

from attnlib._src.backends.pallas_tpu import blocks, mask_info, masks


LENGTHS = {"t300_s700": (300, 700), "t700_s300": (700, 300), "t1000_s1000": (1000, 1000)}

BLOCKS = {
    # attnlib's table (forward and backward blocks alike)
    "table": None,
    # every kernel on blocks of its own, bq != bkv
    "mixed": BlockSizes(
        block_q=256, block_kv=128, block_q_dkv=128, block_kv_dkv=256, block_kv_dkv_compute=256,
        block_q_dq=512, block_kv_dq=128,
    ),  # fmt: skip
    # a fused backward: no dQ info, a dK/dV grid that is not shrunk
    "fused": BlockSizes(
        block_q=128, block_kv=256, block_q_dkv=256, block_kv_dkv=128, block_kv_dkv_compute=128,
        use_fused_bwd_kernel=True,
    ),  # fmt: skip
    # forward blocks only (attnlib fills in the backward ones; `mask_info` follows splash without them too)
    "forward_only": BlockSizes(block_q=128, block_kv=384),
}

# (kind, window): `None` offsets are replaced by 0 (top-left) and S - T (bottom-right).
MASKS = {
    "full": ("full", None),
    "causal": ("causal", None),
    "window_left": ("local", (64, None)),
    "window_both": ("local", (100, 37)),
    "window_right": ("local", (None, 50)),
    "window_causal": ("local", (200, 0)),
    "window_off_diagonal": ("local", (300, -5)),
    "window_wide": ("local", (5000, 5000)),
}


def _setup(lengths: str, block_name: str) -> tuple[int, int, int, int, BlockSizes]:
    """`(T, S, T', S', block sizes)` as attnlib's layout picks them (`splash.layout`)."""
    T, S = LENGTHS[lengths]
    user = BLOCKS[block_name]
    Tp, Sp = blocks.padded_lengths(T, S, user)
    if user is None:
        chosen = blocks.default_block_sizes(Tp, Sp)
    elif block_name == "forward_only":
        chosen = user
    else:
        chosen = blocks.with_backward_blocks(user)
    return T, S, Tp, Sp, chosen


def _spec(mask: str, alignment: str, T: int, S: int, Tp: int, Sp: int) -> masks.MaskSpec:
    kind, window = MASKS[mask]
    offset = S - T if alignment == "bottom_right" else 0
    return masks.MaskSpec(kind, Tp, Sp, 0 if kind == "full" else offset, window)


def _infos(kernel) -> dict:
    return {"fwd": kernel.fwd_mask_info, "dq": kernel.dq_mask_info, "dkv": kernel.dkv_mask_info}


def _splash_kernel(spec, block_sizes, **kw):
    return splash.make_splash_mha(mask_info.splash_mask(spec), block_sizes=block_sizes, head_shards=1, q_seq_shards=1, **kw)


def _structured_kernel(spec, block_sizes, **kw):
    kw = dict(save_residuals=False, attn_logits_soft_cap=None, interpret=False) | kw
    return mask_info.splash_kernel(spec, block_sizes, **kw)


def _dense(spec: masks.MaskSpec) -> np.ndarray:
    """bool `[T', S']`: the mask, element by element."""
    q, k = np.arange(spec.q_len)[:, None], np.arange(spec.kv_len)[None, :]
    lo, hi = mask_info.band(spec)  # (the offset included)
    return np.broadcast_to((lo is None or k - q >= lo) & (hi is None or k - q <= hi), (spec.q_len, spec.kv_len))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("block_name", list(BLOCKS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_tables_equal_splash(lengths, block_name, mask, alignment):
    """Every field of the forward, dQ and dK/dV `MaskInfo`s and every other kernel argument equals splash's own."""
    T, S, Tp, Sp, block_sizes = _setup(lengths, block_name)
    spec = _spec(mask, alignment, T, S, Tp, Sp)
    expected, actual = _splash_kernel(spec, block_sizes), _structured_kernel(spec, block_sizes)
    for name, want in _infos(expected).items():
        got = _infos(actual)[name]
        if want is None:
            assert got is None, name
            continue
        for field in want._fields:
            a, b = getattr(got, field), getattr(want, field)
            if b is None or isinstance(b, bool):
                assert a is b, (name, field, a, b)
                continue
            assert isinstance(a, jax.Array), (name, field, type(a))  # on the device, as splash leaves them
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (name, field, a.dtype, a.shape, b.dtype, b.shape)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}.{field}")
    kwargs = lambda kernel: {k: v for k, v in kernel.kwargs.items() if k != "mask_function"}
    assert kwargs(actual) == kwargs(expected)
    f, g = actual.kwargs["mask_function"], expected.kwargs["mask_function"]
    assert (f is None) == (g is None)
    if f is not None:
        q, k = np.arange(Tp)[:, None], np.arange(Sp)[None, :]
        np.testing.assert_array_equal(f(q, k), g(q, k))


def _effective(info, mask_function, spec: masks.MaskSpec, block_shape, *, is_dkv: bool) -> np.ndarray:
    """bool `[T', S']`: the mask the kernel applies when it walks `info`'s (shrunk) grid, block by block."""
    bq, bkv = block_shape
    table, data = np.asarray(info.block_mask)[0], np.asarray(info.data_next)[0].astype(np.int64)
    assert info.mask_next is None and info.partial_mask_blocks is None  # partly visible: `mask_function`
    dense = np.zeros((spec.q_len, spec.kv_len), bool)
    seen = np.zeros((spec.q_len // bq, spec.kv_len // bkv), int)
    for a, b in np.ndindex(table.shape):
        if table[a, b] == 0:
            continue
        i, j = (data[a, b], b) if is_dkv else (a, data[a, b])
        seen[i, j] += 1
        rows, cols = slice(i * bq, (i + 1) * bq), slice(j * bkv, (j + 1) * bkv)
        if table[a, b] == 2:
            dense[rows, cols] = True
        else:
            dense[rows, cols] = mask_function(np.arange(spec.q_len)[rows, None], np.arange(spec.kv_len)[None, cols])
    assert seen.max(initial=0) <= 1  # no block twice
    return dense


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("mask", ["causal", "window_both", "window_right", "window_off_diagonal", "full"])
@pytest.mark.parametrize("block_name", ["table", "mixed"])
def test_tables_describe_the_dense_mask(block_name, mask, alignment):
    """The mask the forward, dQ and dK/dV grids apply, block by block (hidden, visible, or `mask_function`), is the
    dense mask."""
    T, S, Tp, Sp, block_sizes = _setup("t700_s300", block_name)
    spec = _spec(mask, alignment, T, S, Tp, Sp)
    infos = mask_info.mask_infos(spec, block_sizes)
    shapes = {
        "fwd": (block_sizes.block_q, block_sizes.block_kv),
        "dq": (block_sizes.block_q_dq, block_sizes.block_kv_dq),
        "dkv": (block_sizes.block_q_dkv, block_sizes.block_kv_dkv),
    }
    for name, shape in shapes.items():
        info = getattr(infos, name)
        effective = _effective(info, infos.mask_function, spec, shape, is_dkv=name == "dkv")
        np.testing.assert_array_equal(effective, _dense(spec), err_msg=name)


def test_a_mask_hiding_everything_is_refused():
    """Splash fails (an assertion in its grid shrinking) on a mask with no visible block; `mask_info` says why."""
    spec = masks.MaskSpec("local", 256, 256, 0, (None, -1000))
    block_sizes = blocks.default_block_sizes(256, 256)
    with pytest.raises(AssertionError):
        _splash_kernel(spec, block_sizes)
    with pytest.raises(ValueError, match="hides every block"):
        mask_info.mask_infos(spec, block_sizes)


def test_a_block_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="must divide the padded key length"):
        mask_info.mask_infos(masks.MaskSpec("causal", 256, 384), BlockSizes(block_q=128, block_kv=256))


KERNEL_CASES = {
    "causal_bottom_right_table": ("t700_s300", "table", "causal", "bottom_right"),
    "window_both_mixed": ("t300_s700", "mixed", "window_both", "top_left"),
    "window_off_diagonal_fused": ("t300_s700", "fused", "window_off_diagonal", "bottom_right"),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernels_are_bitwise_equal_in_interpret_mode(case):
    """The splash kernel built from the structured tables gives bitwise splash's outputs, `lse` and gradients
    (forward, dQ and dK/dV kernels; Pallas interpret mode, with a soft cap as attnlib may pass one)."""
    lengths, block_name, mask, alignment = KERNEL_CASES[case]
    T, S, Tp, Sp, block_sizes = _setup(lengths, block_name)
    spec = _spec(mask, alignment, T, S, Tp, Sp)
    kw = dict(attn_logits_soft_cap=13.0, interpret=True)
    keys = jax.random.split(jax.random.key(0), 4)
    N, H = 2, 128
    q = jax.random.normal(keys[0], (N, Tp, H), jnp.float32)
    k = jax.random.normal(keys[1], (N, Sp, H), jnp.float32)
    v = jax.random.normal(keys[2], (N, Sp, H), jnp.float32)
    d_out = jax.random.normal(keys[3], (N, Tp, H), jnp.float32)
    results = []
    for build in (_splash_kernel, _structured_kernel):
        # (splash differentiates only its forward without residuals; the one with them gives `lse`)
        out, vjp = jax.vjp(build(spec, block_sizes, save_residuals=False, **kw), q, k, v)
        _, (lse,) = build(spec, block_sizes, save_residuals=True, **kw)(q, k, v)
        results.append((out, lse, *vjp(d_out)))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], *results):
        assert np.isfinite(np.asarray(a)).any(), name
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32), err_msg=name)


@pytest.mark.parametrize("length", [131072, 524288])
def test_long_tables_are_built_in_seconds(length):
    """At 128k and 512k tokens (causal, 512-blocks, as attnlib's table picks them) the three infos and the kernel
    object take well under a second (splash's own build: about 58 s at 128k, quarter of an hour at 512k); a few
    seconds are allowed for a busy machine. A Python loop over the `(T/512)^2` blocks would take far longer."""
    block_sizes = blocks.default_block_sizes(length, length)
    assert block_sizes.block_q == block_sizes.block_kv == 512
    spec = masks.MaskSpec("causal", length, length, 0)
    jnp.zeros(()).block_until_ready()  # (JAX's backend started outside the timing)
    start = time.process_time()  # this process's CPU time: other work on a shared machine does not count
    kernel = _structured_kernel(spec, block_sizes)
    jax.block_until_ready(jax.tree.leaves(kernel))
    elapsed = time.process_time() - start
    assert elapsed < 5.0, elapsed
    blocks_ = length // 512
    assert kernel.fwd_mask_info.block_mask.shape == (1, blocks_, blocks_)
    assert kernel.dkv_mask_info.block_mask.shape == (1, blocks_, blocks_)
    # The diagonal blocks are partly visible, those below wholly: row i sees key blocks 0..i.
    row = np.asarray(kernel.fwd_mask_info.block_mask[0, blocks_ - 1])
    np.testing.assert_array_equal(row, np.r_[np.full(blocks_ - 1, 2), 1])


def test_tables_are_numpy_before_the_kernel():
    """`mask_infos` leaves the tables as NumPy arrays (the kernel object moves them to the device, as splash does)."""
    T, S, Tp, Sp, block_sizes = _setup("t300_s700", "table")
    infos = mask_info.mask_infos(_spec("causal", "top_left", T, S, Tp, Sp), block_sizes)
    for info in (infos.fwd, infos.dq, infos.dkv):
        assert all(isinstance(x, np.ndarray) for x in (info.data_next, info.block_mask, info.q_sequence))
