"""What every implementation provides to dispatch: the `Implementation` base class and the `Context` of one call."""

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp

from .. import varying
from ..config import AttentionConfig, AttentionInputs


Fallback = Callable[[AttentionConfig, AttentionInputs], tuple[jax.Array, ...]]
"""Another implementation's `attention` with its context bound, `(config, inputs) -> results`, as dispatch hands it
to one that cannot compute all of a call itself."""


def fallback_gradients(
    run: Fallback, config: AttentionConfig, inputs: AttentionInputs, d_out: jax.Array, d_lse: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(dquery, dkey, dvalue)` of a call whose fused kernel has no backward: the VJP of `run` (dispatch's fallback,
    recomputing the call from `inputs`) with the cotangents of `out` and of `lse` (None: zero; its non-finite entries
    count as zero)."""

    def recompute(query, key, value):
        out, lse = run(config, dataclasses.replace(inputs, query=query, key=key, value=value))[:2]
        return out, lse

    primal, vjp = jax.vjp(recompute, inputs.query, inputs.key, inputs.value)
    d_lse = jnp.zeros_like(primal[1]) if d_lse is None else jnp.where(jnp.isfinite(d_lse), d_lse, 0.0)
    return vjp(varying.match((d_out.astype(primal[0].dtype), d_lse.astype(jnp.float32)), primal))


@dataclasses.dataclass(frozen=True)
class Context:
    """What dispatch tells an implementation about the request it serves, beyond the call itself.

    An implementation that cannot compute all of a call itself never calls a sibling: it uses the `Fallback`s here
    (only cuDNN needs them today).

    Attributes:
        automatic: the caller left the choice to attnlib (`implementation=None`). An implementation may decline an
            automatic choice on performance grounds but must serve a requested one whenever it can.
        fallback: runs the part of a call an implementation lacks: `xla`, or None when the caller named this
            implementation alone (cuDNN's paged forward then refuses a gradient instead of differentiating it).
        unbounded: runs a call whose data turn out on device to exceed the bounds its kernels were built for, whatever
            was requested, so that such a call never gives wrong numbers: `xla_chunked` (cuDNN's packed rows with
            more segments than the bound used under `jit`).
        remaining: runs the call on the requested implementations after this one, as dispatch would (logged), for an
            implementation that finds only while building its kernel that it cannot serve the call (cuDNN refusing a
            graph its policy expected it to take); None when there is none left.
    """

    automatic: bool = False
    fallback: Fallback | None = None
    unbounded: Fallback | None = None
    remaining: Fallback | None = None


class Implementation(abc.ABC):
    """One attention implementation: `attnlib.Cudnn`, `attnlib.Xla`, `attnlib.XlaChunked`.

    Subclasses are frozen dataclasses (hashable: they are static arguments under `jit`) whose fields configure them;
    a name (`"cudnn"`, `"xla"`, `"xla_chunked"`) stands for the default instance. Neither method keeps state between
    calls.
    """

    name: ClassVar[str]
    """The name `implementation=` accepts for the default instance, and the key of `Explanation.declined`."""

    @abc.abstractmethod
    def decline_reason(self, config: AttentionConfig, context: Context) -> str | None:
        """None when this implementation serves the call, else a sentence naming the feature and the limit.

        Pure Python over the static configuration (no arrays, no device work).
        """

    @abc.abstractmethod
    def attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        """`(out, lse)` of a call `decline_reason` accepted.

        `out` is in the query's layout with the value head dim (`[*B, T, N, Hv]`, THD `[T, N, Hv]`) and dtype, `lse`
        float32 `[*B, T, N]` (THD `[T, N]`). With `config.max_logit` it may add a third result, `max_logit` itself
        (float32 `[*B, N]`, semantics.md): computed with the output, it saves `max_logit.py`'s separate pass. Both are
        differentiable with respect to query, key, value, bias and sinks (paged layouts may decline gradients).
        """

    def caveat(self, config: AttentionConfig, context: Context) -> str | None:
        """How this implementation serves an accepted call differently from what was asked, or None (the default).

        cuDNN: an `fp8=` call under automatic dispatch on a GPU whose cuDNN runs it only in 16 bits
        (`Explanation.without_fp8`).
        """
        return None

    def kernel_note(self, config: AttentionConfig, context: Context) -> str | None:
        """Which of its kernels this implementation runs for an accepted call and why, where it has several (shown by
        `attnlib.explain`), or None (the default)."""
        return None

    def declines_loudly(self) -> bool:
        """Whether dispatch logs this implementation declining at WARNING rather than INFO: a fallback from it loses
        most of the speed on this machine (cuDNN on a GPU machine). False by default."""
        return False
