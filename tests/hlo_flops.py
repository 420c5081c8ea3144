"""Matmul FLOPs of a compiled XLA program, loops included.

`Compiled.cost_analysis()` counts a `while` body once, whatever its trip count, so it cannot tell a loop over 8 key
blocks from one over 64. `dot_flops` reads the compiled HLO text instead: every `dot` counts `2 * |out| * |contracted|`
FLOPs, fusions and calls count what they call, and a `while` counts its body `known_trip_count` times (XLA's own
annotation of loops with a static trip count; a loop without one raises). Structural, not timing: used to check that
`xla_chunked` skips the tiles a band hides.
"""

import math
import re


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
_PARAM = re.compile(r"([\w.\-]+): \w+\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\w+\[([\d,]*)\]\S*|\(.*?\)) ([\w\-]+)\((.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def dot_flops(hlo_text: str) -> int:
    """Matmul FLOPs of `jax.jit(f).lower(...).compile().as_text()`, `while` bodies times their trip counts."""
    computations: dict[str, list[str]] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            shapes[current] = {name: _dims(dims) for name, dims in _PARAM.findall(header.group(2))}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction:
            name, dims, _, _ = instruction.groups()
            if dims is not None:
                shapes[current][name] = _dims(dims)
            computations[current].append(line)

    memo: dict[str, int] = {}

    def flops(computation: str) -> int:
        if computation in memo:
            return memo[computation]
        total = 0
        for line in computations[computation]:
            name, dims, op, rest = _INSTRUCTION.match(line).groups()
            if op == "dot":
                lhs = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[0]
                contracting = _dims(re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1))
                lhs_shape = shapes[computation][lhs]
                total += 2 * math.prod(_dims(dims)) * math.prod(lhs_shape[d] for d in contracting)
            elif op == "while":
                trips = _TRIP_COUNT.search(rest)
                if trips is None:
                    raise ValueError(f"a while loop without a known trip count: {line.strip()[:200]}")
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                total += int(trips.group(1)) * flops(body)
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest).group(1)
                total += max(flops(b.strip().lstrip("%")) for b in branches.split(","))
            else:
                for called in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", rest):
                    total += flops(called)
        memo[computation] = total
        return total

    return flops(entry)
