"""Which cuDNN plans serve the score-modifier graphs, with the autotuner's per-plan kernel times (H200 diagnostic).

Usage: python benchmarks/diag_score_mod_plans.py  (prints one line per graph: label, plan record)
"""

import jax
import jax.numpy as jnp

import attnlib
from attnlib._src.backends.cudnn import executor as dense


def main() -> None:
    q = jnp.zeros((4, 4096, 32, 128), jnp.bfloat16)
    k = v = jnp.zeros((4, 4096, 8, 128), jnp.bfloat16)
    calls = {
        "plain_causal": dict(is_causal=True),
        "softcap_causal": dict(is_causal=True, logits_soft_cap=50.0),
        "softcap_full": dict(logits_soft_cap=50.0),
        "prefix_lm": dict(mask_mod=lambda b, h, i, j: (j < 1024) | (j <= i)),
        "causal_as_mask_mod": dict(mask_mod=lambda b, h, i, j: j <= i),
    }
    for name, kw in calls.items():
        f = lambda q, k, v, kw=kw: jnp.sum(attnlib.attention(q, k, v, implementation="cudnn", **kw).astype(jnp.float32))
        jax.jit(jax.grad(f)).lower(q, k, v)
        print(name, flush=True)
    for key, entry in list(dense.CACHE._memory.items()):
        print(entry.label, "|", entry.plan, flush=True)


if __name__ == "__main__":
    main()
