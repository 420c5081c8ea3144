"""`score_mod` / `mask_mod` evaluated over a whole block inside a Pallas kernel.

`modifiers.describe` traced each function once on scalars (`jax.make_jaxpr`). Inside the kernel the jaxpr is
evaluated equation by equation on arrays of one block shape (`[rows, block_k]`): every input (the score, the index
blocks, the `score_mod_args` blocks, the closed-over scalars and the literals) is broadcast to that shape first, so
each elementwise primitive binds on operands of one shape and computes what the scalar function computes, element by
element. Nested calls (`jit`, `custom_jvp_call`, `custom_vjp_call`) are evaluated through their inner jaxprs; the
shape-only primitives a scalar trace leaves behind (`broadcast_in_dim` / `reshape` to `()`, reductions over no axis)
are identities. Anything else (a gather from a closed-over table, a loop) is not elementwise: `unsupported` names it
at dispatch, and the call runs elsewhere.

The backward differentiates the same evaluation with `jax.vjp` inside the kernel: the transposes of elementwise
primitives are elementwise too.
"""

from collections.abc import Callable, Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np


ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "clamp",
    "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "sub",
    "tan", "tanh", "xor", "stop_gradient",
})  # fmt: skip
"""Primitives that act element by element on operands of one shape."""

SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "reduce_max", "reduce_min", "reduce_sum",
                        "reduce_and", "reduce_or", "expand_dims"})  # fmt: skip
"""Primitives a scalar trace emits only as identities (to shape `()`, over no axis)."""

_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _inner(eqn) -> jex.ClosedJaxpr | jex.Jaxpr | None:
    for name in _CALL_PARAMS:
        inner = eqn.params.get(name)
        if inner is not None and hasattr(inner, "eqns" if isinstance(inner, jex.Jaxpr) else "jaxpr"):
            return inner
    return None


def unsupported(closed: jex.ClosedJaxpr | None) -> str | None:
    """The name of the first primitive of `closed` that cannot run over a block (or a closed-over array that is
    not a scalar), or None when all of it can."""
    if closed is None:
        return None
    for c in closed.consts:
        if np.ndim(c) != 0:
            return f"a closed-over array of shape {tuple(np.shape(c))}"
    return _unsupported_in(closed.jaxpr)


def _unsupported_in(jaxpr: jex.Jaxpr) -> str | None:
    for v in jaxpr.invars:
        if np.dtype(v.aval.dtype).itemsize == 8:
            return f"64-bit values ({v.aval.dtype} inputs, traced under `jax_enable_x64`)"
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        wide = [v.aval.dtype for v in eqn.outvars if np.dtype(v.aval.dtype).itemsize == 8]
        if wide:
            return f"64-bit values (`{name}` gives {wide[0]})"
        inner = _inner(eqn)
        if inner is not None:
            found = _unsupported_in(inner.jaxpr if isinstance(inner, jex.ClosedJaxpr) else inner)
            if found is not None:
                return found
            if isinstance(inner, jex.ClosedJaxpr) and any(np.ndim(c) != 0 for c in inner.consts):
                return f"`{name}` closing over an array"
            continue
        if name in ELEMENTWISE:
            continue
        if name in SHAPE_ONLY and all(v.aval.shape == () for v in eqn.outvars):
            continue
        return f"`{name}`"
    return None


def reads(closed: jex.ClosedJaxpr, index: int) -> bool:
    """Whether input `index` of `closed` is used by any equation (or returned)."""
    var = closed.jaxpr.invars[index]
    used = {id(v) for e in closed.jaxpr.eqns for v in e.invars if not isinstance(v, jex.Literal)}
    used |= {id(v) for v in closed.jaxpr.outvars if not isinstance(v, jex.Literal)}
    return id(var) in used


def evaluate(closed: jex.ClosedJaxpr, consts: Sequence, args: Sequence[jax.Array], shape) -> jax.Array:
    """The single output of `closed` applied element by element to `args` broadcast to `shape`."""
    full = lambda x: jnp.broadcast_to(jnp.asarray(x), shape)
    return _eval(closed.jaxpr, [full(c) for c in consts], [full(a) for a in args], full)[0]


def _eval(jaxpr: jex.Jaxpr, consts, args, full: Callable) -> list:
    env: dict = {}

    def read(v):
        if isinstance(v, jex.Literal):
            return full(jnp.asarray(v.val, v.aval.dtype))
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = _inner(eqn)
        name = eqn.primitive.name
        if inner is not None:
            if isinstance(inner, jex.ClosedJaxpr):
                outs = _eval(inner.jaxpr, [full(c) for c in inner.consts], invals, full)
            else:
                n = len(inner.constvars)
                outs = _eval(inner, invals[:n], invals[n:], full)
        elif name in SHAPE_ONLY:
            outs = [invals[0]]
        elif name == "stop_gradient":
            outs = [jax.lax.stop_gradient(invals[0])]
        else:
            result = eqn.primitive.bind(*invals, **eqn.params)
            outs = list(result) if eqn.primitive.multiple_results else [result]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]
