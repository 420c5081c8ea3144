"""What every implementation provides to dispatch."""

from typing import Protocol, runtime_checkable

import jax

from ..config import AttentionConfig, AttentionInputs


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
    named this implementation alone (no other to fall back to): cuDNN's paged forward then refuses a gradient
    instead of differentiating the `xla` path. Neither method keeps state between calls.
    """

    name: str

    def decline_reason(self, config: AttentionConfig, *, explicit: bool) -> str | None: ...

    def attention(
        self, config: AttentionConfig, inputs: AttentionInputs, *, explicit: bool = True
    ) -> tuple[jax.Array, jax.Array]: ...
