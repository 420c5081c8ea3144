"""Which implementation serves a call, why the others declined, and logging of every fallback."""

import dataclasses
import logging
from collections.abc import Sequence

import jax

from . import logs
from .backends import xla, xla_chunked
from .backends.base import Implementation
from .backends.cudnn import IMPLEMENTATION as _CUDNN
from .config import AttentionConfig, AttentionInputs, IMPLEMENTATIONS


REGISTRY: dict[str, Implementation] = {
    "cudnn": _CUDNN,
    "xla_chunked": xla_chunked.IMPLEMENTATION,
    "xla": xla.IMPLEMENTATION,
}


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The outcome of dispatch for one call.

    Attributes:
        implementation: the implementation that would run, or None when none can.
        declined: for each implementation tried before it (or all, when none can), why it declined.
        requested: the implementations considered, in order.
    """

    implementation: str | None
    declined: dict[str, str]
    requested: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"attnlib would run: {self.implementation or 'nothing (every implementation declined)'}"]
        for name, reason in self.declined.items():
            lines.append(f"  {name} declined: {reason}")
        return "\n".join(lines)


def requested_implementations(implementation: str | Sequence[str] | None) -> tuple[tuple[str, ...], bool]:
    """Normalise `implementation` to a tuple of names and whether the choice is automatic (`None`)."""
    if implementation is None:
        return IMPLEMENTATIONS, True
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if not names or any(not isinstance(n, str) or n not in IMPLEMENTATIONS for n in names):
        raise ValueError(
            f"`implementation` must be None, one of {list(IMPLEMENTATIONS)} or a non-empty sequence of them. "
            f"Got {implementation!r}."
        )
    return names, False


def explain_config(config: AttentionConfig, implementation: str | Sequence[str] | None) -> Explanation:
    """Dispatch without running: the first implementation that serves `config` and the reasons of the others."""
    names, automatic = requested_implementations(implementation)
    declined: dict[str, str] = {}
    for name in names:
        reason = REGISTRY[name].decline_reason(config, explicit=not automatic)
        if reason is None:
            return Explanation(name, declined, names)
        declined[name] = reason
    return Explanation(None, declined, names)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def choose(config: AttentionConfig, implementation: str | Sequence[str] | None) -> Implementation:
    """The implementation to run; raises `NotImplementedError` when none can serve.

    Each fallback is logged once per distinct configuration (eager loops would otherwise log every call).
    """
    explanation = explain_config(config, implementation)
    if explanation.implementation is None:
        reasons = "; ".join(f"{n}: {r}" for n, r in explanation.declined.items())
        raise NotImplementedError(f"No requested attention implementation can serve this call. {reasons}")
    for name, reason in explanation.declined.items():
        message = f"attnlib.attention: {name} declined ({reason}); using {explanation.implementation}."
        # A GPU machine falling back from cuDNN loses most of its speed: say so loudly. Elsewhere it is expected.
        level = logging.WARNING if name == "cudnn" and _has_gpu() else logging.INFO
        logs.log_once((config, message), level, message)
    return REGISTRY[explanation.implementation]


def run(
    config: AttentionConfig, inputs: AttentionInputs, implementation: str | Sequence[str] | None
) -> tuple[jax.Array, jax.Array]:
    """Choose and run. When the chosen implementation was one of several candidates and fails to build its kernel
    (`GraphRejected`: cuDNN refused a graph the policy expected it to take), the next candidate runs, logged."""
    from .backends.cudnn.graphs import GraphRejected

    names, automatic = requested_implementations(implementation)
    while True:
        impl = choose(config, names if not automatic else None)
        try:
            return impl.attention(config, inputs)
        except GraphRejected as e:
            remaining = tuple(n for n in names if n != impl.name)
            if not remaining or (not automatic and len(names) == 1):
                raise
            message = f"attnlib.attention: {impl.name} failed to build its kernel ({e}); using the next candidate."
            logs.log_once((config, message), logging.WARNING, message)
            names, automatic = remaining, False
