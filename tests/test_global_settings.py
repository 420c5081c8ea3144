"""Every implementation gives the same results under a user's global JAX settings.

The settings: `jax_enable_x64`, `jax_default_matmul_precision` (default, bfloat16, tensorfloat32, float32, highest),
`jax_numpy_dtype_promotion` (strict, standard) and `jax_numpy_rank_promotion` (raise, allow), each set with
`jax.config.update` (restored after the test) and with its context manager. Under each, a dense call (causal, GQA,
T != S, N != K, bfloat16: forward, `lse` and gradients) and a paged decode (forward; on a TPU also a mixed
prefill + decode step on JAX's ragged paged-attention kernel) match the float64 reference
and the same call under the suite's settings (`conftest.py`: strict promotion, rank promotion raising, x64 off, the
default precision), within the tolerance the dtype deserves; under x64, float64 inputs run on the plain-JAX
implementations, and the fused ones decline them.

A Pallas TPU kernel is written for JAX's defaults and traced under them (`kernel_settings.as_written`): on a TPU a
64-bit index or a float32 contraction of bfloat16 operands fails Mosaic's lowering, which interpret mode does not
run. So for the Pallas implementation the test also reads the traced kernels (`pallas_call`): no 64-bit type, no
matrix product above the default precision. The `tpu` variants run the same cases on a TPU, the `gpu` ones on cuDNN.

Compiled functions, references and the results under the suite's settings are shared by every parametrization. A call
whose program under a setting lowers to the same text as under the suite's settings is the same program (same
inputs, same results): it is not compiled again, its results are the suite's. Only a program that differs (under x64,
for one: its index constants are 64-bit outside the kernels) is compiled and run under the setting.
"""

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_grad_close,
    assert_lse_close,
    assert_out_close,
    normal,
    on_a_simulated_tpu,
    rng,
    to_f64,
    Tol,
)
from reference import reference_attention, reference_attention_vjp

import attnlib


CONTEXTS = {
    "jax_enable_x64": jax.enable_x64,
    "jax_default_matmul_precision": jax.default_matmul_precision,
    "jax_numpy_dtype_promotion": jax.numpy_dtype_promotion,
    "jax_numpy_rank_promotion": jax.numpy_rank_promotion,
}
SUITE = {option: getattr(jax.config, option) for option in CONTEXTS}
"""The suite's settings (`conftest.py`), read at import: what "the same call under default settings" runs under."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One global JAX setting and how the user sets it: `"config"` (`jax.config.update`) or `"context"`."""

    option: str
    value: Any
    via: str

    @property
    def id(self) -> str:
        name = self.option.removeprefix("jax_").removeprefix("numpy_").removeprefix("default_")
        return f"{name}={'default' if self.value is None else self.value}-{self.via}"

    @contextlib.contextmanager
    def applied(self):
        if self.via == "context":
            with CONTEXTS[self.option](self.value):
                yield
            return
        before = getattr(jax.config, self.option)
        jax.config.update(self.option, self.value)
        try:
            yield
        finally:
            jax.config.update(self.option, before)


VALUES = {
    "jax_enable_x64": [True],
    "jax_default_matmul_precision": [None, "bfloat16", "tensorfloat32", "float32", "highest"],
    "jax_numpy_dtype_promotion": ["strict", "standard"],
    "jax_numpy_rank_promotion": ["raise", "allow"],
}
SETTINGS = [Setting(o, value, via) for o, values in VALUES.items() for value in values for via in ("config", "context")]
X64 = [s for s in SETTINGS if s.option == "jax_enable_x64"]


@pytest.fixture
def setting(request):
    """The test runs under `request.param` (a `Setting`); a `config.update` is undone afterwards."""
    with request.param.applied():
        yield request.param


def suite_settings():
    """The suite's settings, whatever the test's: for the results every setting is compared with."""
    stack = contextlib.ExitStack()
    for option, value in SUITE.items():
        stack.enter_context(CONTEXTS[option](value))
    return stack


def _sid(s: Setting) -> str:
    return s.id


IMPLEMENTATIONS = {
    "xla": "xla",
    "xla_chunked": attnlib.XlaChunked(block_k=5),
    "pallas_tpu_interpret": attnlib.PallasTpu(interpret=True),
    "pallas_tpu": attnlib.PallasTpu(),
    "cudnn": "cudnn",
}
MARKS = {"pallas_tpu": pytest.mark.tpu, "cudnn": pytest.mark.gpu}
IMPLS = [pytest.param(name, id=name, marks=MARKS.get(name, ())) for name in IMPLEMENTATIONS]
PALLAS = ("pallas_tpu_interpret", "pallas_tpu")


# ------------------------------------------------------------------------------------------------------------------
# the cases


@functools.cache
def dense_case():
    """`(q, k, v, d_out, d_lse)`: bfloat16 `[2, 13, 6, 8]`, `[2, 17, 2, 8]` inputs, cotangents of `out` and `lse`."""
    with suite_settings():
        return _dense_case()


def _dense_case():
    r = rng(3)
    q, k, v = (normal(r, shape, jnp.bfloat16) for shape in ((2, 13, 6, 8), (2, 17, 2, 8), (2, 17, 2, 8)))
    return q, k, v, normal(r, q.shape, jnp.bfloat16), normal(r, (2, 13, 6), jnp.float32)


def causal(implementation):
    """The dense call: `(q, k, v) -> (out, lse)`, causal."""
    return lambda q, k, v: attnlib.attention(
        q, k, v, is_causal=True, return_residual=True, implementation=implementation
    )


def with_vjp(implementation):
    """The jitted `(q, k, v, d_out, d_lse) -> (out, lse, (dq, dk, dv))` of the dense call and its VJP."""

    def run(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(causal(implementation), q, k, v)
        return out, lse, vjp((d_out, d_lse))

    return jax.jit(run)


@functools.cache
def dense_fn(name: str):
    return with_vjp(IMPLEMENTATIONS[name])


@functools.cache
def dense_reference():
    q, k, v, d_out, d_lse = (to_f64(x) for x in dense_case())
    out, lse = reference_attention(q, k, v, is_causal=True)
    grads = reference_attention_vjp(q, k, v, d_out=d_out, d_lse=d_lse, is_causal=True)
    return out, lse, tuple(grads[n] for n in ("query", "key", "value"))


@dataclasses.dataclass(frozen=True)
class Default:
    """A call's results under the suite's settings and the text of its lowered program."""

    results: Any
    text: str


def call(fn, args, default: Default) -> tuple[Any, Any]:
    """`(fn(*args), fn.trace(*args))` under the settings in force: `default.results` when the program lowers to
    `default.text` (the same program: not compiled again)."""
    traced = fn.trace(*args)
    if traced.lower().as_text() == default.text:
        return default.results, traced
    return fn(*args), traced


def under_suite_settings(fn, args) -> Default:
    with suite_settings():
        return Default(fn(*args), fn.trace(*args).lower().as_text())


@functools.cache
def dense_default(name: str) -> Default:
    return under_suite_settings(dense_fn(name), dense_case())


PAGE_SIZE = 16  # a multiple of 16: what a TPU serves


@functools.cache
def paged_case():
    """`(q [3, 1, 6, 40], k_pages, v_pages [11, 16, 2, 40], kwargs)`: 5, 40 and 0 keys in shuffled pages."""
    with suite_settings():
        return _paged_case()


def _paged_case():
    r = rng(5)
    q = normal(r, (3, 1, 6, 40), jnp.bfloat16)
    k, v = (normal(r, (11, PAGE_SIZE, 2, 40), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(r.permutation(11)[:9].reshape(3, 3), jnp.int32)
    kw = dict(page_table=table, key_value_seq_lengths=jnp.asarray([5, 40, 0], jnp.int32), is_causal=True,
              diagonal_alignment="bottom_right")  # fmt: skip
    return q, k, v, kw


@functools.cache
def paged_fn(name: str):
    implementation = IMPLEMENTATIONS[name]
    *_, kw = paged_case()
    return jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation=implementation, **kw))


@functools.cache
def paged_reference():
    q, k, v, kw = paged_case()
    kw = {n: (np.asarray(x) if isinstance(x, jax.Array) else x) for n, x in kw.items()}
    return reference_attention(to_f64(q), to_f64(k), to_f64(v), **kw)[0]


@functools.cache
def paged_default(name: str) -> Default:
    return under_suite_settings(paged_fn(name), paged_case()[:3])


# ------------------------------------------------------------------------------------------------------------------
# the traced kernels


def _jaxprs(params: Any):
    """The jaxprs among an equation's parameters (nested in tuples and lists too)."""
    for p in params if isinstance(params, tuple | list) else [params]:
        if isinstance(p, jex.ClosedJaxpr):
            yield p.jaxpr
        elif isinstance(p, jex.Jaxpr):
            yield p
        elif isinstance(p, tuple | list):
            yield from _jaxprs(p)


def _pallas_kernels(jaxpr):
    """`(kernel jaxpr, index-map jaxprs)` of every `pallas_call` in `jaxpr` and the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            maps = [m.index_map_jaxpr.jaxpr for m in getattr(eqn.params["grid_mapping"], "block_mappings", ())]
            yield eqn.params["jaxpr"], maps
            continue
        for sub in _jaxprs(list(eqn.params.values())):
            yield from _pallas_kernels(sub)


def _off_defaults(jaxpr, where: str):
    """What in `jaxpr` (and its nested jaxprs) a kernel written for JAX's defaults does not expect."""
    found = []
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            dtype = getattr(var.aval, "dtype", None)  # semaphores have a dtype of their own
            if isinstance(dtype, np.dtype) and dtype.itemsize == 8:
                found.append(f"{where}: {eqn.primitive.name} has a {jnp.dtype(dtype)} operand or result")
                break
        if eqn.primitive.name == "dot_general":
            precision = eqn.params["precision"]
            if precision not in (None, (jax.lax.Precision.DEFAULT,) * 2):
                found.append(f"{where}: dot_general at precision {precision}")
        for sub in _jaxprs(list(eqn.params.values())):
            found += _off_defaults(sub, where)
    return found


def assert_kernels_as_written(traced):
    """Every Pallas kernel in `traced` (a `jax.jit(...).trace(...)`) is traced under JAX's defaults."""
    kernels = list(_pallas_kernels(traced.jaxpr.jaxpr))
    assert kernels, "no pallas_call in the traced program"
    found = []
    for kernel, maps in kernels:
        found += _off_defaults(kernel, "kernel")
        for m in maps:
            found += _off_defaults(m, "index map")
    if found:
        pytest.fail("a Pallas kernel traced under the caller's settings:\n" + "\n".join(sorted(set(found))))


# ------------------------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("setting", SETTINGS, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", IMPLS)
def test_dense_call(name, setting):
    (out, lse, grads), traced = call(dense_fn(name), dense_case(), dense_default(name))
    ref_out, ref_lse, ref_grads = dense_reference()
    default_out, default_lse, default_grads = dense_default(name).results
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32, (out.dtype, lse.dtype)
    assert_out_close(out, ref_out, jnp.bfloat16)
    assert_lse_close(lse, ref_lse, jnp.bfloat16)
    assert_out_close(out, to_f64(default_out), jnp.bfloat16, what="out against the default settings'")
    assert_lse_close(lse, to_f64(default_lse), jnp.bfloat16, what="lse against the default settings'")
    for what, g, ref, default in zip(("dq", "dk", "dv"), grads, ref_grads, default_grads):
        assert g.dtype == jnp.bfloat16, (what, g.dtype)
        assert_grad_close(g, ref, jnp.bfloat16, what=what)
        assert_grad_close(g, to_f64(default), jnp.bfloat16, what=f"{what} against the default settings'")
    if name in PALLAS:
        assert_kernels_as_written(traced)


@pytest.mark.parametrize("setting", SETTINGS, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", IMPLS)
def test_paged_decode(name, setting):
    q, k, v, _ = paged_case()
    out, traced = call(paged_fn(name), (q, k, v), paged_default(name))
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert_out_close(out, paged_reference(), jnp.bfloat16)
    assert_out_close(out, to_f64(paged_default(name).results), jnp.bfloat16, what="out against the default settings'")
    if name in PALLAS:
        assert_kernels_as_written(traced)


@functools.cache
def ragged_case():
    """`(queries [6, 6, 40], cache, cu_seqlens_q, expected)`: a `"combined"` cache (JAX's ragged paged-attention
    kernel) of 5, 20 and 7 tokens, one mixed step of 3, 1 and 2 packed queries (bottom-right causal), and its float64
    reference, per sequence."""
    with suite_settings():
        return _ragged_case()


def _ragged_case():
    r = rng(7)
    lengths, counts = (5, 20, 7), (3, 1, 2)
    keys, values = (normal(r, (3, 20, 2, 40), jnp.bfloat16) for _ in range(2))
    queries = normal(r, (sum(counts), 6, 40), jnp.bfloat16)
    cache = attnlib.PagedKVCache.create(3, 11, PAGE_SIZE, 2, 40, dtype=jnp.bfloat16, max_pages_per_seq=3,
                                        layout="combined")  # fmt: skip
    cache = cache.append(keys, values, lengths=jnp.asarray(lengths, jnp.int32))
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    expected = np.concatenate([
        reference_attention(to_f64(queries[None, cu[b] : cu[b + 1]]), to_f64(keys[None, b, :n]),
                            to_f64(values[None, b, :n]), is_causal=True, diagonal_alignment="bottom_right")[0][0]
        for b, n in enumerate(lengths)
    ])  # fmt: skip
    return queries, cache, cu, expected


@functools.cache
def ragged_fn(name: str):
    implementation = IMPLEMENTATIONS[name]
    cu = ragged_case()[2]
    return jax.jit(lambda q, cache: cache.attend(q, cu_seqlens_q=cu, implementation=implementation))


@pytest.mark.parametrize("setting", SETTINGS, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", [p for p in IMPLS if p.id in PALLAS])
def test_ragged_paged_kernel(name, setting, monkeypatch):
    """A mixed prefill + decode step on a `"combined"` cache: JAX's ragged paged-attention kernel. Interpret mode
    cannot run it (`tests/test_paged_serving.py`; `PallasTpu(interpret=True)` raises): the interpret case reads the
    kernel as traced for a TPU (`on_a_simulated_tpu`), the TPU case also runs it."""
    queries, cache, _, expected = ragged_case()
    if name == "pallas_tpu_interpret":
        on_a_simulated_tpu(monkeypatch)
    traced = ragged_fn("pallas_tpu").trace(queries, cache)
    assert_kernels_as_written(traced)
    if name == "pallas_tpu":
        out = ragged_fn(name)(queries, cache)
        assert out.dtype == jnp.bfloat16
        assert_out_close(out, expected, jnp.bfloat16)


@functools.cache
def _backward_after_forward(name: str):
    """The VJP of the dense call, its forward traced and run under the suite's settings."""
    q, k, v, _, _ = dense_case()
    with suite_settings():
        return jax.vjp(jax.jit(causal(IMPLEMENTATIONS[name])), q, k, v)[1]


LATER = [s for s in SETTINGS if s.via == "context" and s.value in (True, "highest")]


@pytest.mark.parametrize("setting", LATER, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", [p for p in IMPLS if p.id in PALLAS])
def test_pallas_backward_traced_after_the_forward(name, setting):
    """A `custom_vjp` backward is traced when the VJP is applied, under the settings in force then: here, a forward
    under the suite's settings and its backward under `setting`."""
    vjp = _backward_after_forward(name)
    *_, d_out, d_lse = dense_case()
    backward = jax.jit(vjp)
    grads = backward((d_out, d_lse))
    for what, g, default in zip(("dq", "dk", "dv"), grads, dense_default(name).results[2]):
        assert_grad_close(g, to_f64(default), jnp.bfloat16, what=f"{what} against the default settings'")
    assert_kernels_as_written(backward.trace((d_out, d_lse)))


TIGHT = Tol(atol=1e-12, rtol=1e-12)
PLAIN = {"xla": "xla", "xla_chunked": IMPLEMENTATIONS["xla_chunked"], "automatic": None}


@functools.cache
def float64_fn(name: str):
    return with_vjp(PLAIN[name])


def float64_case():
    """The dense case in float64 (its bfloat16 values, exactly): call under x64."""
    return tuple(jnp.asarray(to_f64(x)) for x in dense_case())


@pytest.mark.parametrize("setting", X64, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", list(PLAIN))
def test_float64_inputs_run_in_float64(name, setting):
    """Under x64 float64 inputs are valid: the plain-JAX implementations (and automatic dispatch) compute in float64
    and match the float64 reference to float64 precision."""
    case = float64_case()
    assert case[0].dtype == jnp.float64
    out, lse, grads = float64_fn(name)(*case)
    ref_out, ref_lse, ref_grads = dense_reference()
    assert out.dtype == lse.dtype == jnp.float64 and all(g.dtype == jnp.float64 for g in grads)
    assert_close(out, ref_out, TIGHT, what="out")
    assert_close(lse, ref_lse, TIGHT, what="lse")
    for what, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(g, ref, TIGHT, what=what, scale_atol_by_max=True)


@pytest.mark.parametrize("setting", X64, ids=_sid, indirect=True)
@pytest.mark.parametrize("name", [p for p in IMPLS if p.id in PALLAS + ("cudnn",)])
def test_fused_implementations_decline_float64(name, setting):
    """Named, a fused implementation raises `NotImplementedError` naming float64; in a sequence, the call falls back."""
    q, k, v, _, _ = float64_case()
    fused = IMPLEMENTATIONS[name]
    with pytest.raises(NotImplementedError, match="float64"):
        attnlib.attention(q, k, v, is_causal=True, implementation=fused)
    explanation = attnlib.explain(q, k, v, is_causal=True, implementation=(fused, "xla"))
    assert explanation.implementation == "xla"
    assert "float64" in next(iter(explanation.declined.values()))


@pytest.mark.parametrize("setting", X64, ids=_sid, indirect=True)
def test_paged_kv_cache_bookkeeping_stays_int32(setting):
    """A `PagedKVCache` appended to (dense and ragged) and released under x64 keeps its int32 page table, lengths,
    free list and page count, with the same values as under the suite's settings."""

    def steps():
        cache = attnlib.PagedKVCache.create(2, 6, 4, 1, 8, dtype=jnp.bfloat16, max_pages_per_seq=3)
        tokens = lambda n: jnp.ones((2, n, 1, 8), jnp.bfloat16)  # noqa: E731
        cache = cache.append(tokens(5), tokens(5), lengths=jnp.asarray([5, 2], jnp.int32))
        cache = cache.append(tokens(3)[0], tokens(3)[0], cu_seqlens=np.asarray([0, 1, 3], np.int32))
        cache = cache.release(jnp.asarray([True, False]))
        return [cache.page_table, cache.lengths, cache.free_pages, cache.num_used_pages]

    steps = jax.jit(steps)  # traced under the settings in force (as eagerly), compiled once, not op by op
    with suite_settings():
        expected = steps()
    for name, x, e in zip(("page_table", "lengths", "free_pages", "num_used_pages"), steps(), expected):
        assert x.dtype == jnp.int32, (name, x.dtype)
        np.testing.assert_array_equal(x, e, err_msg=name)
