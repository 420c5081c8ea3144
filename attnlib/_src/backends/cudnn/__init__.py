"""`implementation="cudnn"`: cuDNN fused attention graphs run by attnlib's native XLA FFI extension.

The import is cheap and safe everywhere: nothing here imports the cuDNN frontend or touches a GPU until a call is
traced on a machine that has one.
"""

import jax

from ...config import AttentionConfig, AttentionInputs
from ..base import Fallback
from . import support


class _Cudnn:
    """The cuDNN implementation (paged calls are forward only: their gradient differentiates `fallback`)."""

    name = "cudnn"

    def decline_reason(self, config: AttentionConfig, *, explicit: bool) -> str | None:
        reason = support.decline_reason(config)
        return None if reason is None else reason.removeprefix("cudnn: ")

    def attention(
        self,
        config: AttentionConfig,
        inputs: AttentionInputs,
        *,
        explicit: bool = True,
        fallback: Fallback | None = None,
        unbounded: Fallback | None = None,
    ) -> tuple[jax.Array, ...]:
        from . import attention, modifier, paged, varlen

        reason = support.decline_reason(config)
        if reason is not None:
            raise NotImplementedError(reason)
        if config.layout == "paged":
            return paged.attention(config, inputs, fallback=fallback)
        # Packed rows run as THD unless their structure rides in a bias next to a mask or modifier.
        if config.layout != "dense" or (config.has_segments and not modifier.visibility_as_bias(config)):
            return varlen.attention(config, inputs, unbounded=unbounded)
        return attention.attention(config, inputs)


IMPLEMENTATION = _Cudnn()
