"""Which implementation serves a call, why the others declined, and logging of every fallback."""

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax

from . import fp8 as fp8_lib, logs
from .backends import xla, xla_chunked
from .backends.base import Implementation
from .backends.cudnn import IMPLEMENTATION as _CUDNN
from .config import AttentionConfig, AttentionInputs, IMPLEMENTATIONS


CONFIGURED = (xla_chunked.XlaChunked,)
"""The implementation classes a caller may configure and pass as `implementation`."""

ImplementationRequest = str | xla_chunked.XlaChunked | Sequence[Any] | None
"""What `implementation=` takes: None (automatic), a name, a configured implementation, or a sequence of those (its
items are checked by `requested_implementations`, with one message for every kind of mistake)."""

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
        without_fp8: automatic dispatch of an `fp8=` call on a GPU whose cuDNN cannot run it in FP8 but can run it
            in 16 bits: the reason FP8 was dropped (the call then runs on cuDNN without quantization, with a
            warning); None otherwise.
    """

    implementation: str | None
    declined: dict[str, str]
    requested: tuple[str, ...]
    without_fp8: str | None = None

    def __str__(self) -> str:
        if self.without_fp8 is not None:
            return (
                f"attnlib would run: {self.implementation} in 16 bits, without FP8 (automatic dispatch on a GPU: "
                f"{self.without_fp8})"
            )
        lines = [f"attnlib would run: {self.implementation or 'nothing (every implementation declined)'}"]
        for name, reason in self.declined.items():
            lines.append(f"  {name} declined: {reason}")
        return "\n".join(lines)


def requested_implementations(
    implementation: ImplementationRequest,
) -> tuple[tuple[Implementation, ...], bool]:
    """Normalise `implementation` to the implementations to try, in order, and whether the choice is automatic
    (`None`). A name stands for its default configuration; a configured object (`attnlib.XlaChunked(...)`) for
    itself."""
    if implementation is None:
        return tuple(REGISTRY[name] for name in IMPLEMENTATIONS), True
    single = isinstance(implementation, str) or isinstance(implementation, CONFIGURED)
    try:
        entries = (implementation,) if single else tuple(implementation)
    except TypeError:
        entries = ()
    impls = tuple(_resolve(entry) for entry in entries)
    if not impls or any(impl is None for impl in impls):
        configured = ", ".join(f"attnlib.{cls.__name__}(...)" for cls in CONFIGURED)
        raise ValueError(
            f"`implementation` must be None, one of {list(IMPLEMENTATIONS)}, a configured implementation "
            f"({configured}) or a non-empty sequence of them. Got {implementation!r}."
        )
    return impls, False


def _resolve(entry: object) -> Implementation | None:
    if isinstance(entry, str):
        return REGISTRY.get(entry)
    return entry if isinstance(entry, CONFIGURED) else None


def without_fp8(config: AttentionConfig) -> AttentionConfig:
    """`config` as a 16-bit call: no quantization, inputs in the output dtype (`fp8_fallback_inputs`)."""
    return dataclasses.replace(config, fp8=None, fp8_output_dtype=None, dtype=config.output_dtype)


def fp8_fallback_inputs(config: AttentionConfig, inputs: AttentionInputs) -> AttentionInputs:
    """The inputs of `without_fp8(config)`: pre-quantized E4M3 inputs dequantized to the output dtype."""
    if config.fp8 != "scaled":
        return inputs
    dequantize, _ = fp8_lib.plan(config.fp8, inputs.query, inputs.key, inputs.value, inputs.fp8_scales)
    query, key, value = (
        dequantize(x, i).astype(config.output_dtype) for i, x in enumerate((inputs.query, inputs.key, inputs.value))
    )
    return dataclasses.replace(inputs, query=query, key=key, value=value, fp8_scales=None)


def _fp8_fallback_reason(config: AttentionConfig, automatic: bool) -> str | None:
    """Why automatic dispatch runs an `fp8=` call on cuDNN in 16 bits: cuDNN declines the FP8 call on this GPU but
    serves the same call without FP8. None when that is not the case (the plain-JAX emulation then serves FP8)."""
    if not automatic or config.fp8 is None or not _has_gpu():
        return None
    reason = _CUDNN.decline_reason(config, explicit=False)
    if reason is None or _CUDNN.decline_reason(without_fp8(config), explicit=False) is not None:
        return None
    return f"cudnn cannot run this call in FP8 ({reason})"


def explain_config(
    config: AttentionConfig, implementation: ImplementationRequest
) -> Explanation:
    """Dispatch without running: the first implementation that serves `config` and the reasons of the others."""
    impls, automatic = requested_implementations(implementation)
    return _explain(config, impls, automatic)[0]


def _explain(
    config: AttentionConfig, impls: tuple[Implementation, ...], automatic: bool
) -> tuple[Explanation, Implementation | None]:
    names = tuple(impl.name for impl in impls)
    fallback = _fp8_fallback_reason(config, automatic)
    if fallback is not None:
        return Explanation("cudnn", {}, names, without_fp8=fallback), _CUDNN
    declined: dict[str, str] = {}
    for impl in impls:
        reason = impl.decline_reason(config, explicit=not automatic)
        if reason is None:
            return Explanation(impl.name, declined, names), impl
        declined[impl.name] = reason
    return Explanation(None, declined, names), None


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def choose(config: AttentionConfig, impls: tuple[Implementation, ...], automatic: bool) -> Implementation:
    """The implementation to run; raises `NotImplementedError` when none can serve.

    Each fallback is logged once per distinct configuration (eager loops would otherwise log every call).
    """
    explanation, chosen = _explain(config, impls, automatic)
    if chosen is None:
        reasons = "; ".join(f"{n}: {r}" for n, r in explanation.declined.items())
        raise NotImplementedError(f"No requested attention implementation can serve this call. {reasons}")
    for name, reason in explanation.declined.items():
        message = f"attnlib.attention: {name} declined ({reason}); using {explanation.implementation}."
        # A GPU machine falling back from cuDNN loses most of its speed: say so loudly. Elsewhere it is expected.
        level = logging.WARNING if name == "cudnn" and _has_gpu() else logging.INFO
        logs.log_once((config, message), level, message)
    return chosen


def run(
    config: AttentionConfig,
    inputs: AttentionInputs,
    implementation: ImplementationRequest,
) -> tuple[jax.Array, jax.Array]:
    """Choose and run. When the chosen implementation was one of several candidates and fails to build its kernel
    (`GraphRejected`: cuDNN refused a graph the policy expected it to take), the next candidate runs, logged."""
    from .backends.cudnn.graphs import GraphRejected

    impls, automatic = requested_implementations(implementation)
    alone = not automatic and len(impls) == 1  # nothing to fall back to
    fp8_reason = _fp8_fallback_reason(config, automatic)
    if fp8_reason is not None:
        message = f"attnlib.attention: {fp8_reason}; running it on cuDNN in 16 bits without FP8 quantization."
        logs.log_once((config, message), logging.WARNING, message)
        return _CUDNN.attention(
            without_fp8(config), fp8_fallback_inputs(config, inputs), explicit=False,
            fallback=xla.IMPLEMENTATION.attention, unbounded=xla_chunked.IMPLEMENTATION.attention,
        )  # fmt: skip
    while True:
        impl = choose(config, impls, automatic)
        try:
            # What an implementation cannot compute itself (`base.Implementation`): cuDNN's paged gradient, packed
            # rows beyond its bound.
            fallback = None if alone else xla.IMPLEMENTATION.attention
            return impl.attention(
                config, inputs, explicit=alone, fallback=fallback, unbounded=xla_chunked.IMPLEMENTATION.attention
            )
        except GraphRejected as e:
            remaining = tuple(i for i in impls if i is not impl)
            if not remaining or alone:
                raise
            message = f"attnlib.attention: {impl.name} failed to build its kernel ({e}); using the next candidate."
            logs.log_once((config, message), logging.WARNING, message)
            impls, automatic = remaining, False
