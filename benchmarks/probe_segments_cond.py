"""Probe (H200): what the `lax.cond` of packed rows without `max_segments_per_row` costs under `jit` — device
kernels and span (`kernel_profile.py`) of forward + backward with the default bound (behind the cond) and with the
same bound given (no cond), b4 · s4096 · 32/8 heads · d128, 8 segments per row; then the optimized HLO's transposes
and copies of large arrays, each with the computation that holds it (where the cond's extra kernels come from).

Usage: python benchmarks/probe_segments_cond.py
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from bench_cudnn import best_per_call  # run as a script: benchmarks/ is on sys.path
from kernel_profile import kernel_profile, table

import attnlib


def main() -> None:
    B, T, N, K, H = 4, 4096, 32, 8, 128
    ids = jnp.asarray(np.repeat(np.arange(1, 9), T // 8)[None].repeat(B, 0))
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k, v = (jax.random.normal(key, (B, T, K, H), jnp.bfloat16) for key in keys[1:3])
    do = jax.random.normal(keys[3], (B, T, N, H), jnp.bfloat16)
    for bound in (16, None):

        def fwd_bwd(q, k, v, ids, bound=bound):
            fwd = lambda q, k, v: attnlib.attention(q, k, v, q_segment_ids=ids, is_causal=True,  # noqa: E731
                                                    implementation="cudnn", max_segments_per_row=bound)
            return jax.vjp(fwd, q, k, v)[1](do)

        fn = jax.jit(fwd_bwd)
        wall = best_per_call(fn, (q, k, v, ids), loop=20, reps=5) * 1e6
        label = f"fwd+bwd max_segments_per_row={bound} wall {wall:.1f} us"
        print("\n".join(table(label, kernel_profile(fn, (q, k, v, ids), calls=10), top=16)), flush=True)
        hlo = fn.lower(q, k, v, ids).compile().as_text()
        print_large_moves(hlo, min_elements=B * T * K * H)
        if os.environ.get("ATTNLIB_HLO_DIR"):  # the whole module, for reading
            with open(os.path.join(os.environ["ATTNLIB_HLO_DIR"], f"segments_bound_{bound}.hlo.txt"), "w") as f:
                f.write(hlo)


def print_large_moves(hlo: str, min_elements: int) -> None:
    """Transposes and copies in `hlo` whose result holds at least `min_elements` elements."""
    computation = ""
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split("(")[0].strip()
        match = re.search(r"= \w+\[([\d,]*)\]\S* (transpose|copy|fusion)\(", line)
        if match and (match.group(2) != "fusion" or "transpose" in line or "copy" in line.split("calls=")[-1]):
            elements = math.prod(int(d) for d in match.group(1).split(",") if d)
            if elements >= min_elements:
                print(f"  [{computation[:60]}] {line.strip()[:220]}")


if __name__ == "__main__":
    main()
