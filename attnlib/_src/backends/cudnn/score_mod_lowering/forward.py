"""Forward rules: each flat jaxpr equation -> IR values (`Lowering`)."""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .flat import Eqn, Flat, Lit
from .ir import Builder, FALSE, Node, Pred, TRUE
from .ops import LoweringError


_UNARY_PRIMS = {
    "neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid", "sin": "sin",
    "cos": "cos", "tan": "tan", "sqrt": "sqrt", "rsqrt": "rsqrt", "floor": "floor", "ceil": "ceil", "erf": "erf",
}  # fmt: skip
_BINARY_PRIMS = {"add": "add", "sub": "sub", "mul": "mul", "max": "max", "min": "min", "pow": "pow"}
_COMPARE_PRIMS = {"eq": "eq", "ne": "neq", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
PASS_PRIMS = {
    "_alias", "copy", "copy_p", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient",
    "optimization_barrier",
}  # fmt: skip
_OTHER_PRIMS = {
    "div", "rem", "sign", "integer_pow", "square", "exp2", "log1p", "expm1", "clamp", "select_n", "and", "or",
    "not", "xor", "convert_element_type", "reduce_precision", "round", "_int_floor_divide", "_int_remainder",
}  # fmt: skip
SUPPORTED_FORWARD = frozenset(_UNARY_PRIMS) | set(_BINARY_PRIMS) | set(_COMPARE_PRIMS) | PASS_PRIMS | _OTHER_PRIMS
"""JAX primitives `emit_forward` lowers (after inlining `jit`, `custom_jvp_call`, ...)."""

_DECLINED = {
    "iota": "it builds an array; index a position with the batch/head/q_idx/kv_idx arguments instead",
    "atan2": "the lowering's op vocabulary has no atan2",
}


_LN2 = math.log(2.0)
_SIGN_SCALE = 2.0**100  # x * 2**100 * 2**100 saturates every nonzero float32 (even subnormals) past +-1


class Lowering:
    """The symbolic lowering of one flat jaxpr for given input values."""

    def __init__(self, flat: Flat, b: Builder, inputs: Sequence[Any], *, backward: bool = False):
        self.flat, self.b, self.backward = flat, b, backward
        self.values: dict[Any, Any] = dict(zip(flat.invars, inputs, strict=True))
        for e in flat.eqns:
            outs = self._eqn(e)
            for k, v in zip(e.outs, outs):
                if k is not None:
                    self.values[k] = v
        self.out = self.value(flat.out)

    def value(self, x: Any) -> Any:
        if isinstance(x, Lit):
            if x.value.size != 1:
                raise LoweringError(
                    f"cudnn: score_mod reads an array constant of shape {x.value.shape}, which a pointwise cuDNN "
                    "score_mod cannot index (pass per-head values as score_mod_args instead)."
                )
            v = x.value.reshape(())
            if v.dtype == np.bool_:
                return TRUE if bool(v) else FALSE
            return self.b.const(float(v))
        return self.values[x]

    # ---- helpers
    def _numeric(self, prim: str, v: Any) -> Any:
        if isinstance(v, Pred):
            raise LoweringError(f"cudnn: `{prim}` on booleans is not supported, only and/or/not/xor/select are.")
        return v

    def _pred(self, prim: str, v: Any, kind: str) -> Pred:
        if kind == "bool":
            return v
        return self.b.compare("neq", self._numeric(prim, v), self.b.const(0.0))

    def _sign(self, x: Any, kind: str) -> Any:
        b = self.b
        if kind == "float":
            x = b.binary("mul", b.binary("mul", x, b.const(_SIGN_SCALE)), b.const(_SIGN_SCALE))
        return b.binary("min", b.binary("max", x, b.const(-1.0)), b.const(1.0))

    def _trunc(self, x: Any) -> Any:
        """float -> int: floor(|x|) * clamp(x, -1, 1) (the clamp is +-1 wherever floor(|x|) != 0)."""
        b = self.b
        return b.binary("mul", b.unary("floor", b.unary("abs", x)), self._sign(x, "int"))

    def _round(self, x: Any, method: int) -> Any:
        """lax.round, exactly: with r = floor(|x|) and f = |x| - r (exact), |x| rounds half away from zero to
        r + floor(2 f) (2 f is exact); to nearest even (method 1), a tie f == 1/2 rounds to r + (r mod 2) instead
        (one select on a float condition)."""
        b = self.b
        ax = b.unary("abs", x)
        r = b.unary("floor", ax)
        f = b.binary("sub", ax, r)
        away = b.binary("add", r, b.unary("floor", b.binary("mul", f, b.const(2.0))))
        if method == 1:
            odd = b.binary("sub", r, b.binary("mul", b.unary("floor", b.binary("mul", r, b.const(0.5))), b.const(2.0)))
            away = b.sel(b.compare("eq", f, b.const(0.5)), b.binary("add", r, odd), away)
        return b.binary("mul", away, self._sign(x, "float"))

    def _int_div(self, a: Any, c: Any) -> Any:
        """lax.div on integers (towards zero): floor((|a| + 1/2) / |c|) * sign(a) * sign(c). The 1/2 keeps the
        quotient at least 1/(2|c|) away from an integer, so an inexact division floors right for |a| < 2**21."""
        b = self.b
        q = b.unary("floor", b.binary("div", b.binary("add", b.unary("abs", a), b.const(0.5)), b.unary("abs", c)))
        return b.binary("mul", b.binary("mul", q, self._sign(a, "int")), self._sign(c, "int"))

    def _int_floor_divide(self, a: Any, c: Any) -> Any:
        """jnp.floor_divide on integers: floor((a + sign(c)/2) / c), exact for |a| < 2**21 (see `_int_div`)."""
        b = self.b
        half = b.binary("mul", self._sign(c, "int"), b.const(0.5))
        return b.unary("floor", b.binary("div", b.binary("add", a, half), c))

    def _eqn(self, e: Eqn) -> list[Any]:
        prim = e.prim
        if prim not in SUPPORTED_FORWARD:
            why = _DECLINED.get(prim, "which has no cuDNN pointwise lowering")
            raise LoweringError(f"cudnn: score_mod uses `{prim}`, {why}.")
        for aval in e.in_avals + e.out_avals:
            if math.prod(aval.shape) != 1:
                raise LoweringError(
                    f"cudnn: score_mod applies `{prim}` to a value of shape {aval.shape}, but a cuDNN score_mod "
                    "is elementwise: only scalar values are supported."
                )
            if aval.kind not in ("float", "int", "bool"):
                raise LoweringError(
                    f"cudnn: score_mod applies `{prim}` to a {aval.kind} value, which is not supported."
                )
        b = self.b
        args = [self.value(x) for x in e.ins]
        kinds = [a.kind for a in e.in_avals]
        out_kind = e.out_avals[0].kind if e.out_avals else None
        if prim in PASS_PRIMS:
            return args[: len(e.outs)]
        if prim in ("tanh", "logistic"):
            x = self._numeric(prim, args[0])
            if isinstance(x, Node) and x.kind == "input":
                # the backward reads this op's input through tanh_backward/sigmoid_backward: make it a tensor
                # computed inside the modifier, as in the form measured on cuDNN 9.19
                x = b.unary("identity", x)
            return [b.unary(_UNARY_PRIMS[prim], x)]
        if prim in _UNARY_PRIMS:
            return [b.unary(_UNARY_PRIMS[prim], self._numeric(prim, args[0]))]
        if prim in ("max", "min") and out_kind == "bool":
            return [(b.or_ if prim == "max" else b.and_)(args[0], args[1])]
        if prim in _BINARY_PRIMS:
            return [b.binary(_BINARY_PRIMS[prim], self._numeric(prim, args[0]), self._numeric(prim, args[1]))]
        if prim in _COMPARE_PRIMS:
            if kinds[0] == "bool":
                if prim not in ("eq", "ne"):
                    raise LoweringError(f"cudnn: `{prim}` on booleans is not supported, only eq/ne are.")
                x = b.xor(args[0], args[1])
                return [x if prim == "ne" else b.not_(x)]
            return [b.compare(_COMPARE_PRIMS[prim], args[0], args[1])]
        if prim in ("and", "or", "xor", "not"):
            if out_kind != "bool":
                raise LoweringError(
                    f"cudnn: score_mod uses bitwise `{prim}` on integers, which has no cuDNN pointwise lowering."
                )
            if prim == "not":
                return [b.not_(args[0])]
            return [{"and": b.and_, "or": b.or_, "xor": b.xor}[prim](args[0], args[1])]
        if prim == "select_n":
            return [self._select_n(prim, args, kinds[0])]
        x = args[0] if args else None
        if prim == "convert_element_type":
            src, dst = kinds[0], out_kind
            if src == dst or (src == "int" and dst == "float"):
                return [x]
            if dst == "bool":
                return [self._pred(prim, x, src)]
            if src == "bool":
                return [b.sel(x, b.const(1.0), b.const(0.0))]
            return [self._trunc(x)]  # float -> int
        if prim == "reduce_precision":
            if (e.params.get("exponent_bits"), e.params.get("mantissa_bits")) == (8, 23):
                return [x]
            raise LoweringError("cudnn: score_mod uses `reduce_precision` below float32, which cuDNN cannot express.")
        x = self._numeric(prim, x)
        if prim == "div":
            if out_kind == "int":
                return [self._int_div(x, self._numeric(prim, args[1]))]
            return [b.binary("div", x, self._numeric(prim, args[1]))]
        if prim == "rem":
            y = self._numeric(prim, args[1])
            if out_kind == "int":  # exact integer arithmetic, no assumption on cuDNN's mod
                return [b.binary("sub", x, b.binary("mul", y, self._int_div(x, y)))]
            return [b.binary("mod", x, y)]  # cuDNN's mod is C's fmod (sign of x), as lax.rem
        if prim == "_int_floor_divide":
            return [self._int_floor_divide(x, args[1])]
        if prim == "_int_remainder":
            return [b.binary("sub", x, b.binary("mul", args[1], self._int_floor_divide(x, args[1])))]
        if prim == "sign":
            return [self._sign(x, kinds[0])]
        if prim == "round":
            return [self._round(x, int(e.params.get("rounding_method", 0)))]
        if prim == "integer_pow":
            return [self._integer_pow(x, int(e.params["y"]))]
        if prim == "square":
            return [b.binary("mul", x, x)]
        if prim == "exp2":
            return [b.unary("exp", b.binary("mul", x, b.const(_LN2)))]
        if prim == "log1p":
            return [b.unary("log", b.binary("add", b.const(1.0), x))]
        if prim == "expm1":
            return [b.binary("sub", b.unary("exp", x), b.const(1.0))]
        if prim == "clamp":  # lax.clamp(lo, x, hi)
            lo, hi = x, self._numeric(prim, args[2])
            return [b.binary("min", b.binary("max", self._numeric(prim, args[1]), lo), hi)]
        raise AssertionError(prim)

    def _integer_pow(self, x: Any, y: int) -> Any:
        b = self.b
        if y == 0:
            return b.const(1.0)
        n, result, base = abs(y), None, x
        while n:
            if n & 1:
                result = base if result is None else b.binary("mul", result, base)
            n >>= 1
            if n:
                base = b.binary("mul", base, base)
        return b.unary("reciprocal", result) if y < 0 else result

    def _select_n(self, prim: str, args: list[Any], kind: str) -> Any:
        which, cases = args[0], args[1:]
        b = self.b
        if kind == "bool":
            if len(cases) == 1:
                return cases[0]
            if isinstance(cases[0], Pred):
                return b.psel(which, cases[1], cases[0])
            return b.sel(which, cases[1], cases[0])
        out = cases[-1]
        for i in range(len(cases) - 2, -1, -1):
            p = b.compare("eq", which, b.const(float(i)))
            out = b.psel(p, cases[i], out) if isinstance(out, Pred) else b.sel(p, cases[i], out)
        return out
