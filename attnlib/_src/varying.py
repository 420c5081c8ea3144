"""Loop carries and custom-VJP inputs that vary like their inputs, so plain-JAX loops work inside `shard_map`.

Inside `shard_map`, a computation's results vary over the mesh axes its inputs vary over. A loop carry started from a
constant (`jnp.zeros`) does not, and `fori_loop` rejects the mismatch; a replicated input of a `custom_vjp` whose
cotangent comes out varying is rejected likewise. Adding a zero computed from every varying input gives a value
exactly the inputs' variation (JAX then reduces the cotangent of a replicated input itself). Outside `shard_map`
nothing varies and values pass through untouched.
"""

import jax
import jax.numpy as jnp


def varying_axes(x) -> frozenset | None:
    """The manual mesh axes `x` varies over (empty outside `shard_map`; None when this JAX does not say)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)
    return None if vma is None else frozenset(vma)


def like_inputs(values, *inputs):
    """`values` (a pytree of arrays), made to vary over every mesh axis that some array leaf of `inputs` varies over."""
    varying_leaves = []
    for leaf in jax.tree.leaves(inputs):
        axes = varying_axes(leaf)
        if axes is None or axes:
            varying_leaves.append(leaf)
    if not varying_leaves:
        return values
    zero = jnp.zeros((), jnp.float32)
    for leaf in varying_leaves:
        zero = zero + jnp.sum(jnp.ravel(leaf)[:0]).astype(jnp.float32)
    return jax.tree.map(lambda x: x + zero.astype(x.dtype), values)


def vary_over(x, names):
    """`x` typed as varying over the mesh axes `names` (a no-op for axes it already varies over)."""
    have = varying_axes(x)
    missing = () if have is None else tuple(sorted((n for n in names if n not in have), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def union_axes(*trees) -> frozenset:
    """Every mesh axis some array leaf of `trees` varies over."""
    names: frozenset = frozenset()
    for leaf in jax.tree.leaves(trees):
        names |= varying_axes(leaf) or frozenset()
    return names


def match(cotangent, primal):
    """`cotangent` made to vary over every axis `primal` varies over (VJP functions demand equal types)."""
    return jax.tree.map(lambda c, p: vary_over(c, varying_axes(p) or ()), cotangent, primal)
