"""Probe (issue 17): does XLA capture attnlib's cuDNN graph call into command buffers (CUDA graphs)?

Runs the 32-layer paged decode step of `bench_decode.py` (b1 · 1k context, the shape where per-call host time shows)
in a fresh process per setting, and reports the step time, the number of `command_buffer` computations in the
optimized HLO, and every line of XLA's dump and log that mentions command buffers and the custom call. Settings: the
default flags, ATTNLIB_CUDNN_COMMAND_BUFFER=0, and XLA flags that lower the minimum graph size and add WHILE.

Usage: python benchmarks/probe_command_buffers.py [VARIANT [SETTING ...]]   (VARIANT of bench_decode.layer_fns,
default attnlib_paged; SETTING names below, default all)
"""

import glob
import os
import re
import subprocess
import sys
import tempfile


CHILD = r"""
import re, sys, jax, jax.numpy as jnp
from bench_cudnn import best_per_call
from bench_decode import _inputs, decode_step, layer_fns
x, k, v, lengths, kp, vp, table = _inputs(1, 1024)
variant = sys.argv[1]
cache = (kp, vp) if variant == "attnlib_paged" else (k, v)
step = decode_step(layer_fns(lengths, table)[variant], 32)
text = step.lower(x, *cache).compile().as_text()
blocks = [b for b in re.split(r"\n(?=\S)", text) if "command_buffer" in b.split("\n", 1)[0]]
print("HLO command_buffer computations:", len(blocks), "custom calls in them:",
      sum(b.count("attnlib_cudnn_graph") for b in blocks))
print("step ms: %.3f" % (1e3 * min(best_per_call(step, (x, *cache), loop=20, reps=5) for _ in range(3))))
"""

SETTINGS = {
    "default": ({}, ""),
    "attnlib_trait_off": ({"ATTNLIB_CUDNN_COMMAND_BUFFER": "0"}, ""),
    "min_graph_1": ({}, "--xla_gpu_graph_min_graph_size=1"),
    "min_graph_1_while": (
        {},
        "--xla_gpu_graph_min_graph_size=1 "
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL",
    ),
}


def main():
    variant = sys.argv[1] if len(sys.argv) > 1 else "attnlib_paged"
    names = sys.argv[2:] or list(SETTINGS)
    for name in names:
        env_extra, flags = SETTINGS[name]
        dump = tempfile.mkdtemp()
        env = dict(os.environ, **env_extra, TF_CPP_MIN_LOG_LEVEL="0",
                   TF_CPP_VMODULE="command_buffer_scheduling=2,command_buffer_conversion_pass=2,command_buffer_thunk=1",
                   XLA_FLAGS=f"{flags} --xla_dump_to={dump}".strip())  # fmt: skip
        argv = [sys.executable, "-c", CHILD, variant]
        run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
        print(f"=== {variant}, {name}: XLA_FLAGS={flags!r} {env_extra}")
        print("\n".join(line for line in run.stdout.splitlines()))
        module, log = "", []
        for line in run.stderr.splitlines():
            found = re.search(r"Module (\S+) CommandBufferConfig", line)
            module = found.group(1) if found else module
            if "step" in module and re.search(r"(?i)command.?buffer|attnlib_cudnn_graph|thunk", line):
                log.append(line)
        print(f"log lines of the step's module: {len(log)}")
        for line in log[:40]:
            print("  log:", line[:300])
        hits = {}
        for path in glob.glob(f"{dump}/*"):
            if "step" not in os.path.basename(path) or not os.path.isfile(path):
                continue
            with open(path, errors="replace") as f:
                for line in f:
                    if re.search(r"(?i)command.?buffer", line):
                        hits.setdefault(os.path.basename(path), []).append(line.strip()[:200])
        for path, lines in sorted(hits.items())[:6]:
            print(f"  dump {path}: {len(lines)} lines, e.g. {lines[:3]}")
        if run.returncode:
            print("  FAILED:", run.stderr[-1500:])


if __name__ == "__main__":
    main()
