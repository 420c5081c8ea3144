"""Shared test helpers: input factories with odd distinct sizes, dtype-keyed tolerances and assert helpers.

Tolerances are derived from the machine epsilon of the dtype the library computes in, never tuned to pass:

* Inputs are drawn in float32, cast to the test dtype, and the reference (float64) is fed exactly the rounded values,
  so input rounding is not part of the error.
* Outputs (`out`, dtype = query dtype): the relative error of one softmax row is a small multiple of eps from the
  logits (`H` products summed, then `exp`) plus the rounding of `out` itself and, for 16-bit dtypes, of the
  probabilities before the `p @ v` product (as `jax.nn` does). With values ~N(0, 1) (|v| <= ~4 over a few hundred
  draws) the absolute error is bounded by roughly `(1 + max|v| + |s|eps-growth) * eps/2`, i.e. a few eps.
  float32: eps = 2**-23 ~ 1.2e-7, the bound with ~20-term sums is < 1e-5 (~80 eps).
  bfloat16: eps = 2**-7 ~ 7.8e-3 (unit roundoff 2**-8), atol = 2 eps, rtol = eps.
* `lse` is float32 by contract; with 16-bit inputs the logits go through one 16-bit input rounding that the reference
  already sees, so the remaining error is that of a float32 (or 16-bit, if an implementation computes logits in the
  input dtype) log-sum-exp: we allow a few 16-bit ulps of |s| (<= ~8), i.e. atol = 2 eps(bf16).
* Gradients are sums over T or S of products that are each rounded (cotangent, probabilities, `dp - D`
  cancellation), so elementwise relative error of a small entry is meaningless; they are compared with an absolute
  tolerance scaled by the largest entry of the reference gradient (`atol * max|expected|`) plus `rtol * |expected|`.
  The scaled atol is 4x the output one: the softmax backward `p (dp - D)` loses about log2(|dp| / |dp - D|) bits in
  the cancellation, and its sums run over T or S terms; 4x (2 extra bits) covers that for our ~N(0, 1) inputs.
"""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


# ------------------------------------------------------------------------------------------------------------------
# sizes: odd and distinct so that transposed / confused axes cannot go unnoticed.
B, T, S, N, K, H, HV = 2, 13, 17, 6, 2, 8, 5
DTYPES = [jnp.float32, jnp.bfloat16]
DTYPE_IDS = ["f32", "bf16"]


def eps(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


@dataclasses.dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


_EPS_BF16 = eps(jnp.bfloat16)  # 2**-7
_EPS_F16 = eps(jnp.float16)  # 2**-10

OUT_TOL = {
    np.dtype(jnp.float32): Tol(atol=1e-5, rtol=1e-5),
    np.dtype(jnp.bfloat16): Tol(atol=2 * _EPS_BF16, rtol=_EPS_BF16),
    np.dtype(jnp.float16): Tol(atol=2 * _EPS_F16, rtol=_EPS_F16),
}
LSE_TOL = {
    np.dtype(jnp.float32): Tol(atol=1e-5, rtol=1e-6),
    np.dtype(jnp.bfloat16): Tol(atol=2 * _EPS_BF16, rtol=0.0),
    np.dtype(jnp.float16): Tol(atol=2 * _EPS_F16, rtol=0.0),
}
# gradients: atol is relative to max|expected| of the tensor (see module docstring).
GRAD_TOL = {
    np.dtype(jnp.float32): Tol(atol=4e-5, rtol=1e-5),
    np.dtype(jnp.bfloat16): Tol(atol=8 * _EPS_BF16, rtol=_EPS_BF16),
    np.dtype(jnp.float16): Tol(atol=8 * _EPS_F16, rtol=_EPS_F16),
}


# ------------------------------------------------------------------------------------------------------------------
# factories


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def normal(r: np.random.Generator, shape, dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    """`N(0, scale**2)` drawn in float32 and rounded to `dtype`."""
    return jnp.asarray((scale * r.standard_normal(shape)).astype(np.float32)).astype(dtype)


def qkv(r, *, batch=(B,), t=T, s=S, n=N, k=K, h=H, hv=H, dtype=jnp.float32):
    """`query [*batch, t, n, h]`, `key [*batch, s, k, h]`, `value [*batch, s, k, hv]`."""
    batch = tuple(batch)
    return (
        normal(r, batch + (t, n, h), dtype),
        normal(r, batch + (s, k, h), dtype),
        normal(r, batch + (s, k, hv), dtype),
    )


def lengths(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int32))


def segment_ids_from_runs(runs, total: int) -> np.ndarray:
    """`[total]` int32 ids from `[(id, count), ...]` runs, padded with 0 to `total`."""
    ids = [i for i, c in runs for _ in range(c)]
    assert len(ids) <= total
    return np.asarray(ids + [0] * (total - len(ids)), dtype=np.int32)


def to_f64(x):
    """A JAX/NumPy array (any float dtype incl. bfloat16) as float64 NumPy; None stays None."""
    if x is None:
        return None
    x = np.asarray(x)
    if x.dtype == np.bool_ or np.issubdtype(x.dtype, np.integer):
        return x
    return x.astype(np.float64)


# ------------------------------------------------------------------------------------------------------------------
# asserts


def _fmt_worst(actual, expected, err, bound):
    idx = np.unravel_index(np.argmax(err - bound), err.shape)
    return (
        f"max violation at {tuple(int(i) for i in idx)}: actual={actual[idx]!r}, expected={expected[idx]!r}, "
        f"|err|={err[idx]:.3g} > bound={bound[idx]:.3g}; max|err|={err.max():.3g}"
    )


def assert_finite(x, what: str = "array"):
    x = np.asarray(to_f64(x))
    assert not np.isnan(x).any(), f"{what} has NaN at {np.argwhere(np.isnan(x))[:5].tolist()}"


def assert_close(actual, expected, tol: Tol, *, what: str = "", scale_atol_by_max: bool = False):
    """Elementwise `|a - e| <= atol' + rtol |e|`; `atol' = atol * max(1, max|e|)` for gradients.

    Non-finite expected values must be matched exactly (same infinities), and `actual` must have no NaN.
    """
    a = np.asarray(to_f64(actual))
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN at {np.argwhere(np.isnan(a))[:5].tolist()}"
    fin = np.isfinite(e)
    if not fin.all():
        mism = ~fin & (a != e)
        assert not mism.any(), (
            f"{what}: expected non-finite values not matched at {np.argwhere(mism)[:5].tolist()}: "
            f"actual {a[mism][:5]}, expected {e[mism][:5]}"
        )
    fa = np.isfinite(a)
    bad = fin & ~fa
    assert not bad.any(), f"{what}: actual non-finite where expected finite at {np.argwhere(bad)[:5].tolist()}"
    atol = tol.atol
    if scale_atol_by_max:
        m = np.abs(e[fin]).max() if fin.any() else 0.0
        atol = tol.atol * max(1.0, float(m))
    err = np.where(fin, np.abs(a - np.where(fin, e, 0.0)), 0.0)
    bound = atol + tol.rtol * np.abs(np.where(fin, e, 0.0))
    assert (err <= bound).all(), f"{what}: " + _fmt_worst(a, e, err, bound)


def assert_out_close(actual, expected, dtype, what="out"):
    assert_close(actual, expected, OUT_TOL[np.dtype(dtype)], what=what)


def assert_lse_close(actual, expected, dtype, what="lse"):
    assert np.asarray(actual).dtype == np.float32, f"{what}: dtype {np.asarray(actual).dtype}, want float32"
    assert_close(actual, expected, LSE_TOL[np.dtype(dtype)], what=what)


def assert_grad_close(actual, expected, dtype, what="grad"):
    assert_close(actual, expected, GRAD_TOL[np.dtype(dtype)], what=what, scale_atol_by_max=True)


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def num_rows(x) -> int:
    return int(math.prod(np.shape(x)[:-1]))


def place_calls_on(monkeypatch, platform: str) -> None:
    """Make attnlib's dispatch see the calls of this test placed on `platform` ("cpu", "gpu" or "tpu"), whatever this
    machine has: JAX's default backend and `jax.default_device`'s platform as attnlib reads them
    (`attnlib/_src/backends/placement.py`). The arrays stay where they are (on a GPU or TPU machine: on its CPU, by
    `conftest._host_tests_run_on_the_cpu`)."""
    from attnlib._src.backends import placement

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(placement, "default_device_platform", lambda: platform)


def on_a_simulated_tpu(monkeypatch) -> None:
    """Make attnlib see a TPU, with the calls of this test placed on it: `attnlib.PallasTpu()` (not in interpret
    mode) then takes calls as on a TPU, and automatic dispatch chooses as there."""
    from attnlib._src.backends.pallas_tpu import implementation

    monkeypatch.setattr(implementation, "tpu_visible", lambda: True)
    place_calls_on(monkeypatch, "tpu")


def simulate_a_machine_without_a_gpu(monkeypatch, *, nvidia_driver: bool) -> None:
    """Make attnlib see a machine whose JAX has CPU devices only (`nvidia_driver`: whether it has an NVIDIA driver
    anyway, as with a JAX installed without its CUDA plugin), whatever this machine has."""
    from attnlib._src.backends.cudnn import support

    cpus = jax.devices("cpu")
    place_calls_on(monkeypatch, "cpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: cpus if backend in (None, "cpu") else [])
    monkeypatch.setattr(support, "nvidia_driver_present", lambda: nvidia_driver)
    monkeypatch.setattr(support, "_device", support._device.__wrapped__)


def run_pytest_on_simulated_devices(test_file: str, num_devices: int, tier: str = "fast") -> None:
    """Run `tests/<test_file>` in a subprocess whose CPU backend has `num_devices` devices (the count is fixed when
    JAX starts, and the main pytest process has started it); fail with its report unless every test passed. `tier`
    picks the file's tests: `"fast"` those not marked `full`, `"full"` the others."""
    # No third-party pytest plugins (hypothesis, xdist): these files use none, and loading them costs each run ~2 s.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num_devices}"
        # tiny programs: LLVM optimisation time dominates and does not change what is tested
        " --xla_backend_optimization_level=0"
    ).strip()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{test_file}",
         "-m", "full" if tier == "full" else "not full"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = (proc.stdout + proc.stderr)[-20000:]
    assert proc.returncode == 0, f"tests/{test_file} failed (exit {proc.returncode}):\n{report}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report


def assert_matches_finite_differences(grads: dict, loss, args: dict, step: float = 1e-6) -> None:
    """`grads[name]` equals the central differences of the float64 scalar `loss(args)` for every array in `args`."""
    for name, x in args.items():
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = dict(args), dict(args)
            plus[name] = x.copy()
            plus[name][idx] += step
            minus[name] = x.copy()
            minus[name][idx] -= step
            fd[idx] = (loss(plus) - loss(minus)) / (2 * step)
        # central differences in float64: truncation ~ step**2, rounding ~ 1e-16 / step -> ~1e-9 absolute
        np.testing.assert_allclose(grads[name], fd, atol=1e-7, rtol=1e-6, err_msg=f"d{name}")


def paged_decode_stand_in(traced_shapes: list | None = None):
    """A plain-JAX function with the contract of `pallas_tpu.paged.decode_kernel` (JAX's paged-attention kernel), for
    tests of what attnlib does around the kernel where the kernel cannot run (partitioning: TPU interpret mode's
    callbacks cannot be partitioned). It appends the query shape of each trace to `traced_shapes`: a partitioned call
    is traced with each shard's local shapes. `[B, N, H']` from `query [B, N, H']` (scaled), pools
    `[K, P, page_size, H']`."""

    def decode(query, k_pool, v_pool, lengths, table, *, soft_cap, pages_per_block, interpret):
        del pages_per_block, interpret
        if traced_shapes is not None:
            traced_shapes.append(query.shape)
        K, _, _, H = k_pool.shape
        B, N, _ = query.shape
        gather = lambda pool: pool[:, table].reshape(K, B, -1, H).astype(jnp.float32)  # noqa: E731  [K, B, S, H']
        k, v = gather(k_pool), gather(v_pool)
        q = query.astype(jnp.float32).reshape(B, K, N // K, H)
        s = jnp.einsum("bkgh,kbsh->bkgs", q, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        seen = jnp.arange(k.shape[2])[None, None, None, :] < lengths[:, None, None, None]
        p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgs,kbsh->bkgh", jnp.where(seen, p, 0.0), v)
        return out.reshape(B, N, H).astype(query.dtype)

    return decode


def ragged_paged_stand_in():
    """A plain-JAX function with the contract of `pallas_tpu.ragged.ragged_kernel` (JAX's ragged paged-attention
    kernel), for tests of what attnlib does around the kernel on CPU: TPU interpret mode cannot run that kernel in
    JAX 0.10.2 (it reshapes a VMEM ref, which the interpreter does not implement). `[T, N, D']` from queries
    `[T, N, D']`, the combined pool `[P, page_size, 2K, D']` (keys at even, values at odd slots), kv lengths `[B]`,
    page table `[B, pages_per_seq]`, `cu_q_lens` `[B + 1]`: each sequence causal bottom-right, `window_left` keys
    before the diagonal, soft cap; rows that see nothing are left as NaN (attnlib must replace them)."""

    def ragged(q, pool, kv_lens, page_table, cu_q_lens, *, scale, window_left, soft_cap, interpret):
        del interpret
        B, pages_per_seq = page_table.shape
        _, page, combined, D = pool.shape
        K = combined // 2
        T, N, _ = q.shape
        rows = pool[page_table].reshape(B, pages_per_seq * page, combined, D).astype(jnp.float32)
        k, v = rows[:, :, 0::2], rows[:, :, 1::2]  # [B, S, K, D]
        token = jnp.arange(T)
        seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, B - 1)
        position = token - cu_q_lens[seq] + kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq])
        s = jnp.einsum("tkgd,tskd->tkgs", q.astype(jnp.float32).reshape(T, K, N // K, D) * scale, k[seq])
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        j = jnp.arange(k.shape[1])[None, :]
        seen = (j < kv_lens[seq][:, None]) & (j <= position[:, None])
        if window_left is not None:
            seen = seen & (j >= position[:, None] - window_left)
        p = jax.nn.softmax(jnp.where(seen[:, None, None, :], s, -jnp.inf), axis=-1)
        out = jnp.einsum("tkgs,tskd->tkgd", p, v[seq])
        return out.reshape(T, N, D).astype(q.dtype)

    return ragged
