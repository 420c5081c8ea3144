"""Probe (H200): the workspace each of a few cuDNN graphs' plans needs (`GraphEntry.workspace_bytes`).

A call gets a workspace result (a temporary buffer XLA allocates for each execution) only when its plan needs one
(`executor.ffi_graph_call`); this shows which of the benchmarks' graphs do: small forwards, their backward, decode
steps, a long backward.

Usage: python benchmarks/probe_workspace_sizes.py
"""

from attnlib._src.backends.cudnn import executor
from attnlib._src.backends.cudnn.graph_spec import GraphSpec


def spec(direction: str, b: int, t: int, s: int, n: int, k: int, h: int, causal: bool = True, **kw) -> GraphSpec:
    return GraphSpec(direction, "bfloat16", b, t, s, n, k, h, h, 0.1, right_bound=0 if causal else None, **kw)


DECODE = dict(causal=False, alignment="bottom_right", padding=True, stats=False)
GRAPHS = {
    "small_b2_s1024_fwd_nostats": spec("fwd", 2, 1024, 1024, 16, 16, 64, stats=False),
    "small_b2_s1024_fwd": spec("fwd", 2, 1024, 1024, 16, 16, 64),
    "small_b2_s1024_bwd": spec("bwd", 2, 1024, 1024, 16, 16, 64),
    "small_b8_s512_fwd_nostats": spec("fwd", 8, 512, 512, 16, 16, 128, stats=False),
    "decode_b1_1k": spec("fwd", 1, 1, 1024, 32, 8, 128, **DECODE),
    "decode_b1_32k": spec("fwd", 1, 1, 32768, 32, 8, 128, **DECODE),
    "mha_b4_s4096_bwd": spec("bwd", 4, 4096, 4096, 32, 32, 128),
}


def main() -> None:
    for name, graph in GRAPHS.items():
        try:
            print(f"{name:30s} workspace {executor.get_entry(graph).workspace_bytes} bytes", flush=True)
        except Exception as e:  # noqa: BLE001  (reported, not fatal)
            print(f"{name:30s} error {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
