"""Dropout masks for the plain-JAX implementations.

The keep mask is a pure function of `(dropout_key, b, n, i, j)`: a counter-based hash of the flattened batch index
`b`, query head `n`, query token `i` and key token `j`. Any block of it can be generated on its own, so the chunked
implementation and the materialising one drop exactly the same probabilities, forward and backward, for one key.
(The cuDNN implementation uses cuDNN's Philox generator: same rate, different mask.)
"""

import jax
import jax.numpy as jnp


def _xorshift16(x: jax.Array) -> jax.Array:
    return x ^ (x >> 16)


def _fmix32_after_xorshift(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser (a bijective avalanche mix of uint32 words) after its first step, `x ^ x>>16`."""
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return _xorshift16(x)


def _fmix32(x: jax.Array) -> jax.Array:
    return _fmix32_after_xorshift(_xorshift16(x))


def _mix(h: jax.Array, word: jax.Array) -> jax.Array:
    """`_fmix32(h ^ word)`. The first step distributes over `^` (`(a ^ b) >> 16 == (a >> 16) ^ (b >> 16)`), so it runs
    on each side at its own size: a per-row `h` against per-key words pays it once per row and once per key, not per
    (row, key) pair (in the flex kernel, two fewer operations per element of a tile)."""
    return _fmix32_after_xorshift(_xorshift16(h) ^ _xorshift16(word))


def dropout_seeds(dropout_key: jax.Array) -> jax.Array:
    """Two uint32 seed words `[2]` derived from a (typed or raw) PRNG key."""
    return jax.random.bits(dropout_key, (2,), jnp.uint32)


def keep_mask_from_seeds(
    seeds: jax.Array,
    rate: float,
    batch_index: jax.Array,
    head_index: jax.Array,
    q_index: jax.Array,
    k_index: jax.Array,
) -> jax.Array:
    """Which probabilities survive dropout; the index arrays broadcast against each other.

    Args:
        seeds: uint32 `[2]` from `dropout_seeds`.
        rate: the dropout probability in `[0, 1)`.
        batch_index, head_index, q_index, k_index: integer arrays of flattened batch row, query head, query token
            and key token indices.

    Returns:
        Boolean array of the broadcast shape; True = kept.
    """
    u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
    h = _mix(seeds[0], _fmix32(u32(batch_index) * jnp.uint32(0x9E3779B1) + seeds[1]))
    h = _mix(h, u32(head_index) * jnp.uint32(0x85EBCA77) + jnp.uint32(0x27D4EB2F))
    h = _mix(h, u32(q_index) * jnp.uint32(0xC2B2AE3D) + jnp.uint32(0x165667B1))
    h = _mix(h, u32(k_index) * jnp.uint32(0x27D4EB2F) + jnp.uint32(0x9E3779B1))
    threshold = min(int(round(rate * 2.0**32)), 2**32 - 1)
    return h >= jnp.uint32(threshold)


def dropout_keep_mask(dropout_key: jax.Array, rate: float, shape: tuple[int, int, int, int]) -> jax.Array:
    """The whole keep mask `[B, N, T, S]` of a call (flattened `*B`; THD: `B = 1` and token indices).

    Tests use it to feed the same mask to an independent reference.
    """
    B, N, T, S = shape
    b = jnp.arange(B)[:, None, None, None]
    n = jnp.arange(N)[None, :, None, None]
    i = jnp.arange(T)[None, None, :, None]
    j = jnp.arange(S)[None, None, None, :]
    return keep_mask_from_seeds(dropout_seeds(dropout_key), rate, b, n, i, j)
