"""Probe (GPU): does float32 -> float8_e4m3fn -> float32 round under `jax.jit` on the GPU? XLA may drop the round trip
(`xla_allow_excess_precision`); attnlib's `fp8.round_e4m3` puts an optimization barrier between the two converts.
Prints, for the plain round trip and attnlib's, how many of 1M values differ from ml_dtypes' rounding."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from attnlib._src import fp8


def main():
    x = jax.random.normal(jax.random.key(0), (1 << 20,), jnp.float32) * 3
    expected = np.asarray(x).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    plain = jax.jit(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32))
    for name, fn in (("plain round trip", plain), ("attnlib round_e4m3", jax.jit(fp8.round_e4m3))):
        got = np.asarray(fn(x))
        print(f"{jax.devices()[0].platform} {name}: {int(np.sum(got != expected))} of {x.size} differ from ml_dtypes")


if __name__ == "__main__":
    main()
