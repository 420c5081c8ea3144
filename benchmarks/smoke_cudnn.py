"""Smallest end-to-end check of the cuDNN path: one forward and one backward call (for debugging on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np

import attnlib


q = jax.random.normal(jax.random.key(0), (2, 128, 4, 64), jnp.float32).astype(jnp.bfloat16)
f = jax.jit(lambda q: attnlib.attention(q, q, q, is_causal=True, implementation="cudnn"))
out = f(q)
ref = attnlib.attention(q.astype(jnp.float32), q.astype(jnp.float32), q.astype(jnp.float32), is_causal=True,
                        implementation="xla")
print("forward max |err|", float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))))
g = jax.jit(jax.grad(lambda q: jnp.sum(attnlib.attention(q, q, q, is_causal=True, implementation="cudnn")
                                       .astype(jnp.float32))))(q)
print("backward finite", bool(np.isfinite(np.asarray(g, np.float32)).all()))
