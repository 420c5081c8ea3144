"""Dropout: determinism per key, keep-rate statistics, and the same mask forward and backward.

The mask the forward pass applied is read back exactly from the output: with `q = 0` every logit is 0, so a row
with `S` visible keys has `p_j = 1/S`; with `value = identity` (`Hv = S`, one kv head) the output is
`out[b, i, n, j] = keep[b, n, i, j] / ((1 - rate) S)`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HV, lengths, N, normal, qkv, S, T, to_f64
from reference import reference_attention

import attnlib
from attnlib._src.dropout import dropout_keep_mask


def applied_mask(impl, key, rate, *, b=2, n=N, t=T, s=S, thd=False):
    """The keep mask `[b, n, t, s]` the forward pass of `impl` applied, read back from its output."""
    if thd:
        q = jnp.zeros((t, n, 4), jnp.float32)
        k = jnp.zeros((s, 1, 4), jnp.float32)
        v = jnp.eye(s, dtype=jnp.float32)[:, None, :]
        f = lambda q, k, v, cq, ck, key: attnlib.attention(
            q, k, v, cu_seqlens_q=cq, cu_seqlens_kv=ck, dropout_rate=rate, dropout_key=key, implementation=impl
        )
        out = jax.jit(f)(q, k, v, lengths([0, t]), lengths([0, s]), key)
        out = out[None]
    else:
        q = jnp.zeros((b, t, n, 4), jnp.float32)
        k = jnp.zeros((b, s, 1, 4), jnp.float32)
        v = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :], (b, s, 1, s))
        f = lambda q, k, v, key: attnlib.attention(q, k, v, dropout_rate=rate, dropout_key=key, implementation=impl)
        out = jax.jit(f)(q, k, v, key)
    scaled = np.asarray(out, np.float64) * (1 - rate) * s  # 1 where kept, 0 where dropped
    assert np.allclose(scaled, np.round(scaled), atol=1e-4), "output is not a scaled 0/1 mask"
    return np.transpose(np.round(scaled).astype(bool), (0, 2, 1, 3))  # [b, t, n, s] -> [b, n, t, s]


# ------------------------------------------------------------------------------------------------------------------
# determinism


def test_same_key_same_output_and_mask(impl):
    q, k, v = qkv(np.random.default_rng(0), hv=HV)
    f = jax.jit(lambda key: attnlib.attention(q, k, v, dropout_rate=0.4, dropout_key=key, implementation=impl))
    a, b = f(jax.random.key(1)), f(jax.random.key(1))
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # eager (un-jitted) gives the same numbers too
    c = attnlib.attention(q, k, v, dropout_rate=0.4, dropout_key=jax.random.key(1), implementation=impl)
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-6, atol=1e-6)
    m1 = applied_mask(impl, jax.random.key(1), 0.4)
    m2 = applied_mask(impl, jax.random.key(1), 0.4)
    np.testing.assert_array_equal(m1, m2)


def test_different_key_different_output(impl):
    q, k, v = qkv(np.random.default_rng(0), hv=HV)
    f = jax.jit(lambda key: attnlib.attention(q, k, v, dropout_rate=0.4, dropout_key=key, implementation=impl))
    a, b = np.asarray(f(jax.random.key(1))), np.asarray(f(jax.random.key(2)))
    assert not np.allclose(a, b)
    m1 = applied_mask(impl, jax.random.key(1), 0.4)
    m2 = applied_mask(impl, jax.random.key(2), 0.4)
    # two independent masks with keep 0.6 agree on ~52% of entries, never all
    agree = (m1 == m2).mean()
    assert 0.4 < agree < 0.65, agree


def test_raw_uint32_key_accepted(impl):
    # old-style raw keys (uint32[2]) and new-style typed keys are both PRNG keys
    q, k, v = qkv(np.random.default_rng(0), hv=HV)
    out = attnlib.attention(q, k, v, dropout_rate=0.4, dropout_key=jax.random.PRNGKey(3), implementation=impl)
    assert np.isfinite(np.asarray(out)).all()


def test_applied_mask_is_the_documented_mask(impl):
    # the forward pass applies `dropout_keep_mask(key, rate, (B, N, T, S))`, the mask tests feed to the reference
    key, rate = jax.random.key(5), 0.3
    got = applied_mask(impl, key, rate)
    want = np.asarray(dropout_keep_mask(key, rate, (2, N, T, S)))
    np.testing.assert_array_equal(got, want)


def test_applied_mask_thd(impl):
    key, rate = jax.random.key(6), 0.25
    got = applied_mask(impl, key, rate, thd=True)
    want = np.asarray(dropout_keep_mask(key, rate, (1, N, T, S)))
    np.testing.assert_array_equal(got, want)


def _murmur_chain_numpy(seeds, rate, b, n, i, j):
    """The documented mask from its definition, in NumPy uint32 arithmetic: MurmurHash3's finaliser chained over the
    batch row, head, query and key (each word `index * odd constant + constant`), kept where the hash >= rate * 2^32."""

    def fmix(x):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        return x ^ (x >> np.uint32(16))

    u = lambda x: np.asarray(x, np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = fmix(seeds[0] ^ fmix(u(b) * np.uint32(0x9E3779B1) + seeds[1]))
        h = fmix(h ^ (u(n) * np.uint32(0x85EBCA77) + np.uint32(0x27D4EB2F)))
        h = fmix(h ^ (u(i) * np.uint32(0xC2B2AE3D) + np.uint32(0x165667B1)))
        h = fmix(h ^ (u(j) * np.uint32(0x27D4EB2F) + np.uint32(0x9E3779B1)))
    return h >= np.uint32(min(round(rate * 2.0**32), 2**32 - 1))


def test_the_mask_is_the_murmur_chain_it_is_defined_as():
    """`dropout_keep_mask` (whose hash applies the finaliser's first xor-shift to each side before they meet) equals
    the chain computed from its definition in NumPy, bit for bit."""
    from attnlib._src.dropout import dropout_seeds

    key, rate, shape = jax.random.key(11), 0.3, (3, 5, 41, 67)
    seeds = np.asarray(dropout_seeds(key))
    b, n, i, j = np.ix_(*(np.arange(d) for d in shape))
    want = _murmur_chain_numpy(seeds, rate, b, n, i, j)
    np.testing.assert_array_equal(np.asarray(dropout_keep_mask(key, rate, shape)), want)


def test_implementations_share_the_mask():
    # documented in attnlib._src.dropout: the plain-JAX implementations drop the same probabilities for one key
    key, rate = jax.random.key(8), 0.5
    np.testing.assert_array_equal(applied_mask("xla", key, rate), applied_mask("xla_chunked", key, rate))


def test_rate_zero_with_key_is_no_dropout(impl):
    q, k, v = qkv(np.random.default_rng(0), hv=HV)
    a = attnlib.attention(q, k, v, dropout_rate=0.0, dropout_key=jax.random.key(1), implementation=impl)
    b = attnlib.attention(q, k, v, implementation=impl)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------------------------
# statistics of the mask


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_statistics(rate):
    shape = (3, 5, 61, 67)
    keep = np.asarray(dropout_keep_mask(jax.random.key(42), rate, shape))
    n = keep.size
    p = 1 - rate
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - p) < 5 * sigma, (keep.mean(), p, sigma)
    # neighbours along every axis are independent: P(keep and keep') = p**2
    for axis in range(4):
        a = np.take(keep, range(keep.shape[axis] - 1), axis=axis)
        b = np.take(keep, range(1, keep.shape[axis]), axis=axis)
        both = (a & b).mean()
        m = a.size
        sigma2 = math.sqrt(p**2 * (1 - p**2) / m)
        assert abs(both - p**2) < 5 * sigma2, (axis, both, p**2)
    # every (batch, head) slice differs: the mask is not broadcast over batch rows or heads
    flat = keep.reshape(shape[0] * shape[1], -1)
    assert len({row.tobytes() for row in flat}) == flat.shape[0]


def test_output_keep_rate_statistics(impl):
    # the mask read back from the output has the requested keep rate
    rate = 0.3
    keep = applied_mask(impl, jax.random.key(9), rate, b=3, n=5, t=29, s=31)
    p = 1 - rate
    sigma = math.sqrt(p * (1 - p) / keep.size)
    assert abs(keep.mean() - p) < 5 * sigma


def test_dropout_expectation_is_no_dropout():
    # E[out] over keys equals the undropped output (inverted dropout scales kept probabilities by 1/(1-rate))
    q, k, v = qkv(np.random.default_rng(3), batch=(1,), t=3, s=5, n=2, k=1, h=4, hv=3)
    f = jax.jit(
        jax.vmap(lambda key: attnlib.attention(q, k, v, dropout_rate=0.5, dropout_key=key, implementation="xla"))
    )
    outs = np.asarray(f(jax.random.split(jax.random.key(0), 4000)), np.float64)
    plain = np.asarray(attnlib.attention(q, k, v, implementation="xla"), np.float64)
    stderr = outs.std(0) / math.sqrt(outs.shape[0])
    assert (np.abs(outs.mean(0) - plain) < 5 * stderr + 1e-6).all()


# ------------------------------------------------------------------------------------------------------------------
# the same mask forward and backward: gradients vs finite differences of the forward with the same key


def _dropout_problem():
    r = np.random.default_rng(12)
    q, k, v = qkv(r, t=7, s=11, hv=HV)
    bias = normal(r, (N, 7, 11))
    sinks = normal(r, (N,))
    cot = normal(r, (2, 7, N, HV))
    return dict(query=q, key=k, value=v, bias=bias, sinks=sinks), cot


@functools.cache
def _dropout_fns(impl, rate=0.4):
    """Jitted `loss(args, key, cot)` and its gradient, cached per implementation (key traced)."""

    def loss(a, key, cot):
        out = attnlib.attention(a["query"], a["key"], a["value"], a["bias"], sinks=a["sinks"], is_causal=True,
                                diagonal_alignment="bottom_right", dropout_rate=rate, dropout_key=key,
                                implementation=impl)  # fmt: skip
        return jnp.sum(out * cot)

    return jax.jit(loss), jax.jit(jax.grad(loss))


def _directional_fd(loss, args, direction, h):
    plus = jax.tree.map(lambda x, d: x + h * d, args, direction)
    minus = jax.tree.map(lambda x, d: x - h * d, args, direction)
    return (float(loss(plus)) - float(loss(minus))) / (2 * h)


@pytest.mark.parametrize("name", ["query", "key", "value", "bias", "sinks"])
def test_gradient_matches_finite_differences_same_key(impl, name):
    args, cot = _dropout_problem()
    key = jax.random.key(21)
    loss_fn, grad_fn = _dropout_fns(impl)
    grad = grad_fn(args, key, cot)
    r = np.random.default_rng(sum(map(ord, name)))
    direction = {n: jnp.zeros_like(x) for n, x in args.items()}
    direction[name] = normal(r, args[name].shape)
    # float32 central differences, step h: truncation ~ h**2 |L'''|, rounding ~ eps |L| / h; h = 1e-2 balances
    # both at ~1e-4 relative to the directional derivative (|L| ~ 10, derivative ~ 10..100).
    h = 1e-2
    fd = _directional_fd(lambda a: loss_fn(a, key, cot), args, direction, h)
    an = float(jnp.sum(grad[name] * direction[name]))
    assert abs(an - fd) <= 2e-3 * max(1.0, abs(fd)), (an, fd)

    # the check has power: the gradient of the same loss under a *different* key does not match
    other = grad_fn(args, jax.random.key(22), cot)
    an_other = float(jnp.sum(other[name] * direction[name]))
    assert abs(an_other - fd) > 2e-3 * max(1.0, abs(fd)) * 10, (an_other, fd)


def test_forward_matches_reference_with_library_mask(impl):
    # out with dropout equals the float64 reference fed the library's mask (conformance checks the gradients)
    args, _ = _dropout_problem()
    key, rate = jax.random.key(31), 0.4
    out = attnlib.attention(args["query"], args["key"], args["value"], args["bias"], sinks=args["sinks"],
                            dropout_rate=rate, dropout_key=key, implementation=impl)  # fmt: skip
    keep = np.asarray(dropout_keep_mask(key, rate, (2, N, 7, 11)))
    ref, _ = reference_attention(to_f64(args["query"]), to_f64(args["key"]), to_f64(args["value"]),
                                 to_f64(args["bias"]), sinks=to_f64(args["sinks"]), dropout_rate=rate,
                                 dropout_keep=keep)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-5)
