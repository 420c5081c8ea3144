"""`score_mod_lowering`: a scalar JAX score modifier lowered to cuDNN pointwise ops, checked on CPU.

Forward: `emit_forward` on `NumpyOps` over index grids `[B, N, T, S]` against `jnp.vectorize(fn)` on the same grids.
Backward: `emit_backward` (after `emit_forward` in the same store) against `jax.grad(fn)` times a random `dS`.
Structure: a recording ops object checks the forms cuDNN 9.19 builds (booleans only as select masks, forward
tensors only as a backward op's `input=`, no dangling tensors, no select of two constants feeding arithmetic).
`CudnnOps` is checked against a fake graph and against the real frontend's pygraph IR (no GPU needed to define ops).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnlib._src.backends.cudnn import score_mod_lowering as lowering


F32, I32 = jnp.float32, jnp.int32
B, N, T, S = 2, 3, 7, 11
NEG_INF = -jnp.inf


def _grids() -> list[np.ndarray]:
    b, n, t, s = np.meshgrid(np.arange(B), np.arange(N), np.arange(T), np.arange(S), indexing="ij")
    return [x.astype(np.int32) for x in (b, n, t, s)]


GRIDS = _grids()
RNG = np.random.default_rng(0)
SCORE = (RNG.standard_normal((B, N, T, S)) * 3).astype(np.float32)
D_SCORE = RNG.standard_normal((B, N, T, S)).astype(np.float32)
SLOPE = (2.0 ** -np.arange(1, N + 1)).astype(np.float32).reshape(1, N, 1, 1)


def trace(fn, n_args: int = 0):
    scalars = [jnp.zeros((), F32)] + [jnp.zeros((), I32)] * 4 + [jnp.zeros((), F32)] * n_args
    return jax.make_jaxpr(fn)(*scalars)


def reference(fn, args=()):
    return np.asarray(jnp.vectorize(fn)(SCORE, *GRIDS, *args))


def reference_grad(fn, args=()):
    return np.asarray(jnp.vectorize(jax.grad(fn))(SCORE, *GRIDS, *args)) * D_SCORE


def emulate(fn, args=(), *, backward=False, ops=None, jaxpr_args=None):
    """(forward, backward-or-None) of `fn` lowered onto `ops` (NumpyOps by default)."""
    ops = lowering.NumpyOps() if ops is None else ops
    jaxpr = trace(fn, len(args) if jaxpr_args is None else len(jaxpr_args))
    args = list(args) if jaxpr_args is None else jaxpr_args
    store: dict = {}
    calls = []

    def indices():
        calls.append(1)
        return GRIDS

    out = lowering.emit_forward(ops, jaxpr, SCORE, indices, args, store)
    assert len(calls) <= 1
    grad = None
    if backward:
        calls.clear()
        grad = lowering.emit_backward(ops, jaxpr, D_SCORE, indices, args, store)
        assert len(calls) <= 1
    return out, grad


def assert_scores_close(actual, expected, rtol=2e-5, atol=2e-5):
    """Equal up to float32 rounding; -inf in `expected` means a masked score (<= -1e29) in `actual`."""
    actual = np.broadcast_to(np.asarray(actual, np.float32), expected.shape)
    masked = np.isneginf(expected)
    assert np.all(actual[masked] <= -1e29), "a masked score is not masked"
    np.testing.assert_allclose(actual[~masked], expected[~masked], rtol=rtol, atol=atol)


def check(fn, args=(), *, backward=True, rtol=2e-5, atol=2e-5):
    assert lowering.forward_reason(trace(fn, len(args))) is None
    if backward:
        assert lowering.backward_reason(trace(fn, len(args))) is None
    out, grad = emulate(fn, args, backward=backward)
    assert_scores_close(out, reference(fn, args), rtol, atol)
    if backward:
        np.testing.assert_allclose(np.broadcast_to(grad, SCORE.shape), reference_grad(fn, args), rtol=rtol, atol=atol)


def f(x):
    return x.astype(F32)


# ---------------------------------------------------------------------------------------------------------------------
# Modifiers with a forward and a backward.
# ---------------------------------------------------------------------------------------------------------------------


def softcap(s, b, h, q, k):
    return 5.0 * jnp.tanh(s / 5.0)


def causal(s, b, h, q, k):
    return jnp.where(q >= k, s, NEG_INF)


@jax.jit
def _jitted_softcap(s):
    return 4.0 * jnp.tanh(s * 0.25)


@jax.custom_jvp
def _custom_softcap(s):
    return 3.0 * jnp.tanh(s / 3.0)


_custom_softcap.defjvp(lambda primals, tangents: (_custom_softcap(primals[0]), tangents[0]))


@jax.custom_vjp
def _vjp_scale(s):
    return s * 2.0


_vjp_scale.defvjp(lambda s: (s * 2.0, None), lambda _, g: (g * 2.0,))


BOTH = {
    "softcap": softcap,
    "alibi_python_slope": lambda s, b, h, q, k: s - 0.25 * f(jnp.abs(q - k)),
    "head_sin": lambda s, b, h, q, k: s + jnp.sin(f(h) * 0.7 + f(q) * 0.1) - f(b),
    "causal": causal,
    "causal_offset": lambda s, b, h, q, k: jnp.where(q + (S - T) >= k, s, NEG_INF),
    "sliding_window": lambda s, b, h, q, k: jnp.where((q >= k) & (k > q - 3), s, NEG_INF),
    "prefix_lm": lambda s, b, h, q, k: jnp.where((k <= q) | (k < 3), s, NEG_INF),
    "document": lambda s, b, h, q, k: jnp.where(q // 4 == k // 4, s, NEG_INF),
    "document_remainder": lambda s, b, h, q, k: jnp.where((q - k) % 4 == 0, s, NEG_INF),
    "not_mask": lambda s, b, h, q, k: jnp.where(~(q < k), s, NEG_INF),
    "xor_mask": lambda s, b, h, q, k: jnp.where((q >= k) ^ (k < 2), s, NEG_INF),
    "literal_mask": lambda s, b, h, q, k: jnp.where(jnp.logical_or(q >= k, True), s, NEG_INF),
    "softcap_then_causal": lambda s, b, h, q, k: jnp.where(q >= k, 5.0 * jnp.tanh(s / 5.0), NEG_INF),
    "causal_then_softcap": lambda s, b, h, q, k: 5.0 * jnp.tanh(jnp.where(q >= k, s, NEG_INF) / 5.0),
    "window_softcap_alibi": lambda s, b, h, q, k: jnp.where(
        (q >= k) & (q - k < 5), 5.0 * jnp.tanh(s / 5.0) - 0.5 * f(q - k), NEG_INF
    ),
    "additive_mask": lambda s, b, h, q, k: s + jnp.where(q >= k, 0.0, NEG_INF),
    "multiplicative_mask": lambda s, b, h, q, k: s * f(q >= k) + 2.0 * f(k > 4),
    "two_wheres": lambda s, b, h, q, k: jnp.where(q >= k, s, 0.5 * s),
    "sum_of_masked": lambda s, b, h, q, k: jnp.where(q >= k, s, 0.0) + jnp.where(k > 5, 2.0 * s, 0.0),
    "scale_by_index": lambda s, b, h, q, k: s * (f(h) + 1.0) / (f(k) + 2.0) - s,
    "logistic": lambda s, b, h, q, k: 4.0 * jax.nn.sigmoid(s / 2.0),
    "logistic_masked": lambda s, b, h, q, k: jnp.where(q >= k, jax.nn.sigmoid(s) + s, NEG_INF),
    "tanh_twice": lambda s, b, h, q, k: jnp.tanh(s) + 2.0 * jnp.tanh(0.5 * s + f(k)),
    "jit_helper": lambda s, b, h, q, k: jnp.where(q >= k, _jitted_softcap(s), NEG_INF),
    "nested_jit": lambda s, b, h, q, k: jax.jit(lambda x: jax.jit(softcap)(x, b, h, q, k))(s),
    "custom_rule_off_the_score_path": lambda s, b, h, q, k: s + _custom_softcap(f(q - k)) + _vjp_scale(f(k)),
    "checkpoint": lambda s, b, h, q, k: jax.checkpoint(lambda x: 2.0 * jnp.tanh(x))(s),
    "stop_gradient": lambda s, b, h, q, k: s + jax.lax.stop_gradient(jnp.tanh(s)),
    "integer_index_terms": lambda s, b, h, q, k: (
        s + f((q - k) // 3) + f((q - k) % 3) + f(jax.lax.div(q - k, 3)) + f(jax.lax.rem(q - k, 3))
    ),
    "convert_roundtrip": lambda s, b, h, q, k: s + f((f(q - k) * 0.4).astype(I32)),
    "output_is_score": lambda s, b, h, q, k: s,
    "argmax_free_clip_bias": lambda s, b, h, q, k: s + jnp.clip(f(q - k), -2.0, 3.0),
    "or_shared_left": lambda s, b, h, q, k: jnp.where((q >= k) | (q >= 5), s, NEG_INF),
    "prefix_lm_strict": lambda s, b, h, q, k: jnp.where((k < q) | (4 > k), s, NEG_INF),
    "and_shared_right_mixed": lambda s, b, h, q, k: jnp.where((q >= k) & (q - 2 > k), s, NEG_INF),
    "and_shared_left_mixed": lambda s, b, h, q, k: jnp.where((q > k) & (3 <= q), s, NEG_INF),
    "or_mixed_not_integral": lambda s, b, h, q, k: jnp.where((f(q) * 0.5 >= f(k)) | (f(q) * 0.5 > 2.0), s, NEG_INF),
}


@pytest.mark.parametrize("fn", list(BOTH.values()), ids=list(BOTH))
def test_forward_and_backward(fn):
    check(fn)


def test_alibi_with_slope_tensor():
    fn = lambda s, b, h, q, k, slope: s - slope * f(jnp.abs(q - k))
    check(fn, (SLOPE,))


def test_alibi_with_baked_slope():
    fn = lambda s, b, h, q, k, slope: s - slope * f(jnp.abs(q - k))
    out, grad = emulate(fn, backward=True, jaxpr_args=[0.125])
    expected = reference(lambda s, b, h, q, k: s - 0.125 * f(jnp.abs(q - k)))
    assert_scores_close(out, expected)
    np.testing.assert_allclose(np.broadcast_to(grad, SCORE.shape), D_SCORE)


def test_arg_scales_the_score():
    fn = lambda s, b, h, q, k, c: c * jnp.tanh(s / c)
    check(fn, (np.full((1, N, 1, 1), 4.0, np.float32) + SLOPE,))


# ---------------------------------------------------------------------------------------------------------------------
# Forward-only primitives (their gradients are not expressible, their forward is).
# ---------------------------------------------------------------------------------------------------------------------

FORWARD_ONLY = {
    "exp": lambda s, b, h, q, k: jnp.exp(s / 4.0),
    "log_sqrt_rsqrt": lambda s, b, h, q, k: jnp.log(jnp.abs(s) + 1.0) + jnp.sqrt(jnp.abs(s)) + jax.lax.rsqrt(s * s + 1),
    "log1p_expm1_exp2": lambda s, b, h, q, k: jnp.log1p(jnp.abs(s)) + jnp.expm1(s / 4.0) + jnp.exp2(s / 3.0),
    "trig": lambda s, b, h, q, k: jnp.sin(s) + jnp.cos(s) + jnp.tan(s / 4.0),
    "erf": lambda s, b, h, q, k: jax.lax.erf(s),
    "powers": lambda s, b, h, q, k: s**2 + jnp.square(s) + s**3 + 1.0 / (s * s + 1.0) + (s * s + 1.0) ** -2,
    "pow": lambda s, b, h, q, k: jnp.power(jnp.abs(s) + 1.0, 0.5 + f(h)) + jnp.power(2.0, f(k) / 4.0),
    "max_min_clip": lambda s, b, h, q, k: jnp.maximum(s, 0.5) + jnp.minimum(s, f(k)) + jnp.clip(s, -1.0, 1.0),
    "lax_clamp": lambda s, b, h, q, k: jax.lax.clamp(-1.0, s, f(k)),
    "floor_ceil": lambda s, b, h, q, k: jnp.floor(s) + jnp.ceil(s),
    "round": lambda s, b, h, q, k: jnp.round(s * 2.0) + jax.lax.round(s * 2.0, jax.lax.RoundingMethod.AWAY_FROM_ZERO),
    "sign": lambda s, b, h, q, k: jnp.sign(s) + f(jnp.sign(q - k)) + jnp.sign(f(q - k) * 1e-30),
    "abs": lambda s, b, h, q, k: jnp.abs(s),
    "fmod_remainder_floordiv": lambda s, b, h, q, k: jnp.fmod(s, 2.5) + jnp.remainder(s, 2.5) + s // 2.0,
    "float_to_int": lambda s, b, h, q, k: f((s * 3.0).astype(I32)),
    "relu": lambda s, b, h, q, k: jax.nn.relu(s - 1.0),
    "gelu": lambda s, b, h, q, k: jax.nn.gelu(s),
    "softplus": lambda s, b, h, q, k: jax.nn.softplus(s),
    "silu": lambda s, b, h, q, k: jax.nn.silu(s),
    "custom_jvp": lambda s, b, h, q, k: _custom_softcap(s) - 0.1 * f(k),
    "custom_vjp": lambda s, b, h, q, k: _vjp_scale(s) + f(q),
    "score_condition": lambda s, b, h, q, k: jnp.where(s > 0.5, s, 0.1 * s),
    "bool_from_float": lambda s, b, h, q, k: jnp.where(s.astype(bool), 1.0, -1.0) + f(q.astype(bool)),
    "select_of_constants_in_arithmetic": lambda s, b, h, q, k: (
        s * jnp.where(q >= k, 2.0, 0.5) + jnp.where(k > 3, 1.0, 0.0)
    ),
    "integer_select_n": lambda s, b, h, q, k: s + jax.lax.select_n(k % 3, 1.0, 2.0, 4.0),
    "boolean_select": lambda s, b, h, q, k: jnp.where(jnp.where(q > 3, k > 2, k < 5), s, NEG_INF),
    "bool_eq": lambda s, b, h, q, k: jnp.where((q > 3) == (k > 2), s, NEG_INF),
}


@pytest.mark.parametrize("fn", list(FORWARD_ONLY.values()), ids=list(FORWARD_ONLY))
def test_forward_only(fn):
    check(fn, backward=False, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Integer semantics (ints are float32 values inside cuDNN).
# ---------------------------------------------------------------------------------------------------------------------

INT_OPS = {
    "floor_divide": lambda a, c: a // c,
    "remainder": lambda a, c: a % c,
    "lax_div": jax.lax.div,
    "lax_rem": jax.lax.rem,
    "sign": lambda a, c: jnp.sign(a) * c,
    "abs_max_min": lambda a, c: jnp.abs(a) + jnp.maximum(a, c) - jnp.minimum(a, -c),
    "int_pow": lambda a, c: a**2 - a**3 + c,
    "clip": lambda a, c: jnp.clip(a, -c, c),
}


@pytest.mark.parametrize("op", list(INT_OPS.values()), ids=list(INT_OPS))
@pytest.mark.parametrize("divisor", [1, 3, 4, -3, "kv+1", "-(kv+1)"])
def test_integer_ops(op, divisor):
    """Negative numerators (q - kv) and constant or index divisors of either sign."""

    def fn(s, b, h, q, k):
        c = {"kv+1": k + 1, "-(kv+1)": -(k + 1)}.get(divisor, divisor) if isinstance(divisor, str) else divisor
        return s + f(op(q - k - 2, c))

    check(fn)


def test_integer_division_large_values():
    """Exact for |numerator| up to 2**21, through an inexact division."""
    big = np.int32(2**21 - 1)
    a = np.arange(-(2**21) + 1, 2**21, 997, dtype=np.int32)
    for c in (1, 3, 7, 4096, -5):
        jaxpr = trace(lambda s, b, h, q, k: f(q // c) + f(q % c) * 0.5 + f(jax.lax.div(q, c)) * 0.25 + s)
        grids = [np.zeros_like(a), np.zeros_like(a), a, np.zeros_like(a)]
        out = lowering.emit_forward(lowering.NumpyOps(), jaxpr, np.float32(0), lambda: grids, [], {})
        expected = (a // c) + (a % c) * 0.5 + np.trunc(a / c) * 0.25
        np.testing.assert_array_equal(out, expected.astype(np.float32))
    assert big < 2**24


# ---------------------------------------------------------------------------------------------------------------------
# What cannot be lowered: the reason names the primitive.
# ---------------------------------------------------------------------------------------------------------------------

TABLE = jnp.arange(16, dtype=F32)
FORWARD_UNSUPPORTED = {
    "cumsum": (lambda s, b, h, q, k: s + jnp.cumsum(TABLE)[3], "`cumsum`"),
    "gather": (lambda s, b, h, q, k: s + TABLE[q], "`dynamic_slice`"),
    "bitwise_and": (lambda s, b, h, q, k: s + f(q & k), "bitwise `and`"),
    "atan2": (lambda s, b, h, q, k: jnp.arctan2(s, 1.0), "`atan2`"),
    "reduce": (lambda s, b, h, q, k: s + jnp.sum(jnp.stack([s, s])), "`stack`"),
    "array_arithmetic": (lambda s, b, h, q, k: s + jnp.sum(TABLE * 2.0), "`mul` to a value of shape (16,)"),
}


@pytest.mark.parametrize("case", list(FORWARD_UNSUPPORTED.values()), ids=list(FORWARD_UNSUPPORTED))
def test_forward_unsupported(case):
    fn, needle = case
    reason = lowering.forward_reason(trace(fn))
    assert reason is not None and reason.startswith("cudnn: ") and needle in reason, reason
    assert lowering.backward_reason(trace(fn)) == reason
    with pytest.raises(lowering.LoweringError, match="^cudnn: "):
        emulate(fn)


BACKWARD_UNSUPPORTED = {
    "exp": (lambda s, b, h, q, k: jnp.exp(s), "`exp` applied to the score"),
    "square": (lambda s, b, h, q, k: s * s, "`mul` of two score-dependent values"),
    "integer_pow": (lambda s, b, h, q, k: s**2, "`integer_pow`"),
    "score_condition": (lambda s, b, h, q, k: jnp.where(s > 0, s, 0.0), "`select_n` with a condition on the score"),
    "relu": (lambda s, b, h, q, k: jax.nn.relu(s), "`max`"),
    "abs": (lambda s, b, h, q, k: jnp.abs(s), "`abs`"),
    "divide_by_score": (lambda s, b, h, q, k: 1.0 / (s * s + 1.0), "`div` by a score-dependent value"),
    "silu": (lambda s, b, h, q, k: jax.nn.silu(s), "`mul` of two score-dependent values"),
    "log": (lambda s, b, h, q, k: jnp.log(jnp.abs(s) + 1.0), "`log`"),
    "sin": (lambda s, b, h, q, k: jnp.sin(s) + f(q), "`sin`"),
    "masked_exp": (lambda s, b, h, q, k: jnp.where(q >= k, jnp.exp(s), 0.0), "`exp`"),
    "custom_jvp": (lambda s, b, h, q, k: _custom_softcap(s), "`custom_jvp_call` (the custom derivative rule of"),
    "custom_vjp": (lambda s, b, h, q, k: _vjp_scale(s), "`custom_vjp_call` (the custom derivative rule of"),
}


@pytest.mark.parametrize("case", list(BACKWARD_UNSUPPORTED.values()), ids=list(BACKWARD_UNSUPPORTED))
def test_backward_unsupported(case):
    fn, needle = case
    jaxpr = trace(fn)
    assert lowering.forward_reason(jaxpr) is None
    reason = lowering.backward_reason(jaxpr)
    assert reason is not None and reason.startswith("cudnn: the gradient of ") and needle in reason, reason
    assert "score_mod_bprop" in reason
    with pytest.raises(lowering.LoweringError, match="score_mod_bprop"):
        emulate(fn, backward=True)


def test_score_independent_primitives_are_fine_in_the_backward():
    """exp/sin/floor/... of indices or args are recomputed in the bprop: only the score path is restricted."""
    fn = lambda s, b, h, q, k: s * jnp.exp(-f(jnp.abs(q - k)) / 4.0) + jnp.sin(f(k)) * jnp.floor(f(q) / 2.0)
    check(fn)


def test_output_independent_of_the_score():
    fn = lambda s, b, h, q, k: f(q - k) * 0.5
    check(fn)


def test_signature_errors():
    assert "scalars" in lowering.forward_reason(jax.make_jaxpr(lambda s: s)(jnp.zeros((), F32)))
    with pytest.raises(ValueError, match="`args` must hold 1"):
        lowering.emit_forward(lowering.NumpyOps(), trace(lambda s, b, h, q, k, c: s * c, 1), SCORE, None, [], {})


# ---------------------------------------------------------------------------------------------------------------------
# Structure: the forms cuDNN 9.19 builds.
# ---------------------------------------------------------------------------------------------------------------------


class _T:
    """A recorded tensor: its value, who made it, from what."""

    def __init__(self, value, kind, op="", inputs=(), phase=""):
        self.value, self.kind, self.op, self.inputs, self.phase = value, kind, op, tuple(inputs), phase


class RecordingOps:
    """NumpyOps that records every op and asserts cuDNN's invariants as they happen."""

    def __init__(self):
        self.np = lowering.NumpyOps()
        self.phase = "forward"
        self.made: dict[str, list[_T]] = {"forward": [], "backward": []}
        self.forward_results: set[int] = set()

    def _record(self, t):
        self.made[self.phase].append(t)
        return t

    def _numeric(self, *xs):
        for x in xs:
            if isinstance(x, _T):
                assert x.kind != "bool", f"a compare result is used in `{x.op}`-consuming arithmetic"
                if self.phase == "backward":
                    assert id(x) not in self.forward_results, "a forward tensor is read in the bprop"
                assert x.op != "const-select", "a select with a constant input feeds arithmetic"

    @staticmethod
    def _v(x):
        return x.value if isinstance(x, _T) else x

    def constant(self, value):
        return _T(self.np.constant(value), "const", "const")

    def binary(self, op, a, b):
        self._numeric(a, b)
        return self._record(_T(self.np.binary(op, self._v(a), self._v(b)), "float", op, (a, b), self.phase))

    def unary(self, op, x):
        self._numeric(x)
        return self._record(_T(self.np.unary(op, self._v(x)), "float", op, (x,), self.phase))

    def compare(self, op, a, b):
        self._numeric(a, b)
        return self._record(_T(self.np.compare(op, self._v(a), self._v(b)), "bool", op, (a, b), self.phase))

    def select(self, if_true, if_false, mask):
        assert isinstance(mask, _T) and mask.kind == "bool", "a select mask must be a compare result"
        for x in (if_true, if_false):
            assert not (isinstance(x, _T) and x.kind == "bool")
            if self.phase == "backward":
                assert not (isinstance(x, _T) and id(x) in self.forward_results)
        # cuDNN 9.19 reads select(x, constant, mask) as a mask and skips what it masks: a constant is only ever
        # input1, a masked score (forward) or a zero (bprop), and such a select only feeds selects or the result.
        assert not (isinstance(if_true, _T) and if_true.kind == "const"), "a constant select input must be input1"
        constant = isinstance(if_false, _T) and if_false.kind == "const"
        if constant and self.phase == "forward":
            assert float(if_false.value) <= -1e29, "a forward select keeps only a masking constant"
        if constant and self.phase == "backward":
            assert float(if_false.value) == 0.0
        value = self.np.select(self._v(if_true), self._v(if_false), self._v(mask))
        op = "const-select" if constant else "select"
        return self._record(_T(value, "select", op, (if_true, if_false, mask), self.phase))

    def index(self, like, axis):
        assert not (isinstance(like, _T) and like.kind == "bool")
        return self._record(_T(self.np.index(self._v(like), axis), "index", f"index{axis}", (like,), self.phase))

    def backward(self, op, loss, input):
        self._numeric(loss)
        assert isinstance(input, _T) and id(input) in self.forward_results, "bprop input must be a forward tensor"
        return self._record(_T(self.np.backward(op, self._v(loss), self._v(input)), "float", op, (loss,), self.phase))

    def assert_no_dangling(self, phase, out):
        reached, stack = set(), [out]
        while stack:
            t = stack.pop()
            if isinstance(t, _T) and id(t) not in reached:
                reached.add(id(t))
                stack.extend(t.inputs)
        dangling = [t.op for t in self.made[phase] if id(t) not in reached]
        assert not dangling, f"{phase} computes tensors that do not reach its result: {dangling}"


STRUCTURE_CASES = {**BOTH, **{k: v for k, v in FORWARD_ONLY.items()}}


@pytest.mark.parametrize("fn", list(STRUCTURE_CASES.values()), ids=list(STRUCTURE_CASES))
def test_structure(fn):
    ops = RecordingOps()
    jaxpr = trace(fn)
    store: dict = {}
    out = lowering.emit_forward(ops, jaxpr, SCORE, lambda: GRIDS, [], store)
    assert isinstance(out, _T) and out.kind != "bool"
    ops.assert_no_dangling("forward", out)
    assert_scores_close(out.value, reference(fn), 1e-5, 1e-4)
    if lowering.backward_reason(jaxpr) is not None:
        return
    ops.forward_results = {id(t) for t in ops.made["forward"]} | {id(t) for t in store.values()}
    ops.phase = "backward"
    grad = lowering.emit_backward(ops, jaxpr, D_SCORE, lambda: GRIDS, [], store)
    assert isinstance(grad, _T) and grad.kind != "bool"
    ops.assert_no_dangling("backward", grad)
    np.testing.assert_allclose(np.broadcast_to(grad.value, SCORE.shape), reference_grad(fn), rtol=2e-5, atol=2e-5)


def test_masks_are_nested_selects():
    """`(q >= k) & (k > q - 3)` is two nested selects in both directions, with one compare each."""
    ops = RecordingOps()
    jaxpr = trace(BOTH["sliding_window"])
    store: dict = {}
    lowering.emit_forward(ops, jaxpr, SCORE, lambda: GRIDS, [], store)
    ops.forward_results = {id(t) for t in ops.made["forward"]}
    ops.phase = "backward"
    lowering.emit_backward(ops, jaxpr, D_SCORE, lambda: GRIDS, [], store)
    for phase in ("forward", "backward"):
        kinds = sorted(t.kind for t in ops.made[phase])
        assert kinds.count("select") == 2 and kinds.count("bool") == 2, (phase, kinds)


def test_document_mask_is_one_select():
    """`q // 4 == k // 4` lowers select-free to floor((x + 0.5) / 4) per side, then one compare and one select."""
    ops = RecordingOps()
    lowering.emit_forward(ops, trace(BOTH["document"]), SCORE, lambda: GRIDS, [], {})
    made = ops.made["forward"]
    assert [t.kind for t in made].count("select") == 1
    assert [t.kind for t in made].count("bool") == 1


def _both_phases(fn):
    """RecordingOps after emitting `fn`'s forward and backward."""
    ops = RecordingOps()
    jaxpr = trace(fn)
    store: dict = {}
    lowering.emit_forward(ops, jaxpr, SCORE, lambda: GRIDS, [], store)
    ops.forward_results = {id(t) for t in ops.made["forward"]} | {id(t) for t in store.values()}
    ops.phase = "backward"
    lowering.emit_backward(ops, jaxpr, D_SCORE, lambda: GRIDS, [], store)
    return ops


@pytest.mark.parametrize("name,merge", [("prefix_lm", "max"), ("or_shared_left", "min"), ("prefix_lm_strict", "max")])
def test_two_bounds_of_one_position_are_one_select(name, merge):
    """`(k <= q) | (k < 3)` is `max(q, 2) >= k`: one compare, one select (two nested selects of an `or` run 4.5x
    slower than full attention on cuDNN 9.19)."""
    ops = _both_phases(BOTH[name])
    for phase in ("forward", "backward"):
        made = ops.made[phase]
        assert [t.kind for t in made].count("select") == 1, phase
        assert [t.kind for t in made].count("bool") == 1, phase
        assert merge in [t.op for t in made], phase


@pytest.mark.parametrize("name", ["or_mixed_not_integral", "and_shared_right_mixed", "and_shared_left_mixed"])
def test_bounds_merge_only_when_exact_and_plain(name):
    """`>` and `>=` merge only on integer values (`0.5 q >= k | 0.5 q > 2` stays two selects), and only into a plain
    bound (`min(q, q - 3) >= k` is not one: unmeasured on the GPU)."""
    ops = _both_phases(BOTH[name])
    assert [t.kind for t in ops.made["forward"]].count("select") == 2


@pytest.mark.parametrize("name", ["softcap_then_causal", "causal", "prefix_lm", "logistic_masked", "jit_helper"])
def test_masking_selects_read_positions_of_their_input(name):
    """A select that masks (keeps a constant input1) with a plain bound compares `gen_index` of its own input0,
    never of the raw score, as `row >= col`-style `ge`/`gt` (cuDNN 9.19 skips masked tiles only in that form)."""
    ops = _both_phases(BOTH[name])
    for phase in ("forward", "backward"):
        masking = [t for t in ops.made[phase] if t.op == "const-select"]
        assert masking, phase
        for select in masking:
            kept, _, mask = select.inputs
            assert mask.op in ("ge", "gt"), (phase, mask.op)
            stack, positions = list(mask.inputs), []
            while stack:
                t = stack.pop()
                if isinstance(t, _T):
                    positions += [t] if t.kind == "index" else []
                    stack.extend(t.inputs if t.kind != "index" else ())
            assert positions and all(p.inputs[0] is kept for p in positions), phase


@pytest.mark.parametrize("name", ["causal_offset", "sliding_window", "window_softcap_alibi", "document"])
def test_other_masks_read_positions_of_the_score(name):
    """`row + c >= col`, `c > row - col`, ... with the select's own positions gave wrong results on the H200: a
    graph with such a mask reads every position from the raw score (through `indices`), in both callbacks."""
    ops = _both_phases(BOTH[name])
    for phase in ("forward", "backward"):
        assert not [t for t in ops.made[phase] if t.kind == "index"], phase


def test_plain_bounds_are_canonical_and_others_as_written():
    """With own positions a compare is `>=` / `>` with any constant second (`k <= q` as `q >= k`, `3 <= q` as
    `q >= 3`); a graph with another mask keeps each compare as written (`k <= q + 2` stays `le`)."""
    for fn, expected in (
        (lambda s, b, h, q, k: jnp.where(k <= q, s, NEG_INF), "ge"),
        (lambda s, b, h, q, k: jnp.where(3 <= q, s, NEG_INF), "ge"),
        (lambda s, b, h, q, k: jnp.where(k <= q + 2, s, NEG_INF), "le"),
    ):
        ops = RecordingOps()
        lowering.emit_forward(ops, trace(fn), SCORE, lambda: GRIDS, [], {})
        (compare,) = [t for t in ops.made["forward"] if t.kind == "bool"]
        assert compare.op == expected
        assert not (isinstance(compare.inputs[0], _T) and compare.inputs[0].kind == "const")


def test_softcap_backward_reads_the_stored_tensor_through_tanh_backward():
    ops = RecordingOps()
    jaxpr = trace(BOTH["softcap_then_causal"])
    store: dict = {}
    lowering.emit_forward(ops, jaxpr, SCORE, lambda: GRIDS, [], store)
    ops.forward_results = {id(t) for t in ops.made["forward"]}
    ops.phase = "backward"
    lowering.emit_backward(ops, jaxpr, D_SCORE, lambda: GRIDS, [], store)
    ops_made = [(t.kind, t.op) for t in ops.made["backward"]]
    # one tanh_backward (recorded as op "tanh"), no recomputed tanh: RecordingOps.unary would have seen it
    assert ops_made.count(("float", "tanh")) == 1


def _recorded(fn):
    ops = RecordingOps()
    jaxpr = trace(fn)
    store: dict = {}
    lowering.emit_forward(ops, jaxpr, SCORE, lambda: GRIDS, [], store)
    ops.forward_results = {id(t) for t in ops.made["forward"]}
    ops.phase = "backward"
    lowering.emit_backward(ops, jaxpr, D_SCORE, lambda: GRIDS, [], store)
    return {phase: [t.op for t in ops.made[phase]] for phase in ops.made}


@pytest.mark.parametrize(
    "name, forward_constant, backward_constant",
    [
        ("causal", True, True),  # the mask: cuDNN may skip what it masks, in both directions
        ("sliding_window", True, True),
        ("xor_mask", True, True),
        ("causal_then_softcap", False, False),  # masked scores become -5: a computed S*0 - 1e30 branch
        ("multiplicative_mask", False, False),  # masked scores are 0, not masked: dS*0 in the bprop
        ("two_wheres", False, False),
    ],
)
def test_constant_select_inputs_only_where_the_output_is_masked(name, forward_constant, backward_constant):
    ops = _recorded(BOTH[name])
    assert ("const-select" in ops["forward"]) == forward_constant
    assert ("const-select" in ops["backward"]) == backward_constant


def test_backward_without_forward_store_fails_clearly():
    jaxpr = trace(softcap)
    with pytest.raises(lowering.LoweringError, match="emit_forward"):
        lowering.emit_backward(lowering.NumpyOps(), jaxpr, D_SCORE, lambda: GRIDS, [], {})


def test_indices_not_called_without_index_use():
    def indices():
        raise AssertionError("indices() called")

    lowering.emit_forward(lowering.NumpyOps(), trace(softcap), SCORE, indices, [], {})


def test_infinities_become_big_finite_constants():
    ops = lowering.NumpyOps()
    assert ops.constant(-math.inf) == np.float32(-1e30) and ops.constant(math.inf) == np.float32(1e30)
    out, _ = emulate(causal)
    assert np.isfinite(out).all() and out.min() == np.float32(-1e30)


# ---------------------------------------------------------------------------------------------------------------------
# CudnnOps: dispatch onto a cuDNN pygraph.
# ---------------------------------------------------------------------------------------------------------------------


class FakeTensor:
    def __init__(self, name, kwargs):
        self.name, self.kwargs, self.data_type = name, kwargs, None

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class FakeGraph:
    def __init__(self):
        self.calls = []

    def tensor_scalar(self, value, scalar_type):
        self.calls.append(("tensor_scalar", (value, scalar_type)))
        return FakeTensor("scalar", {"value": value})

    def __getattr__(self, name):
        def op(**kwargs):
            self.calls.append((name, kwargs))
            return FakeTensor(name, kwargs)

        return op


def test_cudnn_ops_dispatch():
    cudnn = pytest.importorskip("cudnn")
    F, BOOL = cudnn.data_type.FLOAT, cudnn.data_type.BOOLEAN
    g = FakeGraph()
    ops = lowering.CudnnOps(g)
    x, y = FakeTensor("x", {}), FakeTensor("y", {})
    c = ops.constant(-math.inf)
    assert g.calls == [("tensor_scalar", (float(np.float32(-1e30)), cudnn.scalar_type.RUNTIME_PARAM))]
    assert ops.constant(float("-inf")) is c and lowering.CudnnOps(g).constant(-1e30) is c  # one per value and graph
    for op in ("add", "sub", "mul", "div"):
        t = ops.binary(op, x, y)
        assert g.calls[-1] == (op, {"a": x, "b": y, "compute_data_type": F}) and t.data_type == F
    for op in ("max", "min", "pow", "mod"):
        t = ops.binary(op, x, y)
        assert g.calls[-1] == (op, {"input0": x, "input1": y, "compute_data_type": F}) and t.data_type == F
    for op in lowering.UNARY_OPS:
        t = ops.unary(op, x)
        assert g.calls[-1] == (op, {"input": x, "compute_data_type": F}) and t.data_type == F
    for op in lowering.COMPARE_OPS:
        m = ops.compare(op, x, y)
        assert g.calls[-1] == (f"cmp_{op}", {"input": x, "comparison": y, "compute_data_type": F})
        assert m.data_type == BOOL
    t = ops.select(x, y, m)
    assert g.calls[-1] == ("binary_select", {"input0": x, "input1": y, "mask": m, "compute_data_type": F})
    assert t.data_type == F
    for op in ("tanh", "sigmoid"):
        t = ops.backward(op, x, y)
        assert g.calls[-1] == (f"{op}_backward", {"loss": x, "input": y, "compute_data_type": F})
        assert t.data_type == F


def test_cudnn_ops_on_the_frontend_graph_ir():
    """The real pygraph accepts every call (defining ops needs no GPU; building does)."""
    cudnn = pytest.importorskip("cudnn")
    graph = cudnn.pygraph(
        io_data_type=cudnn.data_type.BFLOAT16,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )
    score = graph.tensor(name="s", dim=[1, 1, 4, 4], stride=[16, 16, 4, 1], data_type=cudnn.data_type.FLOAT)
    d_score = graph.tensor(name="ds", dim=[1, 1, 4, 4], stride=[16, 16, 4, 1], data_type=cudnn.data_type.FLOAT)
    slope = graph.tensor(name="slope", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)

    def indices(like):
        def make():
            made = []
            for axis in range(4):
                t = graph.gen_index(input=like, axis=axis)
                t.set_data_type(cudnn.data_type.INT32)
                made.append(t)
            return made

        return make

    fn = lambda s, b, h, q, k, c: jnp.where(
        (q // 4 == k // 4) & (q >= k), 5.0 * jnp.tanh(s / 5.0) - c * f(q - k) + jax.nn.sigmoid(s), NEG_INF
    )
    jaxpr = trace(fn, 1)
    store: dict = {}
    ops = lowering.CudnnOps(graph)
    out = lowering.emit_forward(ops, jaxpr, score, indices(score), [slope], store)
    grad = lowering.emit_backward(lowering.CudnnOps(graph), jaxpr, d_score, indices(d_score), [slope], store)
    assert out.data_type == cudnn.data_type.FLOAT and grad.data_type == cudnn.data_type.FLOAT
