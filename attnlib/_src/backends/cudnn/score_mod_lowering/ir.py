"""The IR: hash-consed tensor nodes, lazy predicates and lazy selects, built with folding by `Builder`."""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .ops import FOLD


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """A float tensor. kind: "const" (value), "input" (name: "score", "index", "arg", "d_score"; index), "stored"
    (a forward tensor, key), "index" (the positions along axis `index` of its one arg's elements), or an op
    kind ("binary", "unary", "compare", "select", "backward") with `op` and `args`.
    `compare` nodes are boolean and only ever a select's mask (its third arg)."""

    kind: str
    op: str = ""
    args: tuple["Node", ...] = ()
    value: float = 0.0
    index: Any = None

    @property
    def is_const(self) -> bool:
        return self.kind == "const"


@dataclasses.dataclass(frozen=True, eq=False)
class Pred:
    """A lazy boolean: kind "lit" (value), "cmp" (op; args two nodes), "not", "and", "or", "xor" (args preds),
    "psel" (args: condition, if-true, if-false preds)."""

    kind: str
    op: str = ""
    args: tuple[Any, ...] = ()
    value: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Sel:
    """A lazy select. In values, every leaf is a constant node; in cotangents leaves are nodes or None (zero)."""

    pred: Pred
    if_true: Any
    if_false: Any


TRUE = Pred("lit", value=True)
FALSE = Pred("lit", value=False)
MAX_LEAVES = 64


def leaves(v: Any) -> int:
    return leaves(v.if_true) + leaves(v.if_false) if isinstance(v, Sel) else 1


def _const_tree(v: Any) -> bool:
    if isinstance(v, Sel):
        return _const_tree(v.if_true) and _const_tree(v.if_false)
    return isinstance(v, Node) and v.is_const


SWAPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def canonical(op: str, a: Node, b: Node) -> tuple[str, Node, Node]:
    """A constant second, and between two tensors `>=` / `>`: `col <= row` becomes `row >= col` (cuDNN 9.19 skips
    the tiles a causal mask hides only in that form; docs/score_mod_cudnn.md)."""
    if b.is_const:
        return op, a, b
    if op not in SWAPPED:  # eq / neq
        return (op, b, a) if a.is_const else (op, a, b)
    if a.is_const or op in ("lt", "le"):
        return SWAPPED[op], b, a
    return op, a, b


def _upper(pred: Pred) -> tuple[str, Node, Node] | None:
    """A compare as `hi >= lo` or `hi > lo`: `(op, hi, lo)`; None for (in)equality."""
    op, a, b = pred.op, *pred.args
    if op in ("ge", "gt"):
        return op, a, b
    if op in ("le", "lt"):
        return SWAPPED[op], b, a
    return None


def plain(n: Node) -> bool:
    """A position, a constant, or the max / min of a position and a constant."""
    position = lambda a: a.is_const or (a.kind == "input" and a.op == "index")  # noqa: E731
    return position(n) or (n.kind == "binary" and n.op in ("max", "min") and all(position(a) for a in n.args))


def _integral(n: Node) -> bool:
    """Whether `n` only takes integer values (positions, integer constants, and sums / products / bounds of them)."""
    if n.is_const:
        return float(n.value).is_integer()
    if n.kind == "input":
        return n.op == "index"
    if n.kind == "unary":
        return n.op in ("floor", "ceil") or (n.op in ("neg", "abs") and _integral(n.args[0]))
    if n.kind == "binary":
        return n.op in ("add", "sub", "mul", "max", "min") and all(_integral(a) for a in n.args)
    return False


class Builder:
    """Creates IR nodes and predicates with constant folding, identity rules and hash-consing."""

    def __init__(self) -> None:
        self._nodes: dict[tuple, Node] = {}
        self._preds: dict[tuple, Pred] = {}

    # ---- nodes
    def _node(self, kind: str, op: str = "", args: tuple = (), value: float = 0.0, index: Any = None) -> Node:
        key = (kind, op, tuple(id(a) for a in args), np.float32(value).tobytes() if kind == "const" else None, index)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = Node(kind, op, args, float(np.float32(value)), index)
        return node

    def const(self, value: float) -> Node:
        return self._node("const", value=float(value))

    def input(self, name: str, index: int = 0) -> Node:
        return self._node("input", op=name, index=index)

    def stored(self, key: Any) -> Node:
        return Node("stored", index=key)

    def backward(self, op: str, loss: Node, input: Node) -> Node:
        if input.is_const:  # a forward value that folded to a constant: its derivative is a constant
            x = np.float32(input.value)
            slope = float(FOLD.backward(op, np.float32(1.0), x))
            return self.binary("mul", loss, self.const(slope))
        return self._node("backward", op, (loss, input))

    def binary(self, op: str, a: Any, b: Any) -> Any:
        """`op(a, b)` for nodes or lazy selects of constants."""
        if isinstance(a, Sel) or isinstance(b, Sel):
            return self._distribute(lambda x, y: self.binary(op, x, y), a, b)
        if a.is_const and b.is_const:
            return self.const(float(FOLD.binary(op, np.float32(a.value), np.float32(b.value))))
        if b.is_const and ((op in ("add", "sub") and b.value == 0.0) or (op in ("mul", "div") and b.value == 1.0)):
            return a
        if a.is_const and ((op == "add" and a.value == 0.0) or (op == "mul" and a.value == 1.0)):
            return b
        return self._node("binary", op, (a, b))

    def unary(self, op: str, a: Any) -> Any:
        if isinstance(a, Sel):
            return self._map(lambda x: self.unary(op, x), a)
        if a.is_const:
            return self.const(float(FOLD.unary(op, np.float32(a.value))))
        return self._node("unary", op, (a,))

    def _map(self, fn: Callable[[Any], Any], v: Sel) -> Any:
        return self.sel(v.pred, fn(v.if_true), fn(v.if_false))

    def _distribute(self, fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        """`fn` applied branch by branch: a lazy select of constants combined with another value."""
        if leaves(a) * leaves(b) > MAX_LEAVES:
            return fn(self.materialize(a), self.materialize(b))
        if isinstance(a, Sel) and isinstance(b, Sel) and a.pred is b.pred:
            return self.sel(a.pred, fn(a.if_true, b.if_true), fn(a.if_false, b.if_false))
        if isinstance(a, Sel):
            return self.sel(a.pred, fn(a.if_true, b), fn(a.if_false, b))
        return self.sel(b.pred, fn(a, b.if_true), fn(a, b.if_false))

    def sel(self, pred: Pred, if_true: Any, if_false: Any) -> Any:
        """A select: lazy while both branches are constants, else materialized."""
        if pred.kind == "lit":
            return if_true if pred.value else if_false
        if if_true is if_false:
            return if_true
        if _const_tree(if_true) and _const_tree(if_false):
            return Sel(pred, if_true, if_false)
        return self.select(pred, self.materialize(if_true), self.materialize(if_false))

    def materialize(self, v: Any) -> Node:
        if isinstance(v, Sel):
            return self.select(v.pred, self.materialize(v.if_true), self.materialize(v.if_false))
        if isinstance(v, Pred):
            raise TypeError("a boolean is not a tensor")
        return v

    def select(self, pred: Pred, t: Node, f: Node) -> Node:
        """`where(pred, t, f)` as nested binary_selects: booleans are only ever select masks."""
        if t is f:
            return t
        k = pred.kind
        if k == "lit":
            return t if pred.value else f
        if k == "cmp":
            # One compare per select: a boolean is consumed exactly once, the form measured on cuDNN 9.19.
            mask = Node("compare", pred.op, pred.args)
            return self._node("select", "", (t, f, mask))
        if k == "not":
            return self.select(pred.args[0], f, t)
        p, q = pred.args[0], pred.args[1]
        if k == "and":
            return self.select(p, self.select(q, t, f), f)
        if k == "or":
            return self.select(p, t, self.select(q, t, f))
        if k == "xor":
            return self.select(p, self.select(q, f, t), self.select(q, t, f))
        if k == "psel":
            return self.select(p, self.select(q, t, f), self.select(pred.args[2], t, f))
        raise AssertionError(k)

    # ---- predicates
    def _pred(self, kind: str, op: str, args: tuple) -> Pred:
        key = (kind, op, tuple(id(a) for a in args))
        pred = self._preds.get(key)
        if pred is None:
            pred = self._preds[key] = Pred(kind, op, args)
        return pred

    def compare(self, op: str, a: Any, b: Any) -> Pred:
        if isinstance(a, Sel) or isinstance(b, Sel):
            if leaves(a) * leaves(b) > MAX_LEAVES:
                return self.compare(op, self.materialize(a), self.materialize(b))
            if isinstance(a, Sel) and isinstance(b, Sel) and a.pred is b.pred:
                return self.psel(
                    a.pred, self.compare(op, a.if_true, b.if_true), self.compare(op, a.if_false, b.if_false)
                )
            if isinstance(a, Sel):
                return self.psel(a.pred, self.compare(op, a.if_true, b), self.compare(op, a.if_false, b))
            return self.psel(b.pred, self.compare(op, a, b.if_true), self.compare(op, a, b.if_false))
        if a.is_const and b.is_const:
            return TRUE if bool(FOLD.compare(op, np.float32(a.value), np.float32(b.value))) else FALSE
        return self._pred("cmp", op, (a, b))

    def not_(self, p: Pred) -> Pred:
        if p.kind == "lit":
            return FALSE if p.value else TRUE
        if p.kind == "not":
            return p.args[0]
        return self._pred("not", "", (p,))

    @staticmethod
    def _negates(p: Pred, q: Pred) -> bool:
        return (p.kind == "not" and p.args[0] is q) or (q.kind == "not" and q.args[0] is p)

    def and_(self, p: Pred, q: Pred) -> Pred:
        if p.kind == "lit":
            return q if p.value else FALSE
        if q.kind == "lit":
            return p if q.value else FALSE
        if p is q:
            return p
        if self._negates(p, q):
            return FALSE
        merged = self._merge(p, q, either=False)
        return self._pred("and", "", (p, q)) if merged is None else merged

    def or_(self, p: Pred, q: Pred) -> Pred:
        if p.kind == "lit":
            return TRUE if p.value else q
        if q.kind == "lit":
            return TRUE if q.value else p
        if p is q:
            return p
        if self._negates(p, q):
            return TRUE
        merged = self._merge(p, q, either=True)
        return self._pred("or", "", (p, q)) if merged is None else merged

    def _merge(self, p: Pred, q: Pred, *, either: bool) -> Pred | None:
        """`p | q` (`either`) or `p & q` as one compare when both bound the same value from the same side:
        `a >= x | b >= x` is `max(a, b) >= x`, `x >= a & x >= b` is `x >= max(a, b)`, ... (`>` with `>=` only on
        integer values, through `a > x` = `a - 1 >= x`), when the result is a plain bound (`plain`). One masking
        select instead of two nested ones: cuDNN 9.19 runs an or of two selects 4.5x slower than full attention
        (docs/score_mod_cudnn.md)."""
        if p.kind != "cmp" or q.kind != "cmp":
            return None
        bp, bq = _upper(p), _upper(q)
        if bp is None or bq is None:
            return None
        (op1, a1, x1), (op2, a2, x2) = bp, bq
        shared_right = x1 is x2
        if not shared_right and a1 is not a2:
            return None
        op = op1
        if op1 != op2:
            if not all(_integral(n) for n in (a1, x1, a2, x2)):
                return None
            # rewrite the `>` one as `>=`, moving the 1 to the side that is not shared
            one = self.const(1.0)
            if op1 == "gt":
                a1, x1 = (self.binary("sub", a1, one), x1) if shared_right else (a1, self.binary("add", x1, one))
            else:
                a2, x2 = (self.binary("sub", a2, one), x2) if shared_right else (a2, self.binary("add", x2, one))
            op = "ge"
        if shared_right:  # a1 op x, a2 op x
            first, second = (a2, a1) if a1.is_const else (a1, a2)
            merged = (self.binary("max" if either else "min", first, second), x1)
        else:  # a op x1, a op x2
            first, second = (x2, x1) if x1.is_const else (x1, x2)
            merged = (a1, self.binary("min" if either else "max", first, second))
        if not all(plain(n) for n in merged):
            return None  # only merged forms measured on the H200
        return self.compare(op, *merged)

    def xor(self, p: Pred, q: Pred) -> Pred:
        if p.kind == "lit":
            return self.not_(q) if p.value else q
        if q.kind == "lit":
            return self.not_(p) if q.value else p
        if p is q:
            return FALSE
        if self._negates(p, q):
            return TRUE
        return self._pred("xor", "", (p, q))

    def psel(self, c: Pred, p: Pred, q: Pred) -> Pred:
        if c.kind == "lit":
            return p if c.value else q
        if p is q:
            return p
        if p.kind == "lit" and q.kind == "lit":
            return c if p.value else self.not_(c)
        if p.kind == "lit":
            return self.or_(c, q) if p.value else self.and_(self.not_(c), q)
        if q.kind == "lit":
            return self.and_(c, p) if not q.value else self.or_(self.not_(c), p)
        return self._pred("psel", "", (c, p, q))
