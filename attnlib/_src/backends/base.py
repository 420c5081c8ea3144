"""What every implementation provides to dispatch."""

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import jax

from ..config import AttentionConfig, AttentionInputs


Fallback = Callable[[AttentionConfig, AttentionInputs], tuple[jax.Array, ...]]
"""Another implementation's `attention`, `(config, inputs) -> results`, as dispatch hands it to one that cannot
compute all of a call itself."""


@runtime_checkable
class Implementation(Protocol):
    """One attention implementation.

    `decline_reason` is pure Python over the static configuration (no arrays, no device work): it returns None when
    the implementation serves the call, or a sentence naming the feature and the limit when it does not.
    `explicit` is True when the caller named this implementation alone; an implementation may decline an automatic
    choice on performance grounds but must serve an explicit one whenever it can.

    `attention` returns `(out, lse)`: `out` in the query's layout with the value head dim (`[*B, T, N, Hv]`, THD
    `[T, N, Hv]`) and dtype, `lse` float32 `[*B, T, N]` (THD `[T, N]`). With `config.max_logit` it may add a third
    result, `max_logit` itself (float32 `[*B, N]`, semantics.md): computed with the output, it saves
    `max_logit.py`'s separate pass. Both are differentiable with respect to
    query, key, value, bias and sinks (paged layouts may decline gradients). Its `explicit` is True when the caller
    named this implementation alone (no other to fall back to). Neither method keeps state between calls.

    An implementation that cannot compute all of a call itself never calls a sibling: it uses the `fallback` and
    `unbounded` (`Fallback`s) that dispatch passes every implementation (only cuDNN needs them today):
    - `fallback` runs the part it lacks: `xla`, or None when the caller named this implementation alone (cuDNN's
      paged forward then refuses a gradient instead of differentiating `fallback`);
    - `unbounded` runs a call whose data turn out on device to exceed the bounds its kernels were built for, whatever
      was requested, so that such a call never gives wrong numbers: `xla_chunked` (cuDNN's packed rows with more
      segments than the bound used under `jit`).
    """

    name: str

    def decline_reason(self, config: AttentionConfig, *, explicit: bool) -> str | None: ...

    def attention(
        self,
        config: AttentionConfig,
        inputs: AttentionInputs,
        *,
        explicit: bool = True,
        fallback: Fallback | None = None,
        unbounded: Fallback | None = None,
    ) -> tuple[jax.Array, jax.Array]: ...
