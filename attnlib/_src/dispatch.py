"""Which implementation serves a call, why the others declined, and logging of every fallback.

Dispatch knows implementations only through `backends.base.Implementation`: it asks each requested one why it
declines and runs the first that serves, with a `Context` saying how the call was requested and what the
implementation may hand work to (`fallback`, `unbounded`, `remaining`).
"""

import dataclasses
import functools
import logging

import jax

from . import logs
from .backends import registry
from .backends.base import Context, Fallback, Implementation
from .config import AttentionConfig, AttentionInputs, IMPLEMENTATIONS


ImplementationRequest = registry.Request
"""What `implementation=` takes: None (automatic), a name, an implementation object (`attnlib.Cudnn(...)`,
`attnlib.Xla()`, `attnlib.XlaChunked(...)`), or a sequence of those."""

REGISTRY = registry.DEFAULTS
"""Each name's default instance (made per call)."""


@dataclasses.dataclass(frozen=True)
class Explanation:
    """The outcome of dispatch for one call.

    Attributes:
        implementation: the implementation that would run, or None when none can.
        declined: for each implementation tried before it (or all, when none can), why it declined.
        requested: the implementations considered, in order.
        without_fp8: automatic dispatch of an `fp8=` call on a GPU whose cuDNN cannot run it in FP8 but can run it
            in 16 bits: the reason FP8 was dropped (the call then runs on cuDNN without quantization, with a
            warning; `Implementation.caveat`); None otherwise.
        kernel: which kernel of the chosen implementation runs and why, where it has several
            (`Implementation.kernel_note`: pallas_tpu's own flex kernel where splash declines); None otherwise.
    """

    implementation: str | None
    declined: dict[str, str]
    requested: tuple[str, ...]
    without_fp8: str | None = None
    kernel: str | None = None

    def __str__(self) -> str:
        if self.without_fp8 is not None:
            return (
                f"attnlib would run: {self.implementation} in 16 bits, without FP8 (automatic dispatch on a GPU: "
                f"{self.without_fp8})"
            )
        lines = [f"attnlib would run: {self.implementation or 'nothing (every implementation declined)'}"]
        if self.kernel is not None:
            lines[0] += f", which {self.kernel}"
        for name, reason in self.declined.items():
            lines.append(f"  {name} declined: {reason}")
        return "\n".join(lines)


def requested_implementations(
    implementation: ImplementationRequest,
) -> tuple[tuple[Implementation, ...], bool]:
    """Normalise `implementation` to the implementations to try, in order, and whether the choice is automatic
    (`None`). A name stands for its default instance; an implementation object for itself."""
    if implementation is None:
        return tuple(REGISTRY[name]() for name in IMPLEMENTATIONS), True
    single = isinstance(implementation, (str, Implementation))
    try:
        entries = (implementation,) if single else tuple(implementation)  # pyright: ignore[reportArgumentType]
    except TypeError:
        entries = ()
    impls = tuple(_resolve(entry) for entry in entries)
    if not impls or any(impl is None for impl in impls):
        configured = ", ".join(f"attnlib.{cls.__name__}(...)" for cls in registry.CLASSES)
        raise ValueError(
            f"`implementation` must be None, one of {list(IMPLEMENTATIONS)}, a configured implementation "
            f"({configured}) or a non-empty sequence of them. Got {implementation!r}."
        )
    return impls, False  # pyright: ignore[reportReturnType]


def _resolve(entry: object) -> Implementation | None:
    if isinstance(entry, str):
        default = REGISTRY.get(entry)
        return None if default is None else default()
    return entry if isinstance(entry, Implementation) else None


def explain_config(config: AttentionConfig, implementation: ImplementationRequest) -> Explanation:
    """Dispatch without running: the first implementation that serves `config` and the reasons of the others."""
    impls, automatic = requested_implementations(implementation)
    return _explain(config, impls, automatic)[0]


def _explain(
    config: AttentionConfig, impls: tuple[Implementation, ...], automatic: bool
) -> tuple[Explanation, Implementation | None]:
    names = tuple(impl.name for impl in impls)
    context = Context(automatic=automatic)
    declined: dict[str, str] = {}
    for impl in impls:
        reason = impl.decline_reason(config, context)
        if reason is None:
            caveat, kernel = impl.caveat(config, context), impl.kernel_note(config, context)
            return Explanation(impl.name, declined, names, without_fp8=caveat, kernel=kernel), impl
        declined[impl.name] = reason
    return Explanation(None, declined, names), None


def choose(config: AttentionConfig, impls: tuple[Implementation, ...], automatic: bool) -> Implementation:
    """The implementation to run; raises `NotImplementedError` when none can serve.

    Each fallback is logged once per distinct configuration (eager loops would otherwise log every call).
    """
    explanation, chosen = _explain(config, impls, automatic)
    if chosen is None:
        reasons = "; ".join(f"{n}: {r}" for n, r in explanation.declined.items())
        raise NotImplementedError(f"No requested attention implementation can serve this call. {reasons}")
    loud = {impl.name for impl in impls if impl.name in explanation.declined and impl.declines_loudly()}
    for name, reason in explanation.declined.items():
        message = f"attnlib.attention: {name} declined ({reason}); using {explanation.implementation}."
        logs.log_once((config, message), logging.WARNING if name in loud else logging.INFO, message)
    return chosen


def _by_name(name: str) -> Fallback:
    """The default instance of `name` as a `Fallback`."""
    impl = REGISTRY[name]()
    return lambda config, inputs: impl.attention(config, inputs, Context())


def run(
    config: AttentionConfig,
    inputs: AttentionInputs,
    implementation: ImplementationRequest,
) -> tuple[jax.Array, ...]:
    """Choose and run."""
    impls, automatic = requested_implementations(implementation)
    return _run(config, inputs, impls, automatic, alone=not automatic and len(impls) == 1)


def _run(
    config: AttentionConfig,
    inputs: AttentionInputs,
    impls: tuple[Implementation, ...],
    automatic: bool,
    alone: bool,
) -> tuple[jax.Array, ...]:
    """Run the first of `impls` that serves. `alone`: the caller named one implementation (nothing to fall back to).
    Its context's `remaining` runs the other candidates as a request (each serves whenever it can), logged by the
    implementation that hands the call on."""
    impl = choose(config, impls, automatic)
    rest = tuple(i for i in impls if i is not impl)
    context = Context(
        automatic=automatic,
        # What an implementation cannot compute itself: cuDNN's paged gradient, packed rows beyond its bound.
        fallback=None if alone else _by_name("xla"),
        unbounded=_by_name("xla_chunked"),
        remaining=None if alone or not rest else functools.partial(_run, impls=rest, automatic=False, alone=False),
    )
    return impl.attention(config, inputs, context)
