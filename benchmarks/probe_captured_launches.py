"""GPU probe: why a CUDA graph of cuDNN's captured launches is slow to launch (docs/performance.md, "Graphs of
cuDNN's captured launches"; `benchmarks/results/probe_captured_launches_h200_2026-12-04.log`).

`probe_captured_launches.cc` reads a graph captured from cuDNN's launches — its nodes, their parameters and launch
attributes — and times `cuGraphLaunch` of graphs holding the same work made several ways (the captured graph
instantiated, cloned, as a child node; the same nodes added with `cuGraphAddKernelNode`; our own `cuLaunchKernel` of
them captured) and of our own direct launches: 100 and then 30 launches back to back, each launch's host time and
the wall clock per launch once the stream drained. It runs inside the native extension, on the graph the replay
cache captures, so it is not built by default. To run it:

1. add `../benchmarks/probe_captured_launches.cc` to the sources of `nanobind_add_module` in native/CMakeLists.txt;
2. in `GraphReplay::Capture` (native/src/graph_replay.cc), after `CaptureGraph(launch, &captured)` succeeded, call
   `ProbeCapturedLaunches(captured, nullptr, label)` when the environment variable ATTNLIB_PROBE_CAPTURED_LAUNCHES
   holds a label (declare `void ProbeCapturedLaunches(cudaGraph_t, cudaGraphExec_t, const char*);` in namespace
   attnlib);
3. build and run `python benchmarks/probe_captured_launches.py [small] [decode]` on the GPU.

The log was measured when the replay cache still instantiated the captured graph itself and passed that exec (the
`V1` / `V10` rows); with `nullptr`, `V4` (the captured graph instantiated by the probe) is the same graph.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attnlib


LABEL = "ATTNLIB_PROBE_CAPTURED_LAUNCHES"  # read by the probe's hook in the replay cache's capture


def run(label: str, fn, *args) -> None:
    """Calls jitted `fn` three times: the replay cache captures the graph call on the second (the probe runs then)."""
    os.environ[LABEL] = label
    f = jax.jit(fn)
    for _ in range(3):
        jax.block_until_ready(f(*args))
    os.environ.pop(LABEL)
    print(f"done {label}", flush=True)


def small(b: int, s: int, n: int, h: int) -> None:
    """A short causal forward (replayed by default)."""
    q, k, v = (jax.random.normal(key, (b, s, n, h), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
    attend = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
    run(f"small_b{b}_s{s}_d{h}", attend, q, k, v)


def decode(b: int, context: int) -> None:
    """One layer of bench_decode.py's dense decode step (GQA 32/8, d128, per-row lengths)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (b, 1, 32, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, context, 8, 128), jnp.bfloat16) for key in keys[1:])
    lengths = jnp.asarray(context - 17 * np.arange(b) % context, jnp.int32)
    attend = lambda q, k, v: attnlib.attention(  # noqa: E731
        q, k, v, key_value_seq_lengths=lengths, is_causal=True, diagonal_alignment="bottom_right",
        implementation="cudnn")  # fmt: skip
    run(f"decode_b{b}_ctx{context}", attend, x, k, v)


def main() -> None:
    which = sys.argv[1:] or ["small", "decode"]
    if "small" in which:
        small(2, 1024, 16, 64)
        small(8, 512, 16, 128)
    if "decode" in which:
        os.environ["ATTNLIB_CUDNN_GRAPH_REPLAY"] = "always"  # these calls are not short: replay them all the same
        decode(1, 32768)
        decode(1, 1024)
        decode(64, 8192)


if __name__ == "__main__":
    main()
