"""The op vocabulary the lowering emits into (`GraphOps`), its two implementations, and `LoweringError`."""

import math
import weakref
from typing import Any, Protocol

import numpy as np


BIG = 1e30
"""What a ±inf constant becomes in a graph (cuDNN turns a row of -inf scores into NaN)."""


class LoweringError(NotImplementedError):
    """A `score_mod` that cuDNN's pointwise ops cannot express. The message reads "cudnn: <what>, <why>" and names the
    JAX primitive."""


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


FOLD = NumpyOps()
