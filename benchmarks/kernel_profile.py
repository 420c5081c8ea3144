"""Per-kernel device time of a jitted call, from JAX's own profiler (CUPTI on a GPU; no Nsight needed).

`kernel_profile(fn, args, calls)` runs `fn(*args)` `calls` times under `jax.profiler.trace`, reads the trace back
with `jax.profiler.ProfileData`, and returns, per call: the device time of each kernel (summed over its launches),
the sum of all kernel time, and the span from the call's first kernel start to its last kernel end. Span minus kernel
time is where the device idles inside a call (launch gaps, host round trips); wall time minus span is dispatch.
"""

import collections
import glob
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


def _trace(fn, args, calls: int) -> str:
    """Path of the XPlane trace of `calls` calls of `fn(*args)` (compiled and warmed up first), each waited for; the
    Python tracer is off (its own cost would show as host time)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    directory = tempfile.mkdtemp(prefix="attnlib_profile_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(directory, profiler_options=options):
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
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
    path = _trace(fn, args, calls)
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
