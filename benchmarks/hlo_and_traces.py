"""What a compiled call does, read from its HLO text and from JAX's own profiler (CUPTI on a GPU; no Nsight needed):
`layout_ops` (the transposes and copies next to the attention custom calls), `device_op_times` /
`profile_device_time` (per step, the device time of the XLA ops and the attention kernels' part; `bench_model.py`)
and `kernel_profile` (per call, each kernel's device time and the span they cover).
"""

import collections
import dataclasses
import pathlib
import re
import tempfile
from collections.abc import Callable

import jax
import numpy as np


ATTENTION_TARGETS = r"attnlib|fmha|tpu_custom_call|mosaic|triton"
_LAYOUT_OPS = ("transpose", "copy")  # copy-start / copy-done: between memory spaces (prefetch)
_DATA_MOVEMENT = ("parameter", "bitcast", "reshape", "get-tuple-element", "tuple", "convert", "slice")
_OP = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


@dataclasses.dataclass
class _Instr:
    name: str
    op: str
    operands: list[str]
    calls: list[str]
    target: str | None
    op_name: str
    index: int | None  # parameter number, tuple index of a get-tuple-element
    root: bool
    bytes: int  # of its result (all arrays of a tuple)


def _parse_operands(text: str, start: int) -> tuple[list[str], int]:
    depth, i, parts, current = 1, start, [], []
    while i < len(text) and depth:
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if depth == 1 and ch == ",":
            parts.append("".join(current))
            current = []
        elif depth:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return [p.split()[-1].lstrip("%") for p in parts if p.strip()], i


def _bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(result_type):
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype)[:2] or 8)
        total += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * bits // 8
    return total


def parse_hlo(text: str) -> dict[str, list[_Instr]]:
    """Computation name -> its instructions, from `Compiled.as_text()`."""
    computations: dict[str, list[_Instr]] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{") and "(" in line:
            header = line.split("(")[0].split()
            current = computations.setdefault(header[-1].lstrip("%"), [])
            continue
        if current is None or " = " not in line or not line.startswith(" "):
            continue
        lhs, rhs = line.split(" = ", 1)
        words = lhs.split()
        match = _OP.search(rhs)
        if not match or not words:
            continue
        op = match.group(1)
        operands, end = _parse_operands(rhs, match.end())
        attrs = rhs[end:]
        index = None
        if op == "parameter" and operands and operands[0].isdigit():
            index = int(operands[0])
        found = re.search(r"index=(\d+)", attrs)
        if op == "get-tuple-element" and found:
            index = int(found.group(1))
        target = re.search(r'custom_call_target="([^"]*)"', attrs)
        op_name = re.search(r'op_name="([^"]*)"', attrs)
        calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", attrs)
        for group in re.findall(r"(?:calls|branch_computations)=\{([^}]*)\}", attrs):
            calls += [c.strip().lstrip("%") for c in group.split(",")]
        current.append(
            _Instr(
                name=words[-1].lstrip("%"),
                op=op,
                operands=operands if op != "parameter" else [],
                calls=calls,
                target=target.group(1) if target else None,
                op_name=op_name.group(1) if op_name else "",
                index=index,
                root=words[0] == "ROOT",
                bytes=_bytes(rhs[: match.start()]),
            )
        )
    return computations


def layout_ops(text: str, targets: str = ATTENTION_TARGETS, max_examples: int = 8) -> dict:
    """Transposes and copies of a compiled HLO module, and those next to the custom calls matching `targets`.

    Next to a call: an instruction producing one of its operands or consuming one of its results, through bitcasts,
    tuples and wrapped computations (command buffers, async wrappers). `standalone`: a transpose or copy, or a fusion
    that only moves data (its ops are transposes, copies, bitcasts, reshapes, converts, slices): an extra pass over
    the tensor, with its bytes. `in_fusion`: a fusion that computes and also lays its result out transposed (it
    holds a transpose or copy, or its source is a `transpose` in the program): no extra pass.
    """
    computations = parse_hlo(text)
    by_name = {(c, i.name): i for c, instrs in computations.items() for i in instrs}
    callers = collections.defaultdict(list)  # computation -> [(caller computation, caller instruction)]
    users = collections.defaultdict(list)  # (computation, name) -> [user instruction]
    for comp, instrs in computations.items():
        for instr in instrs:
            for called in instr.calls:
                callers[called].append((comp, instr))
            for operand in instr.operands:
                users[comp, operand].append(instr)

    memo: dict[str, bool] = {}

    def has_layout_op(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False
            memo[comp] = any(
                i.op in _LAYOUT_OPS or any(has_layout_op(c) for c in i.calls) for i in computations.get(comp, [])
            )
        return memo[comp]

    def only_moves_data(comp: str) -> bool:
        ops = {i.op for i in computations.get(comp, [])}
        return bool(ops & set(_LAYOUT_OPS)) and ops <= {*_LAYOUT_OPS, *_DATA_MOVEMENT}

    def classify(instr: _Instr) -> str | None:
        if instr.op in _LAYOUT_OPS or (instr.op == "fusion" and instr.calls and all(map(only_moves_data, instr.calls))):
            return "standalone"
        if instr.op == "fusion" and (
            instr.op_name.endswith("/transpose") or any(has_layout_op(c) for c in instr.calls)
        ):
            return "in_fusion"
        return None

    def producers(comp: str, name: str, depth: int = 0) -> list[_Instr]:
        instr = by_name.get((comp, name))
        if instr is None or depth > 20:
            return []
        if instr.op == "parameter" and instr.index is not None:  # a wrapped computation (command buffer, async)
            found = []
            for caller_comp, caller in callers.get(comp, []):
                if caller.op != "fusion" and instr.index < len(caller.operands):
                    found += producers(caller_comp, caller.operands[instr.index], depth + 1)
            return found
        if instr.op in ("bitcast", "get-tuple-element", "copy-start", "copy-done") and instr.operands:
            return producers(comp, instr.operands[0], depth + 1)
        return [instr]

    def consumers(comp: str, name: str, index: int | None = None, depth: int = 0) -> list[_Instr]:
        found = []
        if depth > 20:
            return found
        for user in users.get((comp, name), []):
            if user.op == "get-tuple-element":
                if index is None or user.index == index:
                    found += consumers(comp, user.name, None, depth + 1)
            elif user.op in ("bitcast", "copy-start", "copy-done"):
                found += consumers(comp, user.name, index, depth + 1)
            elif user.op == "tuple" and user.root:  # leaves a wrapped computation: follow its callers' outputs
                position = user.operands.index(name)
                for caller_comp, caller in callers.get(comp, []):
                    if caller.op != "fusion":
                        found += consumers(caller_comp, caller.name, position, depth + 1)
            elif user.op == "tuple":
                found += consumers(comp, user.name, user.operands.index(name), depth + 1)
            else:
                found.append(user)
        return found

    counts = collections.Counter(i.op for instrs in computations.values() for i in instrs)
    calls = [(c, i) for c, instrs in computations.items() for i in instrs if i.target and re.search(targets, i.target)]
    side = {"feeding": collections.Counter(), "consuming": collections.Counter()}
    examples: dict[str, list[str]] = {"standalone": [], "in_fusion": []}
    seen = set()
    for comp, call in calls:
        neighbours = [("feeding", p) for operand in call.operands for p in producers(comp, operand)]
        neighbours += [("consuming", c) for c in consumers(comp, call.name)]
        for which, instr in neighbours:
            kind = classify(instr)
            if kind is None or (which, instr.name) in seen:
                continue
            seen.add((which, instr.name))
            side[which][kind] += 1
            if kind == "standalone":
                side[which]["standalone_bytes"] += instr.bytes
            arrow = f"{instr.op} -> {call.target}" if which == "feeding" else f"{call.target} -> {instr.op}"
            examples[kind].append(f"{arrow} {instr.name} ({instr.bytes / 2**20:.1f} MiB; {instr.op_name[-90:]})")
    in_attention = collections.Counter(
        i.op
        for instrs in computations.values()
        for i in instrs
        if i.op in _LAYOUT_OPS and re.search(r"attention|splash", i.op_name, re.I)
    )
    return {
        "transposes": counts["transpose"],
        "copies": counts["copy"],
        "attention_calls": len(calls),
        "attention_targets": sorted({call.target for _, call in calls}),
        **{which: {k: c[k] for k in ("standalone", "standalone_bytes", "in_fusion")} for which, c in side.items()},
        "examples": {kind: lines[:max_examples] for kind, lines in examples.items()},
        "traced_in_attention": {"transposes": in_attention["transpose"], "copies": in_attention["copy"]},
    }


def device_op_times(planes, hlo_text: str, steps: int, targets: str = ATTENTION_TARGETS) -> dict:
    """Per step, the device time of a profiler trace's XLA ops (`jax.profiler.ProfileData` planes of `steps` calls)
    and the attention kernels' part: the custom calls whose target matches `targets`, looked up by instruction name
    in the compiled HLO (`hlo_text`; a TPU trace names each op by its HLO line). A trace without a device "XLA Ops"
    line (the CPU's) gives `skipped`."""
    instructions = {i.name: i for comp in parse_hlo(hlo_text).values() for i in comp}
    total = attention = 0.0
    kernels: collections.Counter = collections.Counter()
    lines = 0
    for plane in planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            lines += 1
            for event in line.events:
                ms = event.duration_ns / 1e6 / steps
                total += ms
                name = event.name.split(" = ")[0].split()[-1].lstrip("%")
                instr = instructions.get(name)
                if instr is not None and instr.op == "custom-call" and re.search(targets, instr.target or ""):
                    attention += ms
                    kernels[re.sub(r"\.\d+$", "", name)] += ms
    if not lines:
        return {"skipped": "the trace has no device 'XLA Ops' line on this backend"}
    return {
        "device_ms": total,
        "attention_ms": attention,
        "attention_share": attention / total if total else None,
        "attention_kernels_ms": dict(kernels),
    }


def _traced_planes(run: Callable[[], object], calls: int, directory: str, options=None):
    """The planes of the JAX profiler's trace of `calls` calls of `run()`, written under `directory` (None if the
    profiler wrote no trace)."""
    with jax.profiler.trace(directory, profiler_options=options):
        for _ in range(calls):
            run()
    paths = sorted(pathlib.Path(directory).rglob("*.xplane.pb"))
    return jax.profiler.ProfileData.from_file(str(paths[0])).planes if paths else None


def profile_device_time(run_step: Callable[[], None], hlo_text: str, steps: int = 2) -> dict:
    """`device_op_times` of `steps` calls of `run_step` under the JAX profiler (`jax.profiler.trace`)."""
    with tempfile.TemporaryDirectory() as directory:
        planes = _traced_planes(run_step, steps, directory)
        return device_op_times(planes, hlo_text, steps) if planes else {"skipped": "the profiler wrote no trace"}


def _span_per_call(intervals: list[tuple[float, float]], calls: int) -> float:
    """Mean time from a call's first kernel start to its last kernel end: the calls are told apart by the
    `calls - 1` longest idle gaps (each call ends in a host synchronisation)."""
    intervals = sorted(intervals)
    ends = [max(end for _, end in intervals[: i + 1]) for i in range(len(intervals))]
    gaps = sorted(range(1, len(intervals)), key=lambda i: intervals[i][0] - ends[i - 1], reverse=True)[: calls - 1]
    bounds = [0] + sorted(gaps) + [len(intervals)]
    spans = [ends[b - 1] - intervals[a][0] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return sum(spans) / len(spans)


def kernel_profile(fn, args, calls: int = 10, plane_prefix: str = "/device:GPU:0", top: int = 25) -> dict:
    """Device time per call of `fn(*args)`, by kernel, from the trace of `calls` calls (compiled and warmed up first),
    each waited for; the Python tracer is off (its own cost would show as host time).

    Returns:
        {"kernels": [{"name", "launches", "us"}] (per call, longest first, at most `top`), "kernel_us",
         "span_us" (first kernel start to last kernel end), "launches"} — each per call. Span minus kernel time is
        where the device idles inside a call (launch gaps, host round trips); wall time minus span is dispatch.
    """
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    directory = tempfile.mkdtemp(prefix="attnlib_profile_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    planes = _traced_planes(lambda: jax.block_until_ready(fn(*args)), calls, directory, options)
    if planes is None:
        raise RuntimeError(f"the profiler wrote no trace under {directory}")
    time_by_name, launches, intervals = collections.Counter(), collections.Counter(), []
    for plane in planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            # A GPU plane has one line per stream (kernels and copies) plus lines that repeat the same time per XLA
            # op or module; only the stream lines are counted.
            if plane_prefix.startswith("/device:GPU") and not line.name.startswith("Stream"):
                continue
            for event in line.events:
                start, duration = float(event.start_ns), float(event.duration_ns)
                time_by_name[event.name] += duration
                launches[event.name] += 1
                intervals.append((start, start + duration))
    if not launches:
        raise RuntimeError(f"no events on a plane named {plane_prefix}* in the trace under {directory}")
    kernels = [
        {"name": name[:160], "launches": launches[name] / calls, "us": ns / calls / 1e3}
        for name, ns in time_by_name.most_common(top)
    ]
    return {
        "kernels": kernels,
        "kernel_us": sum(time_by_name.values()) / calls / 1e3,
        "span_us": _span_per_call(intervals, calls) / 1e3,
        "launches": sum(launches.values()) / calls,
    }


def kernel_table(name: str, profile: dict, top: int = 12) -> list[str]:
    """Text rows of one `kernel_profile`."""
    rows = [f"{name}: kernels {profile['kernel_us']:.1f} us in {profile['launches']:.0f} launches per call, "
            f"span {profile['span_us']:.1f} us (first kernel start to last kernel end)"]  # fmt: skip
    for kernel in profile["kernels"][:top]:
        rows.append(f"    {kernel['us']:9.1f} us  x{kernel['launches']:<5g} {kernel['name'][:100]}")
    return rows
