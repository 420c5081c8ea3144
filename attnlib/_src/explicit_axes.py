"""Values typed with the shardings they meet, so plain-JAX loops and `vmap`s work under explicit mesh axes.

Under a mesh whose axes are `jax.sharding.AxisType.Explicit` ("sharding in types"), an array's type includes its
sharding, and JAX demands equal types where values meet: a `fori_loop`'s init carry and its body's output, the
operand and update of `dynamic_update_slice` or a scatter, the dimensions `vmap` (and `jnp.vectorize`) maps over
together. A buffer made by `jnp.zeros` is replicated, while what attention computes from `query`, `key` and `value` is
split as they are (batch and heads). The helpers here retype a value with `jax.sharding.reshard` to the sharding of
the value it meets (no data moves where the two already agree), name the result's sharding of a contraction JAX
cannot infer, or run code whose ops have no single sharding typing on automatic axes (`jax.sharding.auto_axes`).
Under automatic axes, with no mesh, or inside `shard_map`, types carry no sharding and every helper returns its input
unchanged (`varying.py` is the analogue for `shard_map`'s varying axes).
"""

import jax
import jax.numpy as jnp


def is_explicit(x) -> bool:
    """Whether `x`'s type carries a sharding over explicit mesh axes."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types


def any_explicit(*trees) -> bool:
    """Whether some array leaf of `trees` is typed with explicit axes."""
    return any(is_explicit(leaf) for leaf in jax.tree.leaves(trees))


def to_sharding(x: jax.Array, sharding) -> jax.Array:
    """`x` typed with `sharding` (a `NamedSharding` on explicit axes); unchanged when it has it already."""
    if jax.typeof(x).sharding == sharding:
        return x
    return jax.sharding.reshard(x, sharding)


def like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` typed with the sharding of `ref` (same rank) when `ref`'s type has explicit axes; else `x` unchanged."""
    return to_sharding(x, jax.typeof(ref).sharding) if is_explicit(ref) else x


def fori_loop(num_steps: int, body, init, *inputs):
    """`jax.lax.fori_loop(0, num_steps, body, init)` with each init carry typed as `body` returns it.

    When some array of `inputs` (what the body reads) is typed with explicit axes, the body is evaluated abstractly
    once (`jax.eval_shape`) and each carry resharded to the sharding of its output: a replicated `jnp.zeros` buffer
    then starts split like the values the body accumulates into it. The body must type its outputs by what it
    computes, not by the carries it receives (`tiles.set_rows` / `tiles.add_at` retype their buffer to the update's).
    """
    if any_explicit(inputs):
        out = jax.eval_shape(body, jnp.zeros((), jnp.int32), init)
        init = jax.tree.map(lambda x, o: to_sharding(x, o.sharding), init, out)
    return jax.lax.fori_loop(0, num_steps, body, init)


def sharding_like(ref: jax.Array, shape: tuple[int, ...]) -> jax.sharding.NamedSharding | None:
    """The sharding of `ref` (of the same rank as `shape`) on each dimension of `shape` that is not 1 (a broadcast
    dimension is whole); None unless `ref`'s type has explicit axes."""
    if not is_explicit(ref):
        return None
    sharding = jax.typeof(ref).sharding
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    out = jax.sharding.PartitionSpec(*(s if d != 1 else None for s, d in zip(spec, shape, strict=True)))
    return jax.sharding.NamedSharding(sharding.mesh, out)


def on_automatic_axes(fn, *operands, out_sharding: jax.sharding.NamedSharding | None):
    """`fn(*operands)` computed with the mesh's explicit axes made automatic (`jax.sharding.auto_axes`), its result
    typed with `out_sharding`; plain `fn(*operands)` when `out_sharding` is None (no explicit axes).

    For code whose ops have no single sharding typing, where XLA's partitioner decides instead, as under automatic
    axes: a caller's `score_mod` / `mask_mod` run through `jnp.vectorize` (`vmap` demands that the arrays it maps over
    together share one sharding per dimension; a closed-over table indexed by a split `head`, `slopes[head]`, has
    none), or a layer's output projection contracting the heads split over a mesh axis (a sum across shards).
    `operands` may be pytrees (an Equinox module). Arrays `fn` closes over stay typed on the explicit axes, which no
    op may mix with automatic ones: pass them as operands (each is retyped, and its cotangent typed back).
    """
    if out_sharding is None:
        return fn(*operands)
    return jax.sharding.auto_axes(fn, out_sharding=out_sharding)(*operands)


def to_automatic(x: jax.Array) -> jax.Array:
    """Inside `on_automatic_axes`: `x`, an array it did not get as an operand (a parameter read from a Haiku frame),
    typed on the automatic axes as `jax.sharding.auto_axes` types its operands (the data stays where it is; its
    cotangent is typed back). Unchanged when `x` has no explicit axes, or outside `on_automatic_axes`."""
    context = jax.sharding.get_abstract_mesh()
    if not is_explicit(x) or context.empty or jax.sharding.AxisType.Explicit in context.axis_types:
        return x
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*(None,) * jnp.ndim(x)))


def sharding_from(*dims: tuple[jax.Array, int] | None) -> jax.sharding.NamedSharding | None:
    """The sharding whose dimension `i` is split as dimension `dims[i][1]` of array `dims[i][0]` is (None: whole);
    None unless one of the arrays has explicit axes. For a contraction's `out_sharding` where JAX cannot infer one
    (a contracted dimension split on both sides: the product is then summed across the shards)."""
    arrays = [d[0] for d in dims if d is not None]
    explicit = [x for x in arrays if is_explicit(x)]
    if not explicit:
        return None

    def split(x, axis):
        spec = tuple(jax.typeof(x).sharding.spec)
        axis = axis % jnp.ndim(x)
        return spec[axis] if axis < len(spec) else None

    spec = jax.sharding.PartitionSpec(*(None if d is None else split(*d) for d in dims))
    return jax.sharding.NamedSharding(jax.typeof(explicit[0]).sharding.mesh, spec)


def like_dims(x: jax.Array, ref: jax.Array, dims: tuple[int | None, ...]) -> jax.Array:
    """`x` typed with `ref`'s sharding of dimension `dims[i]` on its dimension `i` (None: whole) when `ref`'s type
    has explicit axes; else `x` unchanged. E.g. new tokens `[T, K, H]` written into a pool `[P, page, K, H]`: whole
    along the tokens, their heads split as the pool's (`dims=(None, 2, 3)`)."""
    if not is_explicit(ref):
        return x
    sharding = jax.typeof(ref).sharding
    spec = tuple(sharding.spec) + (None,) * (jnp.ndim(ref) - len(sharding.spec))
    want = jax.sharding.PartitionSpec(*(None if d is None else spec[d] for d in dims))
    return to_sharding(x, jax.sharding.NamedSharding(sharding.mesh, want))
