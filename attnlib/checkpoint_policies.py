"""`jax.checkpoint` (remat) policies for models built on attnlib. See `docs/performance.md#remat`."""

from ._src.checkpoint_policies import save_attention as save_attention
