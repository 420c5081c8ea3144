"""Per-kernel device time of a jitted call, from JAX's own profiler (CUPTI on a GPU; no Nsight needed).

`kernel_profile(fn, args, calls)` runs `fn(*args)` `calls` times under `jax.profiler.trace`, reads the trace back
with `jax.profiler.ProfileData`, and returns, per call: the device time of each kernel (summed over its launches),
the sum of all kernel time, and the span from the call's first kernel start to its last kernel end. Span minus kernel
time is where the device idles inside a call (launch gaps, host round trips); wall time minus span is dispatch.
"""

import collections
import glob
import math
import tempfile

import jax


def _events(path: str, plane_prefix: str):
    data = jax.profiler.ProfileData.from_file(path)
    for plane in data.planes:
        if not plane.name.startswith(plane_prefix):
            continue
        for line in plane.lines:
            # A GPU plane has one line per stream (kernels and copies) plus lines that repeat the same time per XLA
            # op or module; only the stream lines are counted.
            if plane_prefix.startswith("/device:GPU") and not line.name.startswith("Stream"):
                continue
            for event in line.events:
                yield line.name, event.name, float(event.start_ns), float(event.duration_ns)


def _span_per_call(intervals: list[tuple[float, float]], calls: int) -> float:
    """Mean time from a call's first kernel start to its last kernel end: the calls are told apart by the
    `calls - 1` longest idle gaps (each call ends in a host synchronisation)."""
    intervals = sorted(intervals)
    ends = [max(end for _, end in intervals[: i + 1]) for i in range(len(intervals))]
    gaps = sorted(range(1, len(intervals)), key=lambda i: intervals[i][0] - ends[i - 1], reverse=True)[: calls - 1]
    bounds = [0] + sorted(gaps) + [len(intervals)]
    spans = [ends[b - 1] - intervals[a][0] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return sum(spans) / len(spans)


def _trace(fn, args, calls: int, back_to_back: bool) -> str:
    """Path of the XPlane trace of `calls` calls of `fn(*args)` (compiled and warmed up first), each waited for or
    all dispatched back to back then waited for; the Python tracer is off (its own cost would show as host time)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    directory = tempfile.mkdtemp(prefix="attnlib_profile_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(directory, profiler_options=options):
        out = None
        for _ in range(calls):
            out = fn(*args)
            if not back_to_back:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
    paths = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {directory}")
    return paths[0]


def kernel_profile(fn, args, calls: int = 10, plane_prefix: str = "/device:GPU:0", top: int = 25) -> dict:
    """Device time per call of `fn(*args)`, by kernel.

    Returns:
        {"kernels": [{"name", "launches", "us"}] (per call, longest first, at most `top`), "kernel_us",
         "span_us" (first kernel start to last kernel end), "launches"} — each per call.
    """
    path = _trace(fn, args, calls, back_to_back=False)
    time_by_name = collections.Counter()
    launches = collections.Counter()
    intervals = []
    for _, name, start, duration in _events(path, plane_prefix):
        time_by_name[name] += duration
        launches[name] += 1
        intervals.append((start, start + duration))
    if not launches:
        raise RuntimeError(f"no events on a plane named {plane_prefix}* in {path}")
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


def table(name: str, profile: dict, top: int = 12) -> list[str]:
    """Text rows of one profile."""
    rows = [f"{name}: kernels {profile['kernel_us']:.1f} us in {profile['launches']:.0f} launches per call, "
            f"span {profile['span_us']:.1f} us (first kernel start to last kernel end)"]  # fmt: skip
    for kernel in profile["kernels"][:top]:
        rows.append(f"    {kernel['us']:9.1f} us  x{kernel['launches']:<5g} {kernel['name'][:100]}")
    return rows


def pipelined_profile(fn, args, calls: int = 30, host_top: int = 12) -> dict:
    """Device busy and idle time per call when `calls` calls are dispatched back to back (as a training loop or the
    benchmarks' `best_per_call` do), plus the host events that take the most time per call.

    Returns:
        {"busy_us" (kernel time per call), "span_us" (first kernel start to last kernel end, divided by `calls`),
         "idle_us" (span minus busy: the device waiting for the host), "host": [{"name", "count", "us"}] per call,
         "gaps": the idle time between kernels per transition, [{"after", "before", "count", "us"}] per call}.
    """
    path = _trace(fn, args, calls, back_to_back=True)
    intervals = [(start, start + duration) for _, _, start, duration in _events(path, "/device:GPU:0")]
    if not intervals:
        raise RuntimeError(f"no GPU events in {path}")
    busy = sum(end - start for start, end in intervals)
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    kernels = sorted((start, start + duration, name) for _, name, start, duration in _events(path, "/device:GPU:0"))
    host_time, host_count = collections.Counter(), collections.Counter()
    for _, name, _, duration in _events(path, "/host:CPU"):
        host_time[name] += duration
        host_count[name] += 1
    host = [
        {"name": name[:120], "count": host_count[name] / calls, "us": ns / calls / 1e3}
        for name, ns in host_time.most_common(host_top)
    ]
    return {
        "busy_us": busy / calls / 1e3,
        "span_us": span / calls / 1e3,
        "idle_us": (span - busy) / calls / 1e3,
        "host": host,
        "gaps": _gaps(kernels, calls),
    }


def _gaps(events: list[tuple[float, float, str]], calls: int, top: int = 8) -> list[dict]:
    """The device's idle time between consecutive kernels, per (kernel before, kernel after) pair, per call, longest
    first: which transition of a call the device waits at."""
    total, count = collections.Counter(), collections.Counter()
    end = -math.inf
    for previous, (start, _, name) in zip(events[:-1], events[1:]):
        end = max(end, previous[1])
        if start > end:
            key = (previous[2][:48], name[:48])
            total[key] += start - end
            count[key] += 1
    return [{"after": after, "before": before, "count": count[(after, before)] / calls, "us": ns / calls / 1e3}
            for (after, before), ns in total.most_common(top)]  # fmt: skip


def event_rows(pipelined: dict, kernels: dict, top_kernels: int) -> list[str]:
    """Text rows of a `pipelined_profile`'s host events and a `kernel_profile`'s longest kernels."""
    rows = [f"    host   {e['us']:8.1f} us  x{e['count']:<6.3g} {e['name']}" for e in pipelined["host"]]
    rows += [f"    gap    {g['us']:8.1f} us  x{g['count']:<6.3g} {g['after']} -> {g['before']}"
             for g in pipelined["gaps"]]  # fmt: skip
    return rows + [f"    kernel {k['us']:8.1f} us  x{k['launches']:<5g} {k['name'][:96]}"
                   for k in kernels["kernels"][:top_kernels]]  # fmt: skip
