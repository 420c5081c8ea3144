"""What attnlib's flex kernel serves, with a reason for what it declines (pure Python over the configuration).

It serves, inside `pallas_tpu`, what splash declines: `score_mod` / `mask_mod` made of elementwise operations,
`bias` and boolean `mask` arrays, MLA (`Hv != H`), dropout, float32 at any requested matrix-product precision,
`deterministic_backward=True`, and per-row diagonal offsets (bottom-right causal / windows with padding lengths, keys
with their own packed structure); with everything splash serves besides (causal, windows, lengths, segments, THD,
GQA, sinks, soft cap, a runtime scale, `lse`).
"""

import numpy as np

from ....config import AttentionConfig
from .. import blocks
from . import elementwise


NAME = "attnlib's flex kernel"
DTYPES = (np.dtype("bfloat16"), np.dtype("float32"))
MAX_HEAD_DIM = 256
"""The largest head dim (after padding to 128 lanes) of a query/key or value block."""


def decline_reason(config: AttentionConfig) -> str | None:
    """Why the flex kernel cannot serve `config`, or None."""
    if config.layout == "paged":
        return "paged KV caches are served by JAX's paged kernels only"
    if config.fp8 is not None:
        return "FP8 attention (`fp8=`) is not supported"
    if config.dtype not in DTYPES:
        return f"{config.dtype} inputs are not supported: it runs bfloat16 and float32"
    for name, dim in (("H", config.head_dim), ("Hv", config.value_head_dim)):
        if blocks.round_up(dim, blocks.LANES) > MAX_HEAD_DIM:
            return f"head dim {name}={dim} is not supported: at most {MAX_HEAD_DIM}"
    if config.q_len == 0 or config.kv_len == 0:
        return f"empty sequences (T={config.q_len}, S={config.kv_len}) are not supported"
    mods = config.modifiers
    if mods is not None:
        if mods.has_traced_consts:
            return (
                "a `score_mod` / `mask_mod` closing over a value traced under `jit` is not supported (its value "
                "cannot be compiled into the kernel): pass it through `score_mod_args`"
            )
        for fn, closed in (("score_mod", mods.score_jaxpr), ("mask_mod", mods.mask_jaxpr)):
            op = elementwise.unsupported(closed)
            if op is not None:
                return f"`{fn}` uses {op}, which is not elementwise: the kernel evaluates it over whole blocks"
    return None
