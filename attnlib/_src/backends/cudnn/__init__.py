"""`implementation="cudnn"`: cuDNN fused attention graphs run by attnlib's native XLA FFI extension.

The import is cheap and safe everywhere: nothing here imports the cuDNN frontend or touches a GPU until a call is
traced on a machine that has one.
"""

import threading

import jax

from ...config import AttentionConfig, AttentionInputs
from . import support


class _Cudnn:
    """The cuDNN implementation.

    Paged calls are forward only on cuDNN. Whether a gradient may fall back to the `xla` path depends on how cuDNN
    was chosen: dispatch asks `decline_reason(config, explicit=...)` and then, in the same thread, calls
    `attention`; the last `explicit` seen for a served paged config is remembered per thread for that call
    (a direct `attention` call counts as explicit).
    """

    name = "cudnn"

    def __init__(self):
        self._local = threading.local()

    def decline_reason(self, config: AttentionConfig, *, explicit: bool) -> str | None:
        reason = support.decline_reason(config)
        if reason is None and config.layout == "paged":
            self._local.choice = (config, explicit)
        return None if reason is None else reason.removeprefix("cudnn: ")

    def attention(self, config: AttentionConfig, inputs: AttentionInputs) -> tuple[jax.Array, jax.Array]:
        from . import attention

        choice = getattr(self._local, "choice", None)
        self._local.choice = None
        explicit = True if choice is None or choice[0] != config else choice[1]
        return attention.attention(config, inputs, explicit=explicit)


IMPLEMENTATION = _Cudnn()
