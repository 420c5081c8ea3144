"""Backward: reverse-mode AD over the flat equations, cotangents as lazy select trees (`Backward`)."""

from collections.abc import Callable
from typing import Any

from .flat import Eqn, Flat, Lit
from .forward import Lowering, PASS_PRIMS
from .ir import leaves, MAX_LEAVES, Node, Pred, Sel
from .ops import LoweringError


_BPROP_LIMIT = "cuDNN 9.19's score_mod_bprop (it can only read forward values through tanh_backward/sigmoid_backward)"


def input_key(out_key: Any) -> tuple[str, Any]:
    """The store key of the tensor a forward tanh / logistic read (its backward op's `input=`)."""
    return ("input", out_key)


_MASKED_ZERO = object()
MASKED_ZERO_INDEX = "masked"
MASKED_BELOW = -1e29
"""A constant at or below this is a masked score (the forward's -inf / -1e30)."""


def _is_zero(g: Any) -> bool:
    return g is None or g is _MASKED_ZERO


def _masking_selects(lo: "Lowering") -> dict[int, int]:
    """The `select_n` equations on the output's select chain (reached from the output through pass-through ops and
    select cases only) with a case that is a constant <= -1e29: `id(eqn) -> that case`. Where such a select picks
    its constant, the forward output is a masked score."""
    flat = lo.flat
    chain = {flat.out}
    found: dict[int, int] = {}
    for e in reversed(flat.eqns):
        if not e.outs or e.outs[0] not in chain:
            continue
        if e.prim in PASS_PRIMS or (e.prim == "convert_element_type" and e.in_avals[0].kind == "float"):
            chain.update(x for x in e.ins[:1] if not isinstance(x, Lit))
        elif e.prim == "select_n" and e.in_avals[0].kind == "bool" and len(e.ins) == 3:
            for i, case in enumerate(e.ins[1:]):
                v = lo.value(case)
                if isinstance(v, Node) and v.is_const and v.value <= MASKED_BELOW:
                    found[id(e)] = i
                elif not isinstance(case, Lit):
                    chain.add(case)
    return found


def _depends(flat: Flat) -> set[Any]:
    dep = {flat.invars[0]}
    for e in flat.eqns:
        if any(not isinstance(x, Lit) and x in dep for x in e.ins):
            dep.update(k for k in e.outs if k is not None)
    return dep


def _unsupported_grad(prim: str, detail: str = "applied to the score") -> LoweringError:
    return LoweringError(f"cudnn: the gradient of `{prim}` {detail} cannot be expressed in {_BPROP_LIMIT}.")


class Backward:
    """Cotangent propagation. `lo` is the symbolic forward recomputed for the bprop (score-independent values only
    are read from it, as fresh ops)."""

    _LINEAR_PASS = PASS_PRIMS - {"stop_gradient"}

    def __init__(self, lo: Lowering, d_score: Node):
        self.lo, self.b = lo, lo.b
        flat = lo.flat
        self.dep = _depends(flat)
        self.masking = _masking_selects(lo)
        self.custom: LoweringError | None = None
        ct: dict[Any, Any] = {}
        if not isinstance(flat.out, Lit) and flat.out in self.dep:
            ct[flat.out] = d_score
        for e in reversed(flat.eqns):
            outs = [ct.pop(k, None) if k is not None else None for k in e.outs]
            if all(_is_zero(g) for g in outs):
                continue
            for x, g in self._eqn(e, outs):
                if not _is_zero(g) and not isinstance(x, Lit) and x in self.dep:
                    ct[x] = self.add(ct.get(x), g)
        if self.custom is not None:
            raise self.custom
        result = ct.get(flat.invars[0])
        if _is_zero(result):  # the output does not depend on the score: a zero gradient, still a computed tensor
            self.out = self.b.binary("mul", d_score, self.b.const(0.0))
        else:
            self.out = self.materialize(result)

    # ---- cotangent algebra. Zeros are symbolic: None, or _MASKED_ZERO where the forward output is masked (a
    # select to <= -1e29 on the output's select chain), the only zeros emitted as a constant select input.
    def sel(self, pred: Pred, t: Any, f: Any) -> Any:
        if pred.kind == "lit":
            return t if pred.value else f
        if t is f:
            return t
        if _is_zero(t) and _is_zero(f):
            return _MASKED_ZERO if _MASKED_ZERO in (t, f) else None
        return Sel(pred, t, f)

    def map(self, fn: Callable[[Node], Any], g: Any) -> Any:
        if _is_zero(g):
            return g
        if isinstance(g, Sel):
            return self.sel(g.pred, self.map(fn, g.if_true), self.map(fn, g.if_false))
        return fn(g)

    def add(self, g: Any, h: Any) -> Any:
        if _is_zero(g) and _is_zero(h):
            return _MASKED_ZERO if _MASKED_ZERO in (g, h) else None
        if _is_zero(g):
            return h
        if _is_zero(h):
            return g
        if leaves(g) * leaves(h) > MAX_LEAVES:
            return self.b.binary("add", self.materialize(g), self.materialize(h))
        if isinstance(g, Sel) and isinstance(h, Sel) and g.pred is h.pred:
            return self.sel(g.pred, self.add(g.if_true, h.if_true), self.add(g.if_false, h.if_false))
        if isinstance(g, Sel):
            return self.sel(g.pred, self.add(g.if_true, h), self.add(g.if_false, h))
        if isinstance(h, Sel):
            return self.sel(h.pred, self.add(g, h.if_true), self.add(g, h.if_false))
        return self.b.binary("add", g, h)

    def scale(self, g: Any, op: str, v: Any) -> Any:
        """`g * v` or `g / v` for a score-independent value `v` (a node or a lazy select of constants)."""
        if _is_zero(g):
            return g
        if isinstance(v, Sel):
            return self.sel(v.pred, self.scale(g, op, v.if_true), self.scale(g, op, v.if_false))
        if op == "mul" and v.is_const and v.value == 0.0:
            return None
        return self.map(lambda x: self.b.binary(op, x, v), g)

    def materialize(self, g: Any) -> Node:
        if g is None:
            return self.b.const(0.0)
        if g is _MASKED_ZERO:
            return self.b._node("const", value=0.0, index=MASKED_ZERO_INDEX)
        if isinstance(g, Sel):
            return self.b.select(g.pred, self.materialize(g.if_true), self.materialize(g.if_false))
        return g

    # ---- rules
    def indep(self, prim: str, x: Any, detail: str) -> Any:
        if not isinstance(x, Lit) and x in self.dep:
            raise _unsupported_grad(prim, detail)
        v = self.lo.value(x)
        if isinstance(v, Pred):
            raise LoweringError(f"cudnn: `{prim}` on booleans is not supported.")
        return v

    def stored_input(self, e: Eqn, op: str) -> Node:
        """The `input=` of the backward op of `e` (tanh / logistic): the tensor the forward op read (kept in the
        store under `("input", out_key)`), or a constant when the forward folded it."""
        fwd = self.lo.values[e.outs[0]]
        if isinstance(fwd, Node) and fwd.kind == "unary" and fwd.op == op:
            return self.b.stored(input_key(e.outs[0]))
        x = self.lo.value(e.ins[0])
        if isinstance(x, Node) and x.is_const:
            return x
        raise _unsupported_grad(e.prim, "of a value selected by a condition on the score")

    def _eqn(self, e: Eqn, outs: list[Any]) -> list[tuple[Any, Any]]:
        prim, ins, g = e.prim, e.ins, outs[0]
        b = self.b
        if prim in self._LINEAR_PASS:
            if "custom" in e.params and not isinstance(ins[0], Lit) and ins[0] in self.dep and self.custom is None:
                # Refused after the walk, so that a primitive of the rule's primal that is refused anyway (`max`
                # of jax.nn.relu, ...) is the reason given.
                prim, fn = e.params["custom"]
                self.custom = LoweringError(
                    f"cudnn: the gradient of `{prim}` (the custom derivative rule of `{fn}`) applied to the score "
                    f"cannot be used in {_BPROP_LIMIT}; attnlib differentiates primitives only and will not "
                    "silently replace the rule by the derivative of its primal."
                )
            if prim == "optimization_barrier":
                return list(zip(ins, outs))
            return [(ins[0], g)]
        if prim == "stop_gradient":
            return []
        if prim == "convert_element_type":
            if e.in_avals[0].kind == "float" and e.out_avals[0].kind == "float":
                return [(ins[0], g)]
            return []  # through an integer or a boolean: a zero gradient
        if prim == "reduce_precision":
            return [(ins[0], g)]
        if e.out_avals[0].kind != "float":
            return []
        if prim == "add":
            return [(ins[0], g), (ins[1], g)]
        if prim == "sub":
            return [(ins[0], g), (ins[1], self.map(lambda x: b.unary("neg", x), g))]
        if prim == "neg":
            return [(ins[0], self.map(lambda x: b.unary("neg", x), g))]
        if prim == "mul":
            a_dep, b_dep = (not isinstance(x, Lit) and x in self.dep for x in ins)
            if a_dep and b_dep:
                raise _unsupported_grad(prim, "of two score-dependent values (e.g. `s * s`)")
            if a_dep:
                return [(ins[0], self.scale(g, "mul", self.indep(prim, ins[1], "")))]
            return [(ins[1], self.scale(g, "mul", self.indep(prim, ins[0], "")))]
        if prim == "div":
            divisor = self.indep(prim, ins[1], "by a score-dependent value")
            return [(ins[0], self.scale(g, "div", divisor))]
        if prim == "select_n":
            if not isinstance(ins[0], Lit) and ins[0] in self.dep:
                raise _unsupported_grad(prim, "with a condition on the score (e.g. `jnp.where(s > 0, ...)`)")
            which = self.lo.value(ins[0])
            cases = ins[1:]
            if e.in_avals[0].kind == "bool":
                if len(cases) == 1:
                    return [(cases[0], g)]
                # where the other case is a masking constant of the output's select chain, the zero is masked
                zero1 = _MASKED_ZERO if self.masking.get(id(e)) == 0 else None
                zero0 = _MASKED_ZERO if self.masking.get(id(e)) == 1 else None
                return [(cases[1], self.sel(which, g, zero1)), (cases[0], self.sel(which, zero0, g))]
            return [(c, self.sel(b.compare("eq", which, b.const(float(i))), g, None)) for i, c in enumerate(cases)]
        if prim in ("tanh", "logistic"):
            op = "tanh" if prim == "tanh" else "sigmoid"
            x = self.stored_input(e, op)
            return [(ins[0], self.map(lambda ct: b.backward(op, ct, x), g))]
        if prim == "integer_pow" and e.params.get("y") == 1:
            return [(ins[0], g)]
        raise _unsupported_grad(prim)
