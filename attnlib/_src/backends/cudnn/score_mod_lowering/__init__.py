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
constant select input is kept only where the output really is masked (`finalize`); elsewhere it becomes the
computed tensor `score * 0 + c` (`dS * 0 + c` in the bprop).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .backward import Backward, input_key
from .emit import _sources, Emitter, finalize
from .flat import _aval, Flat, flatten
from .forward import Lowering
from .ir import Builder, Node
from .ops import (
    COMPARE_OPS as COMPARE_OPS,  # re-exported: used by the tests
    CudnnOps,
    GraphOps,
    LoweringError,
    NumpyOps,
    UNARY_OPS as UNARY_OPS,  # re-exported: used by the tests
)


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


def _symbolic(closed: Any, args: Sequence[Any] | None, first: str) -> tuple[Flat, Builder, Lowering]:
    _check_signature(closed, args)
    flat = flatten(closed)
    b = Builder()
    n_args = len(flat.invars) - 5
    inputs = [b.input(first)] + [b.input("index", i) for i in range(4)]
    for i in range(n_args):
        a = None if args is None else args[i]
        inputs.append(b.const(float(a)) if _is_python_scalar(a) else b.input("arg", i))
    return flat, b, Lowering(flat, b, inputs)


def _result(b: Builder, v: Any, zero_source: Node, *, backward: bool = False) -> tuple[Node, Callable]:
    """The root of a callback, and a map from a node of the symbolic lowering to its rewritten version."""
    node = b.materialize(v)
    if node.kind in ("input", "const"):  # a callback must return a computed tensor
        node = b._node("unary", "identity", (node,))
    return finalize(b, node, zero_source, backward=backward)


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
        _result(b, Backward(lo, b.input("d_score")).out, b.input("d_score"), backward=True)
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
    emitter = Emitter(ops, _sources(("score", score), indices, args), None)
    out = emitter.emit(root)
    memo = emitter.memo

    def emitted(v: Any) -> Any:
        new = rewritten(v) if isinstance(v, Node) else None
        return None if new is None else memo.get(id(new))

    for key, v in lo.values.items():
        tensor = emitted(v)
        if tensor is not None:
            store[key] = tensor
    for e in lo.flat.eqns:
        v = lo.values.get(e.outs[0])
        if e.prim in ("tanh", "logistic") and isinstance(v, Node) and v.kind == "unary":
            new = rewritten(v)
            if new is not None and id(new) in memo:
                store[input_key(e.outs[0])] = memo[id(new.args[0])]
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
    root, _ = _result(b, Backward(lo, b.input("d_score")).out, b.input("d_score"), backward=True)
    return Emitter(ops, _sources(("d_score", d_score), indices, args), store).emit(root)
