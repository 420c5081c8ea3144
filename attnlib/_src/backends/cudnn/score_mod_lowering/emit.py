"""Emission: constant select inputs placed where cuDNN masks (`finalize`), then IR nodes -> `GraphOps` calls."""

from collections.abc import Callable, Sequence
from typing import Any

from .backward import MASKED_BELOW, MASKED_ZERO_INDEX
from .ir import Builder, canonical, Node, plain, SWAPPED
from .ops import GraphOps, LoweringError


_NEGATED = {"eq": "neq", "neq": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}


def _plain_bound(compare: Node) -> bool:
    """An order compare of plain sides (`plain`): the masks whose own-position, canonical form (`canonical`)
    matched the reference on the H200 (causal, prefix-LM, row ranges)."""
    return compare.op in SWAPPED and all(plain(a) for a in compare.args)


def finalize(b: "Builder", root: Node, zero_source: Node, *, backward: bool) -> tuple[Node, Callable]:
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
    memo: dict[tuple[int, bool], Node] = {}
    full: dict[int, bool] = {}

    def score_shaped(n: Node) -> bool:
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

    def localized(n: Node, like: Node) -> Node:
        if n.kind == "input" and n.op == "index":
            return b._node("index", "", (like,), index=n.index)
        new = tuple(localized(a, like) for a in n.args)
        return n if new == n.args else b._node(n.kind, n.op, new)

    def keep(n: Node, chain: bool) -> bool:
        if not (chain and n.is_const):
            return False
        return n.index == MASKED_ZERO_INDEX if backward else n.value <= MASKED_BELOW

    def tensor(c: Node) -> Node:
        zero = b._node("binary", "mul", (zero_source, b.const(0.0)))
        return zero if c.value == 0.0 else b._node("binary", "add", (zero, b.const(c.value)))

    def branch(n: Node, chain: bool) -> Node:
        return tensor(n) if n.is_const else rw(n, chain)

    def rw(n: Node, chain: bool) -> Node:
        key = (id(n), chain)
        if key in memo:
            return memo[key]
        if n.kind == "select":
            t, f, mask = n.args
            mask_args = tuple(rw(a, False) for a in mask.args)
            if keep(t, chain) and not keep(f, chain):
                t, f = f, t
                mask = Node("compare", _NEGATED[mask.op], mask_args)
            elif mask_args != mask.args:
                mask = Node("compare", mask.op, mask_args)
            new_t = branch(t, chain)
            if keep(f, chain):
                new_f = f
                masking.append(mask)
                if own_positions and score_shaped(new_t):
                    op, lhs, rhs = canonical(mask.op, *mask.args)
                    mask = Node("compare", op, (localized(lhs, new_t), localized(rhs, new_t)))
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

    masking: list[Node] = []
    own_positions = False
    new_root = rw(root, True)
    if masking and all(_plain_bound(m) for m in masking):
        own_positions = True
        memo.clear()
        new_root = rw(root, True)

    def lookup(n: Node) -> Node | None:
        """The rewritten version of `n` (its arithmetic use first)."""
        return memo.get((id(n), False), memo.get((id(n), True)))

    return new_root, lookup


class Emitter:
    def __init__(self, ops: GraphOps, sources: dict[tuple[str, int], Callable[[], Any]], store: dict | None):
        self.ops, self.sources, self.store = ops, sources, store
        self.memo: dict[int, Any] = {}

    def emit(self, root: Node) -> Any:
        stack: list[tuple[Node, bool]] = [(root, False)]
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
    def _deps(node: Node) -> tuple[Node, ...]:
        if node.kind == "backward":
            return node.args[:1]  # the input is a stored forward tensor, not emitted here
        return node.args

    def _make(self, node: Node) -> Any:
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

    def _stored(self, node: Node) -> Any:
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
