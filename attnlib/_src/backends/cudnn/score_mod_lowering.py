"""Lowering of a scalar JAX `score_mod` to cuDNN SDPA `score_mod` / `score_mod_bprop` pointwise ops.

A modifier is the closed jaxpr of `(score f32[], batch i32[], head i32[], q_idx i32[], kv_idx i32[], *args) -> f32[]`.
`emit_forward` turns it into pointwise ops inside cuDNN's `score_mod` callback (the forward graph, and the forward
recompute inside the backward graph); `emit_backward` derives its reverse-mode gradient and emits it inside the
`score_mod_bprop` callback, which receives `dS` (the gradient w.r.t. the modifier's output) and returns the gradient
w.r.t. its input score.

How it works, in two phases:

1. **Symbolic lowering** (pure Python, no cuDNN): the jaxpr is flattened (`jit`, `closed_call`, `custom_jvp_call`,
   `custom_vjp_call` and `checkpoint` are inlined), then each live equation becomes nodes of a small hash-consed IR
   of the op vocabulary below. Constants are folded in float32; booleans stay lazy *predicate trees* (compare
   leaves combined by not / and / or / xor) that only ever materialize as nested selects; a select of constants
   stays lazy too and is distributed over the arithmetic that consumes it (`s + where(m, 0, -inf)` becomes
   `select(m, s, s + -1e30)`), so no select of two constants ever feeds arithmetic. The backward is reverse-mode
   AD over the flat equations with the cotangent kept as a lazy select tree (symbolic zeros on masked branches).
   `forward_reason` / `backward_reason` run this phase alone.
2. **Emission**: only the IR nodes reachable from the result are emitted through a `GraphOps` (`CudnnOps` for a
   cuDNN pygraph, `NumpyOps` for the CPU emulator used by the tests), so the forward has no dangling tensors.

What cuDNN 9.19 accepts shapes every rule (measured on an H200, see `docs/score_mod_cudnn.md`): a comparison's
boolean result is only ever the mask of one select (no `logical_and`, no 0/1 floats in arithmetic); the backward
modifier reads a forward tensor only as the `input=` of `tanh_backward` / `sigmoid_backward`, and recomputes
everything else (gen_index, constants, args) with fresh ops; every op computes in FLOAT and every result is FLOAT
(BOOLEAN for compares); integers are FLOAT values (exact below 2**24); constants ±inf become ±1e30. cuDNN reads
`binary_select(x, constant, mask)` as a mask and skips what it masks, in the forward and in the bprop, so a
constant select input is kept only where the output really is masked (`_finalize`); elsewhere it becomes the
computed tensor `score * 0 + c` (`dS * 0 + c` in the bprop).
"""

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax.extend.core as jex
import numpy as np


__all__ = [
    "CudnnOps",
    "GraphOps",
    "LoweringError",
    "NumpyOps",
    "backward_reason",
    "emit_backward",
    "emit_forward",
    "forward_reason",
]

BIG = 1e30
"""What a ±inf constant becomes in a graph (cuDNN turns a row of -inf scores into NaN)."""

_BPROP_LIMIT = "cuDNN 9.19's score_mod_bprop (it can only read forward values through tanh_backward/sigmoid_backward)"


class LoweringError(NotImplementedError):
    """A `score_mod` that cuDNN's pointwise ops cannot express. The message reads "cudnn: <what>, <why>" and names the
    JAX primitive."""


# --------------------------------------------------------------------------------------------------------------------
# The op vocabulary and its two implementations.
# --------------------------------------------------------------------------------------------------------------------

BINARY_OPS = ("add", "sub", "mul", "div", "max", "min", "pow", "mod")
UNARY_OPS = (
    "neg", "abs", "exp", "log", "tanh", "sigmoid", "sin", "cos", "tan", "sqrt", "rsqrt", "floor", "ceil", "erf",
    "reciprocal", "identity",
)  # fmt: skip
COMPARE_OPS = ("eq", "neq", "lt", "le", "gt", "ge")
BACKWARD_OPS = ("tanh", "sigmoid")


class GraphOps(Protocol):
    """The pointwise op vocabulary the lowering emits into. Tensors are opaque to the lowering."""

    def constant(self, value: float) -> Any:
        """A float32 scalar constant (±inf become ±1e30)."""
        ...

    def binary(self, op: str, a: Any, b: Any) -> Any:
        """`op` in `BINARY_OPS`; `mod` is C's `fmod` (the sign of `a`)."""
        ...

    def unary(self, op: str, x: Any) -> Any:
        """`op` in `UNARY_OPS`."""
        ...

    def compare(self, op: str, a: Any, b: Any) -> Any:
        """`op` in `COMPARE_OPS`; a boolean tensor, only ever used as a `select` mask."""
        ...

    def select(self, if_true: Any, if_false: Any, mask: Any) -> Any:
        """`if_true` where `mask`, else `if_false`."""
        ...

    def backward(self, op: str, loss: Any, input: Any) -> Any:
        """`loss * f'(input)` for `op` in `BACKWARD_OPS` (`tanh_backward`, `sigmoid_backward`)."""
        ...

    def index(self, like: Any, axis: int) -> Any:
        """The position along `axis` (0 batch, 1 head, 2 query row, 3 key column) of each element of `like`, a
        tensor of the score's shape (cuDNN's `gen_index`)."""
        ...


def _finite(value: float) -> float:
    value = float(value)
    if math.isinf(value):
        return math.copysign(BIG, value)
    return value


_CONSTANTS: "weakref.WeakKeyDictionary[Any, dict[bytes, Any]]" = weakref.WeakKeyDictionary()


class CudnnOps:
    """`GraphOps` over a cuDNN frontend pygraph.

    Every op computes in FLOAT and every result is typed FLOAT (BOOLEAN for compares): without it cuDNN 9.19 finds
    no engine for the backward. Constants are `tensor_scalar(value, cudnn.scalar_type.RUNTIME_PARAM)`: float32
    pass-by-value scalars the graph owns (the binding takes a `scalar_type` there, not a data type;
    `COMPILE_TIME_CONST` needs cuDNN >= 9.22), one per value and graph (shared by the forward and backward callbacks
    of that graph).
    """

    _KEYWORDS = {op: ("a", "b") for op in ("add", "sub", "mul", "div")} | {
        op: ("input0", "input1") for op in ("max", "min", "pow", "mod")
    }

    def __init__(self, graph: Any):
        import cudnn

        self.graph = graph
        self._float = cudnn.data_type.FLOAT
        self._bool = cudnn.data_type.BOOLEAN
        self._runtime = cudnn.scalar_type.RUNTIME_PARAM
        try:
            self._constants = _CONSTANTS.setdefault(graph, {})
        except TypeError:  # not weakly referenceable: one table per CudnnOps
            self._constants = {}

    def _out(self, tensor: Any, data_type: Any = None) -> Any:
        tensor.set_data_type(self._float if data_type is None else data_type)
        return tensor

    def constant(self, value: float) -> Any:
        value = float(np.float32(_finite(value)))
        key = np.float32(value).tobytes()
        if key not in self._constants:
            # A pass-by-value scalar: serialized with the graph and bound by the frontend itself at execution.
            self._constants[key] = self.graph.tensor_scalar(value, self._runtime)
        return self._constants[key]

    def binary(self, op: str, a: Any, b: Any) -> Any:
        first, second = self._KEYWORDS[op]
        kwargs = {first: a, second: b, "compute_data_type": self._float}
        return self._out(getattr(self.graph, op)(**kwargs))

    def unary(self, op: str, x: Any) -> Any:
        if op not in UNARY_OPS:
            raise KeyError(op)
        return self._out(getattr(self.graph, op)(input=x, compute_data_type=self._float))

    def compare(self, op: str, a: Any, b: Any) -> Any:
        if op not in COMPARE_OPS:
            raise KeyError(op)
        cmp = getattr(self.graph, f"cmp_{op}")
        return self._out(cmp(input=a, comparison=b, compute_data_type=self._float), self._bool)

    def select(self, if_true: Any, if_false: Any, mask: Any) -> Any:
        return self._out(
            self.graph.binary_select(input0=if_true, input1=if_false, mask=mask, compute_data_type=self._float)
        )

    def backward(self, op: str, loss: Any, input: Any) -> Any:
        if op not in BACKWARD_OPS:
            raise KeyError(op)
        fn = getattr(self.graph, f"{op}_backward")
        return self._out(fn(loss=loss, input=input, compute_data_type=self._float))

    def index(self, like: Any, axis: int) -> Any:
        import cudnn

        return self._out(self.graph.gen_index(input=like, axis=axis), cudnn.data_type.INT32)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


class NumpyOps:
    """`GraphOps` on float32 NumPy arrays (boolean arrays for compares): the CPU emulator of `CudnnOps`.

    Inputs broadcast (index grids `[b, h, t, s]`, args `[1, h, 1, 1]`, ...). Integer inputs are read as float32, as
    cuDNN reads INT32 gen_index tensors; a boolean passed anywhere but a select mask is a `TypeError`.
    """

    _BINARY = {
        "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
        "min": np.minimum, "pow": np.power, "mod": np.fmod,
    }  # fmt: skip
    _UNARY = {
        "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "sin": np.sin, "cos": np.cos, "tan": np.tan, "sqrt": np.sqrt,
        "rsqrt": lambda x: 1 / np.sqrt(x), "floor": np.floor, "ceil": np.ceil, "erf": _erf,
        "reciprocal": lambda x: 1 / x, "identity": lambda x: x,
    }  # fmt: skip
    _COMPARE = {
        "eq": np.equal, "neq": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
        "ge": np.greater_equal,
    }  # fmt: skip

    @staticmethod
    def _num(x: Any) -> np.ndarray:
        x = np.asarray(x)
        if x.dtype == np.bool_:
            raise TypeError("a boolean (compare result) may only be used as a select mask")
        return x.astype(np.float32)

    @staticmethod
    def _f32(x: Any) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def constant(self, value: float) -> np.ndarray:
        return np.asarray(_finite(value), dtype=np.float32)

    def binary(self, op: str, a: Any, b: Any) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self._f32(self._BINARY[op](self._num(a), self._num(b)))

    def unary(self, op: str, x: Any) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self._f32(self._UNARY[op](self._num(x)))

    def compare(self, op: str, a: Any, b: Any) -> np.ndarray:
        return self._COMPARE[op](self._num(a), self._num(b))

    def select(self, if_true: Any, if_false: Any, mask: Any) -> np.ndarray:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError("a select mask must be a boolean (compare result)")
        return self._f32(np.where(mask, self._num(if_true), self._num(if_false)))

    def backward(self, op: str, loss: Any, input: Any) -> np.ndarray:
        loss, x = self._num(loss), self._num(input)
        with np.errstate(all="ignore"):
            if op == "tanh":
                return self._f32(loss * (1 - np.tanh(x) ** 2))
            if op == "sigmoid":
                y = 1 / (1 + np.exp(-x))
                return self._f32(loss * y * (1 - y))
        raise KeyError(op)

    def index(self, like: Any, axis: int) -> np.ndarray:
        shape = np.shape(like)
        if len(shape) != 4:
            raise ValueError(f"index: `like` must have the score's rank 4. Got shape {shape}.")
        grid = np.arange(shape[axis], dtype=np.int32).reshape([-1 if a == axis else 1 for a in range(4)])
        return np.broadcast_to(grid, shape)


_FOLD = NumpyOps()


# --------------------------------------------------------------------------------------------------------------------
# The IR: tensor nodes (hash-consed), lazy predicates, lazy selects.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
    """A float tensor. kind: "const" (value), "input" (name: "score", "index", "arg", "d_score"; index), "stored"
    (a forward tensor, key), "index" (the positions along axis `index` of its one arg's elements), or an op
    kind ("binary", "unary", "compare", "select", "backward") with `op` and `args`.
    `compare` nodes are boolean and only ever a select's mask (its third arg)."""

    kind: str
    op: str = ""
    args: tuple["_Node", ...] = ()
    value: float = 0.0
    index: Any = None

    @property
    def is_const(self) -> bool:
        return self.kind == "const"


@dataclasses.dataclass(frozen=True, eq=False)
class _Pred:
    """A lazy boolean: kind "lit" (value), "cmp" (op; args two nodes), "not", "and", "or", "xor" (args preds),
    "psel" (args: condition, if-true, if-false preds)."""

    kind: str
    op: str = ""
    args: tuple[Any, ...] = ()
    value: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class _Sel:
    """A lazy select. In values, every leaf is a constant node; in cotangents leaves are nodes or None (zero)."""

    pred: _Pred
    if_true: Any
    if_false: Any


_TRUE = _Pred("lit", value=True)
_FALSE = _Pred("lit", value=False)
_MAX_LEAVES = 64


def _leaves(v: Any) -> int:
    return _leaves(v.if_true) + _leaves(v.if_false) if isinstance(v, _Sel) else 1


def _const_tree(v: Any) -> bool:
    if isinstance(v, _Sel):
        return _const_tree(v.if_true) and _const_tree(v.if_false)
    return isinstance(v, _Node) and v.is_const


_SWAPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}


def _canonical(op: str, a: _Node, b: _Node) -> tuple[str, _Node, _Node]:
    """A constant second, and between two tensors `>=` / `>`: `col <= row` becomes `row >= col` (cuDNN 9.19 skips
    the tiles a causal mask hides only in that form; docs/score_mod_cudnn.md)."""
    if b.is_const:
        return op, a, b
    if op not in _SWAPPED:  # eq / neq
        return (op, b, a) if a.is_const else (op, a, b)
    if a.is_const or op in ("lt", "le"):
        return _SWAPPED[op], b, a
    return op, a, b


def _upper(pred: _Pred) -> tuple[str, _Node, _Node] | None:
    """A compare as `hi >= lo` or `hi > lo`: `(op, hi, lo)`; None for (in)equality."""
    op, a, b = pred.op, *pred.args
    if op in ("ge", "gt"):
        return op, a, b
    if op in ("le", "lt"):
        return _SWAPPED[op], b, a
    return None


def _plain(n: _Node) -> bool:
    """A position, a constant, or the max / min of a position and a constant."""
    position = lambda a: a.is_const or (a.kind == "input" and a.op == "index")  # noqa: E731
    return position(n) or (n.kind == "binary" and n.op in ("max", "min") and all(position(a) for a in n.args))


def _integral(n: _Node) -> bool:
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


class _Builder:
    """Creates IR nodes and predicates with constant folding, identity rules and hash-consing."""

    def __init__(self) -> None:
        self._nodes: dict[tuple, _Node] = {}
        self._preds: dict[tuple, _Pred] = {}

    # ---- nodes
    def _node(self, kind: str, op: str = "", args: tuple = (), value: float = 0.0, index: Any = None) -> _Node:
        key = (kind, op, tuple(id(a) for a in args), np.float32(value).tobytes() if kind == "const" else None, index)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(kind, op, args, float(np.float32(value)), index)
        return node

    def const(self, value: float) -> _Node:
        return self._node("const", value=float(value))

    def input(self, name: str, index: int = 0) -> _Node:
        return self._node("input", op=name, index=index)

    def stored(self, key: Any) -> _Node:
        return _Node("stored", index=key)

    def backward(self, op: str, loss: _Node, input: _Node) -> _Node:
        if input.is_const:  # a forward value that folded to a constant: its derivative is a constant
            x = np.float32(input.value)
            slope = float(_FOLD.backward(op, np.float32(1.0), x))
            return self.binary("mul", loss, self.const(slope))
        return self._node("backward", op, (loss, input))

    def binary(self, op: str, a: Any, b: Any) -> Any:
        """`op(a, b)` for nodes or lazy selects of constants."""
        if isinstance(a, _Sel) or isinstance(b, _Sel):
            return self._distribute(lambda x, y: self.binary(op, x, y), a, b)
        if a.is_const and b.is_const:
            return self.const(float(_FOLD.binary(op, np.float32(a.value), np.float32(b.value))))
        if b.is_const and ((op in ("add", "sub") and b.value == 0.0) or (op in ("mul", "div") and b.value == 1.0)):
            return a
        if a.is_const and ((op == "add" and a.value == 0.0) or (op == "mul" and a.value == 1.0)):
            return b
        return self._node("binary", op, (a, b))

    def unary(self, op: str, a: Any) -> Any:
        if isinstance(a, _Sel):
            return self._map(lambda x: self.unary(op, x), a)
        if a.is_const:
            return self.const(float(_FOLD.unary(op, np.float32(a.value))))
        return self._node("unary", op, (a,))

    def _map(self, fn: Callable[[Any], Any], v: _Sel) -> Any:
        return self.sel(v.pred, fn(v.if_true), fn(v.if_false))

    def _distribute(self, fn: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        """`fn` applied branch by branch: a lazy select of constants combined with another value."""
        if _leaves(a) * _leaves(b) > _MAX_LEAVES:
            return fn(self.materialize(a), self.materialize(b))
        if isinstance(a, _Sel) and isinstance(b, _Sel) and a.pred is b.pred:
            return self.sel(a.pred, fn(a.if_true, b.if_true), fn(a.if_false, b.if_false))
        if isinstance(a, _Sel):
            return self.sel(a.pred, fn(a.if_true, b), fn(a.if_false, b))
        return self.sel(b.pred, fn(a, b.if_true), fn(a, b.if_false))

    def sel(self, pred: _Pred, if_true: Any, if_false: Any) -> Any:
        """A select: lazy while both branches are constants, else materialized."""
        if pred.kind == "lit":
            return if_true if pred.value else if_false
        if if_true is if_false:
            return if_true
        if _const_tree(if_true) and _const_tree(if_false):
            return _Sel(pred, if_true, if_false)
        return self.select(pred, self.materialize(if_true), self.materialize(if_false))

    def materialize(self, v: Any) -> _Node:
        if isinstance(v, _Sel):
            return self.select(v.pred, self.materialize(v.if_true), self.materialize(v.if_false))
        if isinstance(v, _Pred):
            raise TypeError("a boolean is not a tensor")
        return v

    def select(self, pred: _Pred, t: _Node, f: _Node) -> _Node:
        """`where(pred, t, f)` as nested binary_selects: booleans are only ever select masks."""
        if t is f:
            return t
        k = pred.kind
        if k == "lit":
            return t if pred.value else f
        if k == "cmp":
            # One compare per select: a boolean is consumed exactly once, the form measured on cuDNN 9.19.
            mask = _Node("compare", pred.op, pred.args)
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
    def _pred(self, kind: str, op: str, args: tuple) -> _Pred:
        key = (kind, op, tuple(id(a) for a in args))
        pred = self._preds.get(key)
        if pred is None:
            pred = self._preds[key] = _Pred(kind, op, args)
        return pred

    def compare(self, op: str, a: Any, b: Any) -> _Pred:
        if isinstance(a, _Sel) or isinstance(b, _Sel):
            if _leaves(a) * _leaves(b) > _MAX_LEAVES:
                return self.compare(op, self.materialize(a), self.materialize(b))
            if isinstance(a, _Sel) and isinstance(b, _Sel) and a.pred is b.pred:
                return self.psel(
                    a.pred, self.compare(op, a.if_true, b.if_true), self.compare(op, a.if_false, b.if_false)
                )
            if isinstance(a, _Sel):
                return self.psel(a.pred, self.compare(op, a.if_true, b), self.compare(op, a.if_false, b))
            return self.psel(b.pred, self.compare(op, a, b.if_true), self.compare(op, a, b.if_false))
        if a.is_const and b.is_const:
            return _TRUE if bool(_FOLD.compare(op, np.float32(a.value), np.float32(b.value))) else _FALSE
        return self._pred("cmp", op, (a, b))

    def not_(self, p: _Pred) -> _Pred:
        if p.kind == "lit":
            return _FALSE if p.value else _TRUE
        if p.kind == "not":
            return p.args[0]
        return self._pred("not", "", (p,))

    @staticmethod
    def _negates(p: _Pred, q: _Pred) -> bool:
        return (p.kind == "not" and p.args[0] is q) or (q.kind == "not" and q.args[0] is p)

    def and_(self, p: _Pred, q: _Pred) -> _Pred:
        if p.kind == "lit":
            return q if p.value else _FALSE
        if q.kind == "lit":
            return p if q.value else _FALSE
        if p is q:
            return p
        if self._negates(p, q):
            return _FALSE
        merged = self._merge(p, q, either=False)
        return self._pred("and", "", (p, q)) if merged is None else merged

    def or_(self, p: _Pred, q: _Pred) -> _Pred:
        if p.kind == "lit":
            return _TRUE if p.value else q
        if q.kind == "lit":
            return _TRUE if q.value else p
        if p is q:
            return p
        if self._negates(p, q):
            return _TRUE
        merged = self._merge(p, q, either=True)
        return self._pred("or", "", (p, q)) if merged is None else merged

    def _merge(self, p: _Pred, q: _Pred, *, either: bool) -> _Pred | None:
        """`p | q` (`either`) or `p & q` as one compare when both bound the same value from the same side:
        `a >= x | b >= x` is `max(a, b) >= x`, `x >= a & x >= b` is `x >= max(a, b)`, ... (`>` with `>=` only on
        integer values, through `a > x` = `a - 1 >= x`), when the result is a plain bound (`_plain`). One masking
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
        if not all(_plain(n) for n in merged):
            return None  # only merged forms measured on the H200
        return self.compare(op, *merged)

    def xor(self, p: _Pred, q: _Pred) -> _Pred:
        if p.kind == "lit":
            return self.not_(q) if p.value else q
        if q.kind == "lit":
            return self.not_(p) if q.value else p
        if p is q:
            return _FALSE
        if self._negates(p, q):
            return _TRUE
        return self._pred("xor", "", (p, q))

    def psel(self, c: _Pred, p: _Pred, q: _Pred) -> _Pred:
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


# --------------------------------------------------------------------------------------------------------------------
# Flattening: one list of equations, sub-jaxprs inlined.
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Lit:
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Aval:
    shape: tuple[int, ...]
    kind: str  # "float", "int", "bool"


@dataclasses.dataclass
class _Eqn:
    prim: str
    params: dict
    ins: tuple  # keys or _Lit
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
class _Flat:
    invars: tuple  # keys
    out: Any  # key or _Lit
    out_aval: _Aval
    eqns: list[_Eqn]


def _flatten(closed: Any) -> _Flat:
    eqns: list[_Eqn] = []

    def atom(env: dict, x: Any) -> Any:
        if isinstance(x, jex.Literal):
            return _Lit(np.asarray(x.val))
        return env[x]

    def walk(jaxpr: Any, consts: Sequence[Any], path: tuple, env: dict) -> None:
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = _Lit(np.asarray(c))
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
                eqns.append(_Eqn(fast, {}, ins, outs, in_avals, out_avals))
            elif name in _INLINE:
                sub, sub_consts = _sub_jaxpr(e)
                sub_env = dict(zip(sub.invars, ins, strict=True))
                walk(sub, sub_consts, path + (i,), sub_env)
                # The backward differentiates primitives only: it refuses a custom rule's outputs on the score path.
                custom = {"custom": (name, _function_name(e, sub))} if name.startswith("custom_") else {}
                for k, inner, aval in zip(outs, sub.outvars, out_avals):
                    if k is not None:
                        eqns.append(_Eqn("_alias", custom, (atom(sub_env, inner),), (k,), (aval,), (aval,)))
            else:
                eqns.append(_Eqn(name, dict(e.params), ins, outs, in_avals, out_avals))

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
    live = {out} if not isinstance(out, _Lit) else set()
    kept = []
    for e in reversed(eqns):
        if any(k in live for k in e.outs if k is not None):
            kept.append(e)
            live.update(x for x in e.ins if not isinstance(x, _Lit))
    kept.reverse()
    return _Flat(tuple(jaxpr.invars), out, out_aval, kept)


# --------------------------------------------------------------------------------------------------------------------
# Forward rules: jaxpr equation -> IR values.
# --------------------------------------------------------------------------------------------------------------------

_UNARY_PRIMS = {
    "neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid", "sin": "sin",
    "cos": "cos", "tan": "tan", "sqrt": "sqrt", "rsqrt": "rsqrt", "floor": "floor", "ceil": "ceil", "erf": "erf",
}  # fmt: skip
_BINARY_PRIMS = {"add": "add", "sub": "sub", "mul": "mul", "max": "max", "min": "min", "pow": "pow"}
_COMPARE_PRIMS = {"eq": "eq", "ne": "neq", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
_PASS_PRIMS = {
    "_alias", "copy", "copy_p", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient",
    "optimization_barrier",
}  # fmt: skip
_OTHER_PRIMS = {
    "div", "rem", "sign", "integer_pow", "square", "exp2", "log1p", "expm1", "clamp", "select_n", "and", "or",
    "not", "xor", "convert_element_type", "reduce_precision", "round", "_int_floor_divide", "_int_remainder",
}  # fmt: skip
SUPPORTED_FORWARD = frozenset(_UNARY_PRIMS) | set(_BINARY_PRIMS) | set(_COMPARE_PRIMS) | _PASS_PRIMS | _OTHER_PRIMS
"""JAX primitives `emit_forward` lowers (after inlining `jit`, `custom_jvp_call`, ...)."""

_DECLINED = {
    "iota": "it builds an array; index a position with the batch/head/q_idx/kv_idx arguments instead",
    "atan2": "the lowering's op vocabulary has no atan2",
}


_LN2 = math.log(2.0)
_SIGN_SCALE = 2.0**100  # x * 2**100 * 2**100 saturates every nonzero float32 (even subnormals) past +-1


class _Lowering:
    """The symbolic lowering of one flat jaxpr for given input values."""

    def __init__(self, flat: _Flat, b: _Builder, inputs: Sequence[Any], *, backward: bool = False):
        self.flat, self.b, self.backward = flat, b, backward
        self.values: dict[Any, Any] = dict(zip(flat.invars, inputs, strict=True))
        for e in flat.eqns:
            outs = self._eqn(e)
            for k, v in zip(e.outs, outs):
                if k is not None:
                    self.values[k] = v
        self.out = self.value(flat.out)

    def value(self, x: Any) -> Any:
        if isinstance(x, _Lit):
            if x.value.size != 1:
                raise LoweringError(
                    f"cudnn: score_mod reads an array constant of shape {x.value.shape}, which a pointwise cuDNN "
                    "score_mod cannot index (pass per-head values as score_mod_args instead)."
                )
            v = x.value.reshape(())
            if v.dtype == np.bool_:
                return _TRUE if bool(v) else _FALSE
            return self.b.const(float(v))
        return self.values[x]

    # ---- helpers
    def _numeric(self, prim: str, v: Any) -> Any:
        if isinstance(v, _Pred):
            raise LoweringError(f"cudnn: `{prim}` on booleans is not supported, only and/or/not/xor/select are.")
        return v

    def _pred(self, prim: str, v: Any, kind: str) -> _Pred:
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

    def _eqn(self, e: _Eqn) -> list[Any]:
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
        if prim in _PASS_PRIMS:
            return args[: len(e.outs)]
        if prim in ("tanh", "logistic"):
            x = self._numeric(prim, args[0])
            if isinstance(x, _Node) and x.kind == "input":
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
            if isinstance(cases[0], _Pred):
                return b.psel(which, cases[1], cases[0])
            return b.sel(which, cases[1], cases[0])
        out = cases[-1]
        for i in range(len(cases) - 2, -1, -1):
            p = b.compare("eq", which, b.const(float(i)))
            out = b.psel(p, cases[i], out) if isinstance(out, _Pred) else b.sel(p, cases[i], out)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Backward: reverse-mode AD over the flat equations, cotangents as lazy select trees.
# --------------------------------------------------------------------------------------------------------------------


def _input_key(out_key: Any) -> tuple[str, Any]:
    """The store key of the tensor a forward tanh / logistic read (its backward op's `input=`)."""
    return ("input", out_key)


_MASKED_ZERO = object()
_MASKED_ZERO_INDEX = "masked"
MASKED_BELOW = -1e29
"""A constant at or below this is a masked score (the forward's -inf / -1e30)."""


def _is_zero(g: Any) -> bool:
    return g is None or g is _MASKED_ZERO


def _masking_selects(lo: "_Lowering") -> dict[int, int]:
    """The `select_n` equations on the output's select chain (reached from the output through pass-through ops and
    select cases only) with a case that is a constant <= -1e29: `id(eqn) -> that case`. Where such a select picks
    its constant, the forward output is a masked score."""
    flat = lo.flat
    chain = {flat.out}
    found: dict[int, int] = {}
    for e in reversed(flat.eqns):
        if not e.outs or e.outs[0] not in chain:
            continue
        if e.prim in _PASS_PRIMS or (e.prim == "convert_element_type" and e.in_avals[0].kind == "float"):
            chain.update(x for x in e.ins[:1] if not isinstance(x, _Lit))
        elif e.prim == "select_n" and e.in_avals[0].kind == "bool" and len(e.ins) == 3:
            for i, case in enumerate(e.ins[1:]):
                v = lo.value(case)
                if isinstance(v, _Node) and v.is_const and v.value <= MASKED_BELOW:
                    found[id(e)] = i
                elif not isinstance(case, _Lit):
                    chain.add(case)
    return found


_NEGATED = {"eq": "neq", "neq": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}


def _plain_bound(compare: _Node) -> bool:
    """An order compare of plain sides (`_plain`): the masks whose own-position, canonical form (`_canonical`)
    matched the reference on the H200 (causal, prefix-LM, row ranges)."""
    return compare.op in _SWAPPED and all(_plain(a) for a in compare.args)


def _finalize(b: "_Builder", root: _Node, zero_source: _Node, *, backward: bool) -> tuple[_Node, Callable]:
    """Where a select may keep a constant input (measured on cuDNN 9.19): cuDNN reads
    `binary_select(x, constant, mask)` as a mask and skips what it masks (in the forward and in the bprop), which
    is exact only where the output is a masked score there. So a constant select input survives only on the
    output's select chain (the root select and the select inputs of chain selects), as `input1`, and only if it is
    <= -1e29 (forward) or a zero at forward-masked positions (bprop); every other constant becomes a computed tensor
    `zero_source * 0 + c`. Compares are flipped (`lt` <-> `ge`, ...) to put a kept constant in `input1`.

    When every masking select's compare is a plain bound (`_plain_bound`: `row >= col`, `col <= max(row, c)`, ...),
    each becomes canonical (`row >= col`, constants second) and reads positions as `gen_index` of the select's own
    `input0` (an `"index"` node): cuDNN 9.19 skips masked tiles only then; with positions of the raw score, or as
    `col <= row`, the same graph runs every tile, 1.8x slower for soft cap + causal. Otherwise every compare stays as
    the function wrote it, on the raw score's positions, the form verified on the H200 for windows, offsets and
    documents: own positions gave wrong results for `row + c >= col` and `c > row - col`, and `row + 2 >= col`
    written as `col <= row + 2` was wrong next to sinks (docs/score_mod_cudnn.md)."""
    memo: dict[tuple[int, bool], _Node] = {}
    full: dict[int, bool] = {}

    def score_shaped(n: _Node) -> bool:
        """Whether `n` has the score's full shape (it reads the score, its gradient, a position or a forward
        tensor; args and constants alone broadcast)."""
        if id(n) not in full:
            if n.kind == "input":
                full[id(n)] = n.op != "arg"
            elif n.kind in ("stored", "index"):
                full[id(n)] = True
            else:
                full[id(n)] = any(score_shaped(a) for a in n.args)
        return full[id(n)]

    def localized(n: _Node, like: _Node) -> _Node:
        if n.kind == "input" and n.op == "index":
            return b._node("index", "", (like,), index=n.index)
        new = tuple(localized(a, like) for a in n.args)
        return n if new == n.args else b._node(n.kind, n.op, new)

    def keep(n: _Node, chain: bool) -> bool:
        if not (chain and n.is_const):
            return False
        return n.index == _MASKED_ZERO_INDEX if backward else n.value <= MASKED_BELOW

    def tensor(c: _Node) -> _Node:
        zero = b._node("binary", "mul", (zero_source, b.const(0.0)))
        return zero if c.value == 0.0 else b._node("binary", "add", (zero, b.const(c.value)))

    def branch(n: _Node, chain: bool) -> _Node:
        return tensor(n) if n.is_const else rw(n, chain)

    def rw(n: _Node, chain: bool) -> _Node:
        key = (id(n), chain)
        if key in memo:
            return memo[key]
        if n.kind == "select":
            t, f, mask = n.args
            mask_args = tuple(rw(a, False) for a in mask.args)
            if keep(t, chain) and not keep(f, chain):
                t, f = f, t
                mask = _Node("compare", _NEGATED[mask.op], mask_args)
            elif mask_args != mask.args:
                mask = _Node("compare", mask.op, mask_args)
            new_t = branch(t, chain)
            if keep(f, chain):
                new_f = f
                masking.append(mask)
                if own_positions and score_shaped(new_t):
                    op, lhs, rhs = _canonical(mask.op, *mask.args)
                    mask = _Node("compare", op, (localized(lhs, new_t), localized(rhs, new_t)))
            else:
                new_f = branch(f, chain)
            out = b._node("select", "", (new_t, new_f, mask))
            if out.args == n.args:
                out = n
        elif n.args:
            args = tuple(n.args[:1] if n.kind == "backward" else n.args)
            new = tuple(rw(a, False) for a in args)
            if new == args:
                out = n
            else:
                out = b._node(n.kind, n.op, new + tuple(n.args[len(args) :]))
        else:
            out = n
        memo[key] = out
        return out

    masking: list[_Node] = []
    own_positions = False
    new_root = rw(root, True)
    if masking and all(_plain_bound(m) for m in masking):
        own_positions = True
        memo.clear()
        new_root = rw(root, True)

    def lookup(n: _Node) -> _Node | None:
        """The rewritten version of `n` (its arithmetic use first)."""
        return memo.get((id(n), False), memo.get((id(n), True)))

    return new_root, lookup


def _depends(flat: _Flat) -> set[Any]:
    dep = {flat.invars[0]}
    for e in flat.eqns:
        if any(not isinstance(x, _Lit) and x in dep for x in e.ins):
            dep.update(k for k in e.outs if k is not None)
    return dep


def _unsupported_grad(prim: str, detail: str = "applied to the score") -> LoweringError:
    return LoweringError(f"cudnn: the gradient of `{prim}` {detail} cannot be expressed in {_BPROP_LIMIT}.")


class _Backward:
    """Cotangent propagation. `lo` is the symbolic forward recomputed for the bprop (score-independent values only
    are read from it, as fresh ops)."""

    _LINEAR_PASS = _PASS_PRIMS - {"stop_gradient"}

    def __init__(self, lo: _Lowering, d_score: _Node):
        self.lo, self.b = lo, lo.b
        flat = lo.flat
        self.dep = _depends(flat)
        self.masking = _masking_selects(lo)
        self.custom: LoweringError | None = None
        ct: dict[Any, Any] = {}
        if not isinstance(flat.out, _Lit) and flat.out in self.dep:
            ct[flat.out] = d_score
        for e in reversed(flat.eqns):
            outs = [ct.pop(k, None) if k is not None else None for k in e.outs]
            if all(_is_zero(g) for g in outs):
                continue
            for x, g in self._eqn(e, outs):
                if not _is_zero(g) and not isinstance(x, _Lit) and x in self.dep:
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
    def sel(self, pred: _Pred, t: Any, f: Any) -> Any:
        if pred.kind == "lit":
            return t if pred.value else f
        if t is f:
            return t
        if _is_zero(t) and _is_zero(f):
            return _MASKED_ZERO if _MASKED_ZERO in (t, f) else None
        return _Sel(pred, t, f)

    def map(self, fn: Callable[[_Node], Any], g: Any) -> Any:
        if _is_zero(g):
            return g
        if isinstance(g, _Sel):
            return self.sel(g.pred, self.map(fn, g.if_true), self.map(fn, g.if_false))
        return fn(g)

    def add(self, g: Any, h: Any) -> Any:
        if _is_zero(g) and _is_zero(h):
            return _MASKED_ZERO if _MASKED_ZERO in (g, h) else None
        if _is_zero(g):
            return h
        if _is_zero(h):
            return g
        if _leaves(g) * _leaves(h) > _MAX_LEAVES:
            return self.b.binary("add", self.materialize(g), self.materialize(h))
        if isinstance(g, _Sel) and isinstance(h, _Sel) and g.pred is h.pred:
            return self.sel(g.pred, self.add(g.if_true, h.if_true), self.add(g.if_false, h.if_false))
        if isinstance(g, _Sel):
            return self.sel(g.pred, self.add(g.if_true, h), self.add(g.if_false, h))
        if isinstance(h, _Sel):
            return self.sel(h.pred, self.add(g, h.if_true), self.add(g, h.if_false))
        return self.b.binary("add", g, h)

    def scale(self, g: Any, op: str, v: Any) -> Any:
        """`g * v` or `g / v` for a score-independent value `v` (a node or a lazy select of constants)."""
        if _is_zero(g):
            return g
        if isinstance(v, _Sel):
            return self.sel(v.pred, self.scale(g, op, v.if_true), self.scale(g, op, v.if_false))
        if op == "mul" and v.is_const and v.value == 0.0:
            return None
        return self.map(lambda x: self.b.binary(op, x, v), g)

    def materialize(self, g: Any) -> _Node:
        if g is None:
            return self.b.const(0.0)
        if g is _MASKED_ZERO:
            return self.b._node("const", value=0.0, index=_MASKED_ZERO_INDEX)
        if isinstance(g, _Sel):
            return self.b.select(g.pred, self.materialize(g.if_true), self.materialize(g.if_false))
        return g

    # ---- rules
    def indep(self, prim: str, x: Any, detail: str) -> Any:
        if not isinstance(x, _Lit) and x in self.dep:
            raise _unsupported_grad(prim, detail)
        v = self.lo.value(x)
        if isinstance(v, _Pred):
            raise LoweringError(f"cudnn: `{prim}` on booleans is not supported.")
        return v

    def stored_input(self, e: _Eqn, op: str) -> _Node:
        """The `input=` of the backward op of `e` (tanh / logistic): the tensor the forward op read (kept in the
        store under `("input", out_key)`), or a constant when the forward folded it."""
        fwd = self.lo.values[e.outs[0]]
        if isinstance(fwd, _Node) and fwd.kind == "unary" and fwd.op == op:
            return self.b.stored(_input_key(e.outs[0]))
        x = self.lo.value(e.ins[0])
        if isinstance(x, _Node) and x.is_const:
            return x
        raise _unsupported_grad(e.prim, "of a value selected by a condition on the score")

    def _eqn(self, e: _Eqn, outs: list[Any]) -> list[tuple[Any, Any]]:
        prim, ins, g = e.prim, e.ins, outs[0]
        b = self.b
        if prim in self._LINEAR_PASS:
            if "custom" in e.params and not isinstance(ins[0], _Lit) and ins[0] in self.dep and self.custom is None:
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
            a_dep, b_dep = (not isinstance(x, _Lit) and x in self.dep for x in ins)
            if a_dep and b_dep:
                raise _unsupported_grad(prim, "of two score-dependent values (e.g. `s * s`)")
            if a_dep:
                return [(ins[0], self.scale(g, "mul", self.indep(prim, ins[1], "")))]
            return [(ins[1], self.scale(g, "mul", self.indep(prim, ins[0], "")))]
        if prim == "div":
            divisor = self.indep(prim, ins[1], "by a score-dependent value")
            return [(ins[0], self.scale(g, "div", divisor))]
        if prim == "select_n":
            if not isinstance(ins[0], _Lit) and ins[0] in self.dep:
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


# --------------------------------------------------------------------------------------------------------------------
# Emission: IR nodes reachable from the result -> GraphOps calls.
# --------------------------------------------------------------------------------------------------------------------


class _Emitter:
    def __init__(self, ops: GraphOps, sources: dict[tuple[str, int], Callable[[], Any]], store: dict | None):
        self.ops, self.sources, self.store = ops, sources, store
        self.memo: dict[int, Any] = {}

    def emit(self, root: _Node) -> Any:
        stack: list[tuple[_Node, bool]] = [(root, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in self.memo:
                continue
            deps = self._deps(node)
            if not ready:
                stack.append((node, True))
                stack.extend((d, False) for d in deps if id(d) not in self.memo)
                continue
            self.memo[id(node)] = self._make(node)
        return self.memo[id(root)]

    @staticmethod
    def _deps(node: _Node) -> tuple[_Node, ...]:
        if node.kind == "backward":
            return node.args[:1]  # the input is a stored forward tensor, not emitted here
        return node.args

    def _make(self, node: _Node) -> Any:
        ops, m = self.ops, self.memo
        k = node.kind
        if k == "const":
            return ops.constant(node.value)
        if k == "input":
            source = self.sources.get((node.op, node.index))
            if source is None:
                raise AssertionError(f"score_mod_lowering: no {node.op} input in this callback")
            return source()
        if k == "binary":
            return ops.binary(node.op, m[id(node.args[0])], m[id(node.args[1])])
        if k == "unary":
            return ops.unary(node.op, m[id(node.args[0])])
        if k == "compare":
            return ops.compare(node.op, m[id(node.args[0])], m[id(node.args[1])])
        if k == "select":
            return ops.select(m[id(node.args[0])], m[id(node.args[1])], m[id(node.args[2])])
        if k == "backward":
            return ops.backward(node.op, m[id(node.args[0])], self._stored(node.args[1]))
        if k == "index":
            return ops.index(m[id(node.args[0])], node.index)
        raise AssertionError(f"score_mod_lowering: a {k} node cannot be emitted here")

    def _stored(self, node: _Node) -> Any:
        if node.kind == "const":
            return self.ops.constant(node.value)
        if node.kind != "stored":
            raise AssertionError("score_mod_lowering: a backward op's input must be a forward tensor")
        if self.store is None or node.index not in self.store:
            raise LoweringError(
                "cudnn: score_mod_bprop needs a tensor of the forward modifier that was not recorded; call "
                "emit_forward with the same `store` first (cuDNN runs score_mod before score_mod_bprop)."
            )
        return self.store[node.index]


def _sources(d_or_score: tuple[str, Any], indices: Callable[[], Sequence[Any]], args: Sequence[Any]) -> dict:
    made: list[Sequence[Any]] = []

    def index(i: int) -> Callable[[], Any]:
        def get() -> Any:
            if not made:
                made.append(indices())
            return made[0][i]

        return get

    sources: dict[tuple[str, int], Callable[[], Any]] = {(d_or_score[0], 0): lambda: d_or_score[1]}
    sources.update({("index", i): index(i) for i in range(4)})
    sources.update({("arg", i): (lambda a=a: a) for i, a in enumerate(args)})
    return sources


def _is_python_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.generic))


def _check_signature(closed: Any, args: Sequence[Any] | None) -> None:
    avals = [_aval(v.aval) for v in closed.jaxpr.invars]
    if len(avals) < 5 or any(math.prod(a.shape) != 1 for a in avals):
        raise LoweringError(
            "cudnn: score_mod must be traced on scalars as `(score, batch, head, q_idx, kv_idx, *args)`; got inputs "
            f"{[(a.kind, a.shape) for a in avals]}."
        )
    if args is not None and len(args) != len(avals) - 5:
        raise ValueError(f"`args` must hold {len(avals) - 5} values for the jaxpr's trailing inputs. Got {len(args)}.")


def _symbolic(closed: Any, args: Sequence[Any] | None, first: str) -> tuple[_Flat, _Builder, _Lowering]:
    _check_signature(closed, args)
    flat = _flatten(closed)
    b = _Builder()
    n_args = len(flat.invars) - 5
    inputs = [b.input(first)] + [b.input("index", i) for i in range(4)]
    for i in range(n_args):
        a = None if args is None else args[i]
        inputs.append(b.const(float(a)) if _is_python_scalar(a) else b.input("arg", i))
    return flat, b, _Lowering(flat, b, inputs)


def _result(b: _Builder, v: Any, zero_source: _Node, *, backward: bool = False) -> tuple[_Node, Callable]:
    """The root of a callback, and a map from a node of the symbolic lowering to its rewritten version."""
    node = b.materialize(v)
    if node.kind in ("input", "const"):  # a callback must return a computed tensor
        node = b._node("unary", "identity", (node,))
    return _finalize(b, node, zero_source, backward=backward)


# --------------------------------------------------------------------------------------------------------------------
# Public entry points.
# --------------------------------------------------------------------------------------------------------------------


def forward_reason(jaxpr: Any) -> str | None:
    """Why `emit_forward` cannot lower `jaxpr` (a "cudnn: ..." sentence naming the primitive), or None.

    Pure Python: needs neither cuDNN nor a GPU. `score_mod_args` count as tensors (a baked constant can only make
    more cases lowerable).
    """
    try:
        _, b, lo = _symbolic(jaxpr, None, "score")
        _result(b, lo.out, b.input("score"))
    except LoweringError as e:
        return str(e)
    return None


def backward_reason(jaxpr: Any) -> str | None:
    """Why `emit_backward` cannot lower the gradient of `jaxpr` (or its forward), or None. Pure Python."""
    try:
        _, b, lo = _symbolic(jaxpr, None, "score")
        _result(b, lo.out, b.input("score"))
        _result(b, _Backward(lo, b.input("d_score")).out, b.input("d_score"), backward=True)
    except LoweringError as e:
        return str(e)
    return None


def emit_forward(
    ops: GraphOps,
    jaxpr: Any,
    score: Any,
    indices: Callable[[], Sequence[Any]],
    args: Sequence[Any],
    store: dict,
) -> Any:
    """Emit the modifier `jaxpr` into `ops` (inside cuDNN's `score_mod` callback) and return the modified score.

    Args:
        ops: the op vocabulary (`CudnnOps(graph)` in a cuDNN callback).
        jaxpr: the `ClosedJaxpr` of `(score f32[], batch i32[], head i32[], q_idx i32[], kv_idx i32[], *args)
            -> f32[]`, traced on scalars; its constants are baked in.
        score: the callback's score tensor.
        indices: returns `[batch, head, q, kv]` gen_index tensors of this callback; called at most once, and only
            when the modifier reads an index. Only the axes the modifier reads are indexed, so return a lazy
            sequence that creates each gen_index on first access: on cuDNN 9.19 (H200) a gen_index tensor that
            reaches no output makes the backward graph give wrong gradients (dQ/dK/dV off by ~40, no error).
        args: one tensor per trailing jaxpr input, or a Python / NumPy scalar to bake as a constant.
        store: filled with the forward tensor of every jaxpr variable (keyed by the variable; `(path, var)` inside
            inlined calls) for `emit_backward` in the same graph.

    Returns:
        The tensor of the modified score.

    Raises:
        LoweringError: the modifier uses something cuDNN's pointwise ops cannot express.
    """
    _, b, lo = _symbolic(jaxpr, args, "score")
    root, rewritten = _result(b, lo.out, b.input("score"))
    emitter = _Emitter(ops, _sources(("score", score), indices, args), None)
    out = emitter.emit(root)
    memo = emitter.memo

    def emitted(v: Any) -> Any:
        new = rewritten(v) if isinstance(v, _Node) else None
        return None if new is None else memo.get(id(new))

    for key, v in lo.values.items():
        tensor = emitted(v)
        if tensor is not None:
            store[key] = tensor
    for e in lo.flat.eqns:
        v = lo.values.get(e.outs[0])
        if e.prim in ("tanh", "logistic") and isinstance(v, _Node) and v.kind == "unary":
            new = rewritten(v)
            if new is not None and id(new) in memo:
                store[_input_key(e.outs[0])] = memo[id(new.args[0])]
    return out


def emit_backward(
    ops: GraphOps,
    jaxpr: Any,
    d_score: Any,
    indices: Callable[[], Sequence[Any]],
    args: Sequence[Any],
    store: dict,
) -> Any:
    """Emit the gradient of the modifier (inside cuDNN's `score_mod_bprop` callback): `dS -> dS * d out / d score`.

    Reverse-mode AD over the jaxpr, restricted to what cuDNN 9.19 can express: score-independent values (index
    arithmetic, masks, args, constants) are recomputed with fresh ops; a forward tensor is read only as the
    `input=` of `tanh_backward` / `sigmoid_backward` (from `store`, filled by `emit_forward` in the same graph).

    Args:
        d_score: the callback's gradient w.r.t. the modifier's output.
        (the others as in `emit_forward`.)

    Returns:
        The tensor of the gradient w.r.t. the input score.

    Raises:
        LoweringError: the gradient cannot be expressed (e.g. `exp(s)`, `s * s`, `where(s > 0, ...)`).
    """
    _, b, lo = _symbolic(jaxpr, args, "score")
    root, _ = _result(b, _Backward(lo, b.input("d_score")).out, b.input("d_score"), backward=True)
    return _Emitter(ops, _sources(("d_score", d_score), indices, args), store).emit(root)
