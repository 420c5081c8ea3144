"""Flattening of a closed jaxpr into one list of live equations (`Flat`), sub-jaxprs inlined."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
import numpy as np

from .ops import LoweringError


@dataclasses.dataclass(frozen=True)
class Lit:
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Aval:
    shape: tuple[int, ...]
    kind: str  # "float", "int", "bool"


@dataclasses.dataclass
class Eqn:
    prim: str
    params: dict
    ins: tuple  # keys or Lit
    outs: tuple  # keys (None for a dropped output)
    in_avals: tuple[_Aval, ...]
    out_avals: tuple[_Aval, ...]


def _aval(a: Any) -> _Aval:
    dtype = np.dtype(a.dtype)
    if dtype == np.bool_:
        kind = "bool"
    elif np.issubdtype(dtype, np.integer):
        kind = "int"
    elif np.issubdtype(dtype, np.floating):
        kind = "float"
    else:
        kind = str(dtype)
    return _Aval(tuple(a.shape), kind)


_INLINE = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"}
_FAST_JIT = {"floor_divide": "_int_floor_divide", "remainder": "_int_remainder"}


def _sub_jaxpr(eqn: Any) -> tuple[Any, list[Any]]:
    sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(sub, jex.ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    return sub, []


def _function_name(eqn: Any, sub: Any) -> str:
    if "name" in eqn.params:
        return str(eqn.params["name"])
    info = getattr(sub, "debug_info", None)
    src = getattr(info, "func_src_info", None) or "?"
    return src.split(" at ")[0]


@dataclasses.dataclass
class Flat:
    invars: tuple  # keys
    out: Any  # key or Lit
    out_aval: _Aval
    eqns: list[Eqn]


def flatten(closed: Any) -> Flat:
    eqns: list[Eqn] = []

    def atom(env: dict, x: Any) -> Any:
        if isinstance(x, jex.Literal):
            return Lit(np.asarray(x.val))
        return env[x]

    def walk(jaxpr: Any, consts: Sequence[Any], path: tuple, env: dict) -> None:
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = Lit(np.asarray(c))
        for i, e in enumerate(jaxpr.eqns):
            ins = tuple(atom(env, x) for x in e.invars)
            in_avals = tuple(_aval(x.aval) for x in e.invars)
            out_avals = tuple(_aval(x.aval) for x in e.outvars)
            outs = tuple(None if isinstance(v, jex.DropVar) else (v if not path else (path, v)) for v in e.outvars)
            for v, k in zip(e.outvars, outs):
                if k is not None:
                    env[v] = k
            name = e.primitive.name
            fast = _FAST_JIT.get(e.params.get("name", "")) if name in ("jit", "pjit") else None
            if fast and len(ins) == 2 and len(outs) == 1 and all(a.kind == "int" for a in in_avals + out_avals):
                eqns.append(Eqn(fast, {}, ins, outs, in_avals, out_avals))
            elif name in _INLINE:
                sub, sub_consts = _sub_jaxpr(e)
                sub_env = dict(zip(sub.invars, ins, strict=True))
                walk(sub, sub_consts, path + (i,), sub_env)
                # The backward differentiates primitives only: it refuses a custom rule's outputs on the score path.
                custom = {"custom": (name, _function_name(e, sub))} if name.startswith("custom_") else {}
                for k, inner, aval in zip(outs, sub.outvars, out_avals):
                    if k is not None:
                        eqns.append(Eqn("_alias", custom, (atom(sub_env, inner),), (k,), (aval,), (aval,)))
            else:
                eqns.append(Eqn(name, dict(e.params), ins, outs, in_avals, out_avals))

    jaxpr = closed.jaxpr
    if len(jaxpr.outvars) != 1:
        raise LoweringError(f"cudnn: score_mod must return one value, it returns {len(jaxpr.outvars)}.")
    env = {v: v for v in jaxpr.invars}
    walk(jaxpr, closed.consts, (), env)
    out = atom(env, jaxpr.outvars[0])
    out_aval = _aval(jaxpr.outvars[0].aval)
    if out_aval.kind != "float" or math.prod(out_aval.shape) != 1:
        raise LoweringError(
            f"cudnn: score_mod must return a float scalar, it returns {out_aval.kind}{list(out_aval.shape)}."
        )
    # Only the equations the result depends on.
    live = {out} if not isinstance(out, Lit) else set()
    kept = []
    for e in reversed(eqns):
        if any(k in live for k in e.outs if k is not None):
            kept.append(e)
            live.update(x for x in e.ins if not isinstance(x, Lit))
    kept.reverse()
    return Flat(tuple(jaxpr.invars), out, out_aval, kept)
