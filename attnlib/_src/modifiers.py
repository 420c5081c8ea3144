"""The static description of a call's custom score and mask functions (`score_mod`, `mask_mod`; docs/flex_attention.md).

Both functions are written in `jax.numpy` for ONE score element:

    score_mod(score, batch, head, q_idx, kv_idx, *args) -> float scalar (the new score)
    mask_mod(batch, head, q_idx, kv_idx, *args) -> bool scalar (True = may attend)

`describe` checks them by tracing each once on scalars (`jax.make_jaxpr`: float32 `score`, int32 indices, one
scalar of each `score_mod_args` dtype) and returns a `Modifiers`: the functions, the traced jaxprs, the arguments'
shapes and dtypes, and a structural `key` that identifies the computation across calls and processes.

The key is built from the jaxpr texts (which spell out every primitive, its parameters and literal constants), the
argument shapes and dtypes, and each closed-over constant: a concrete array contributes its dtype, shape and a hash
of its bytes (its value is baked into the computation), a tracer (a traced value closed over inside `jit`)
contributes only its dtype and shape and marks the description `has_traced_consts` (its value changes from call to
call, so a compiled kernel must take it as an input, or decline). Nothing in the key depends on object identity or
memory addresses: the same function gives the same key in a fresh process, and two functions that compute
different things never share one.
"""

import dataclasses
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np


SCORE_MOD_SIGNATURE = "score_mod(score, batch, head, q_idx, kv_idx, *args)"
MASK_MOD_SIGNATURE = "mask_mod(batch, head, q_idx, kv_idx, *args)"

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@dataclasses.dataclass(frozen=True, eq=False)
class Modifiers:
    """What is static about a call's `score_mod` / `mask_mod`; equal (and hashed) by `key` only.

    Attributes:
        score_mod: the caller's `score_mod`, or None.
        mask_mod: the caller's `mask_mod`, or None.
        arg_shapes: the caller's shapes of `score_mod_args` (each broadcastable to `[*B, N, T, S]`).
        arg_dtypes: their dtypes.
        score_jaxpr: `score_mod` traced on scalars (float32 score, int32 `batch`, `head`, `q_idx`, `kv_idx`, one
            scalar per argument of its dtype); its `consts` are the closed-over arrays. None without `score_mod`.
        mask_jaxpr: `mask_mod` traced likewise (without the score). None without `mask_mod`.
        key: the structural cache key (see the module docstring).
    """

    score_mod: Callable | None
    mask_mod: Callable | None
    arg_shapes: tuple[tuple[int, ...], ...]
    arg_dtypes: tuple[np.dtype, ...]
    score_jaxpr: jex.ClosedJaxpr | None
    mask_jaxpr: jex.ClosedJaxpr | None
    key: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Modifiers) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        name = lambda f: None if f is None else getattr(f, "__qualname__", type(f).__name__)
        return (
            f"Modifiers(score_mod={name(self.score_mod)}, mask_mod={name(self.mask_mod)}, "
            f"arg_shapes={self.arg_shapes}, arg_dtypes={tuple(str(d) for d in self.arg_dtypes)}, "
            f"digest={self.digest[:12]})"
        )

    @property
    def score_consts(self) -> tuple[Any, ...]:
        """The arrays `score_mod` closes over (the `consts` of its jaxpr); empty without `score_mod`."""
        return () if self.score_jaxpr is None else tuple(self.score_jaxpr.consts)

    @property
    def mask_consts(self) -> tuple[Any, ...]:
        """The arrays `mask_mod` closes over; empty without `mask_mod`."""
        return () if self.mask_jaxpr is None else tuple(self.mask_jaxpr.consts)

    @property
    def has_traced_consts(self) -> bool:
        """A function closes over a traced value (inside `jit`/`vmap`/`grad`): its value is not known statically."""
        return any(isinstance(c, jax.core.Tracer) for c in self.score_consts + self.mask_consts)

    @property
    def digest(self) -> str:
        """sha256 of `key` (hex): a short form of the key for file names and logs."""
        return hashlib.sha256(self.key.encode()).hexdigest()

    @property
    def num_args(self) -> int:
        return len(self.arg_shapes)


def _is_shaped(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or isinstance(x, jax.core.Tracer)


def as_arrays(score_mod_args: Any) -> tuple[Any, ...]:
    """`score_mod_args` as a tuple of arrays (`jnp.asarray` of each; `jax.ShapeDtypeStruct`s are kept).

    Raises:
        TypeError: `score_mod_args` is not a tuple or list, or an element is not an array.
    """
    if score_mod_args is None:
        return ()
    if not isinstance(score_mod_args, (tuple, list)):
        raise TypeError(
            "`score_mod_args` must be a tuple or list of arrays (each broadcastable to [*B, N, T, S]). "
            f"Got {_what(score_mod_args)}."
        )
    arrays = []
    for i, x in enumerate(score_mod_args):
        if isinstance(x, jax.ShapeDtypeStruct):
            arrays.append(x)
            continue
        try:
            arrays.append(jnp.asarray(x))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"`score_mod_args[{i}]` must be an array (anything `jnp.asarray` accepts). Got {_what(x)}."
            ) from e
    return tuple(arrays)


def _what(x: Any) -> str:
    """A short description of a value for error messages."""
    if _is_shaped(x):
        return f"an array of dtype {x.dtype} and shape {tuple(x.shape)}"
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} of type {type(x).__name__}"


def _aval_text(x: Any) -> str:
    """`float32[]`, `int32[3]`, `a tuple of 2 values (float32[], float32[])`, ..."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return f"{np.dtype(x.dtype).name}[{','.join(str(d) for d in x.shape)}]"
    if isinstance(x, (tuple, list)):
        kind = "a tuple" if isinstance(x, tuple) else "a list"
        return f"{kind} of {len(x)} values ({', '.join(_aval_text(v) for v in x)})"
    if x is None:
        return "None"
    return f"a value of type {type(x).__name__}"


def trace_without_mesh(fn: Callable, *avals: jax.ShapeDtypeStruct, return_shape: bool = False):
    """`jax.make_jaxpr(fn, return_shape=return_shape)(*avals)` with no mesh in context: the jaxpr records none and
    replays under any (a scalar function's jaxpr is the same on every mesh; where it runs, a mesh's explicit axes may
    have been made automatic: `explicit_axes.on_automatic_axes`)."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return jax.make_jaxpr(fn, return_shape=return_shape)(*avals)


def _trace(name: str, signature: str, fn: Any, avals: Sequence[jax.ShapeDtypeStruct]) -> tuple[jex.ClosedJaxpr, Any]:
    """`jax.make_jaxpr(fn)(*avals)` and the output's shape structure, with errors that name `name`."""
    if not callable(fn):
        raise TypeError(f"`{name}` must be a callable `{signature}`. Got {_what(fn)}.")
    shown = ", ".join(_aval_text(a) for a in avals)
    try:
        return trace_without_mesh(fn, *avals, return_shape=True)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise (TypeError if isinstance(e, TypeError) else ValueError)(
            f"`{name}` must be traceable as `{signature}` on scalars ({shown}): it is written in jax.numpy for one "
            "score element, without Python control flow on its values. Tracing it raised "
            f"{type(e).__name__}: {first_line}"
        ) from e


def _const_key(c: Any) -> str:
    """How one closed-over constant enters the key: traced -> dtype and shape only; concrete -> and its bytes."""
    if isinstance(c, jax.core.Tracer):
        aval = jax.typeof(c)
        return f"traced {aval.dtype}{list(aval.shape)}"
    if isinstance(c, jax.Array) and jax.dtypes.issubdtype(c.dtype, jax.dtypes.prng_key):
        dtype_text = str(c.dtype)
        c = jax.random.key_data(c)
    else:
        dtype_text = None
    arr = np.ascontiguousarray(np.asarray(c))
    digest = hashlib.sha256(arr.tobytes()).hexdigest()
    return f"concrete {dtype_text or arr.dtype}{list(arr.shape)} sha256={digest}"


def _jaxpr_key(name: str, closed: jex.ClosedJaxpr | None) -> str:
    if closed is None:
        return f"{name}: none"
    text = _ADDRESS.sub("0x?", str(closed.jaxpr))
    consts = "; ".join(_const_key(c) for c in closed.consts)
    return f"{name}:\n{text}\nconsts: [{consts}]"


def describe(score_mod: Any, mask_mod: Any, score_mod_args: Any) -> Modifiers | None:
    """Check `score_mod`, `mask_mod` and `score_mod_args` and describe them statically.

    Args:
        score_mod: `score_mod(score, batch, head, q_idx, kv_idx, *args) -> float scalar`, or None.
        mask_mod: `mask_mod(batch, head, q_idx, kv_idx, *args) -> bool scalar`, or None.
        score_mod_args: a tuple or list of arrays (or `jax.ShapeDtypeStruct`s); the functions see one scalar of
            each. Their broadcasting against `[*B, N, T, S]` is checked by the caller, which knows the shapes.

    Returns:
        None when both functions are None (and there are no arguments), else a `Modifiers`.

    Raises:
        TypeError: a function is not callable, returns the wrong kind or dtype, or raises a `TypeError` while it is
            traced; `score_mod_args` is not a tuple or list of arrays.
        ValueError: `score_mod_args` without either function; a function returns a non-scalar or raises another
            error while it is traced.
    """
    args = as_arrays(score_mod_args)
    if score_mod is None and mask_mod is None:
        if args:
            raise ValueError(
                "`score_mod_args` are the extra arguments of `score_mod` / `mask_mod` and need at least one of them. "
                f"Got {len(args)} score_mod_args with score_mod=None and mask_mod=None."
            )
        return None
    arg_shapes = tuple(tuple(int(d) for d in a.shape) for a in args)
    arg_dtypes = tuple(np.dtype(a.dtype) for a in args)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    arg_avals = tuple(jax.ShapeDtypeStruct((), d) for d in arg_dtypes)

    score_jaxpr = None
    if score_mod is not None:
        avals = (jax.ShapeDtypeStruct((), jnp.float32),) + (index,) * 4 + arg_avals
        score_jaxpr, out = _trace("score_mod", SCORE_MOD_SIGNATURE, score_mod, avals)
        if not isinstance(out, jax.ShapeDtypeStruct):
            raise TypeError(f"`score_mod` must return one float scalar (the new score). Got {_aval_text(out)}.")
        if not jnp.issubdtype(out.dtype, jnp.floating):
            raise TypeError(
                "`score_mod` must return one float scalar (the new score; any float dtype, used as float32). "
                f"Got {_aval_text(out)}."
            )
        if out.shape != ():
            raise ValueError(
                "`score_mod` must return one float scalar (the new score for one element), shape (). "
                f"Got {_aval_text(out)}."
            )

    mask_jaxpr = None
    if mask_mod is not None:
        avals = (index,) * 4 + arg_avals
        mask_jaxpr, out = _trace("mask_mod", MASK_MOD_SIGNATURE, mask_mod, avals)
        if not isinstance(out, jax.ShapeDtypeStruct) or out.dtype != jnp.bool_:
            raise TypeError(f"`mask_mod` must return one bool scalar (True = may attend). Got {_aval_text(out)}.")
        if out.shape != ():
            raise ValueError(
                "`mask_mod` must return one bool scalar (True = may attend, for one element), shape (). "
                f"Got {_aval_text(out)}."
            )

    args_key = ", ".join(f"{d.name}{list(s)}" for d, s in zip(arg_dtypes, arg_shapes, strict=True))
    key = "\n".join((_jaxpr_key("score_mod", score_jaxpr), _jaxpr_key("mask_mod", mask_jaxpr), f"args: [{args_key}]"))
    return Modifiers(
        score_mod=score_mod,
        mask_mod=mask_mod,
        arg_shapes=arg_shapes,
        arg_dtypes=arg_dtypes,
        score_jaxpr=score_jaxpr,
        mask_jaxpr=mask_jaxpr,
        key=key,
    )
