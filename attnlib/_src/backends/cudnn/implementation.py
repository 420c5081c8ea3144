"""`attnlib.Cudnn`: the cuDNN implementation, its options, its FP8 downgrade and its fallback on a refused graph."""

import dataclasses
import logging
from typing import ClassVar, Literal

import jax

from ... import fp8 as fp8_lib, logs
from ...config import AttentionConfig, AttentionInputs
from .. import mesh_visibility, placement
from ..base import Context, Implementation
from . import autotune as autotune_lib, cache, executor as executor_lib, graphs, support, varlen


Autotune = Literal["autotuned", "heuristics", "all"]


@dataclasses.dataclass(frozen=True)
class Cudnn(Implementation):
    """`implementation="cudnn"`: cuDNN fused attention graphs run by attnlib's native XLA FFI extension, with its
    options. Pass an instance wherever `implementation` takes a name (alone or in a sequence); the name stands for
    `Cudnn()`, made when the call is traced (so it reads the environment then).

    Attributes:
        autotune: how a graph's backend plan is chosen when it is built: `"autotuned"` (the fastest of cuDNN's first
            four, timed once per machine), `"heuristics"` (cuDNN's first, untimed) or `"all"` (every plan timed).
            Defaults to `ATTNLIB_CUDNN_AUTOTUNE` (`0`/`false`/`off`/`no`: heuristics; `all`; else autotuned).
        cache_dir: where built graphs persist between processes; None keeps them in memory only. Defaults to
            `ATTNLIB_CACHE_DIR` (the empty string: None), else `$XDG_CACHE_HOME/attnlib/cudnn`.
        ragged_stats: where THD and packed-row graphs keep their softmax statistics: `"per_token"` (`[Tq, N]`),
            `"padded"` (`[b, N, t]`, one row per sequence and bucketed row) or `"auto"` (the default: per token when
            the padded rows exceed four times the tokens; docs/performance.md).
        executor: what builds and runs the graphs: an object with `get_entry(spec)` and
            `call(spec, entry, *operands, tokens=None)` (tests hand in an emulation). None (the default): attnlib's
            FFI executor with `autotune` and `cache_dir`.
        device: the GPU whose compute capability and cuDNN version decide what cuDNN serves (`Device`); None (the
            default): this process's, read when a call is traced.
    """

    autotune: Autotune = dataclasses.field(default_factory=autotune_lib.autotune_mode)  # pyright: ignore
    cache_dir: str | None = dataclasses.field(default_factory=cache.default_directory)
    ragged_stats: varlen.RaggedStats = "auto"
    executor: executor_lib.GraphExecutor | None = None
    device: support.Device | None = None
    name: ClassVar[str] = "cudnn"

    def __post_init__(self):
        if self.autotune not in ("autotuned", "heuristics", "all"):
            raise ValueError(f'`autotune` must be "autotuned", "heuristics" or "all". Got autotune={self.autotune!r}.')
        if self.ragged_stats not in ("auto", "per_token", "padded"):
            raise ValueError(
                f'`ragged_stats` must be "auto", "per_token" or "padded". Got ragged_stats={self.ragged_stats!r}.'
            )

    def graph_executor(self) -> executor_lib.GraphExecutor:
        """`executor`, or attnlib's FFI executor configured by `autotune` and `cache_dir`."""
        if self.executor is not None:
            return self.executor
        return executor_lib.FfiExecutor(autotune=self.autotune, cache_dir=self.cache_dir)

    def _policy_reason(self, config: AttentionConfig) -> str | None:
        return support.decline_reason(config, self.device)

    def _fp8_downgrade(self, config: AttentionConfig, context: Context) -> str | None:
        """Why automatic dispatch runs an `fp8=` call here in 16 bits: cuDNN declines the FP8 call on this GPU but
        serves the same call without FP8. None when that is not the case (the plain-JAX emulation then serves FP8,
        and a requested cuDNN declines)."""
        if not context.automatic or config.fp8 is None:
            return None
        reason = self._policy_reason(config)
        if reason is None or self._policy_reason(fp8_lib.without_fp8(config)) is not None:
            return None
        return f"cudnn cannot run this call in FP8 ({reason.removeprefix('cudnn: ')})"

    def decline_reason(self, config: AttentionConfig, context: Context) -> str | None:
        if self._fp8_downgrade(config, context) is not None:
            return None
        reason = self._policy_reason(config)
        return None if reason is None else reason.removeprefix("cudnn: ")

    def caveat(self, config: AttentionConfig, context: Context) -> str | None:
        return self._fp8_downgrade(config, context)

    def declines_loudly(self) -> bool:
        # A call placed on a GPU that falls back from cuDNN loses most of its speed: say so loudly. Elsewhere (a CPU,
        # or a CPU `jax.default_device` on a GPU machine) it is expected.
        return self.device is not None or placement.placement_platform() == "gpu"

    def attention(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        """Runs the call (in 16 bits when `caveat` says so, logged); when cuDNN refuses to build a graph the policy
        expected it to take (`graphs.GraphRejected`), runs `context.remaining` instead (logged), or raises when
        nothing remains."""
        run_config, run_inputs = config, inputs
        downgrade = self._fp8_downgrade(config, context)
        if downgrade is not None:
            message = f"attnlib.attention: {downgrade}; running it on cuDNN in 16 bits without FP8 quantization."
            logs.log_once((config, message), logging.WARNING, message)
            run_config, run_inputs = fp8_lib.without_fp8(config), fp8_lib.fp8_fallback_inputs(config, inputs)
        try:
            return self._on_mesh(run_config, run_inputs, context)
        except graphs.GraphRejected as e:
            if context.remaining is None:
                raise
            message = f"attnlib.attention: cudnn failed to build its kernel ({e}); using the next candidate."
            logs.log_once((config, message), logging.WARNING, message)
            return context.remaining(config, inputs)

    def _on_mesh(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        """`_run`, on a mesh with explicit axes (`AxisType.Explicit`) with those axes made automatic
        (`mesh_visibility.with_automatic_axes`): the layout work around the graphs runs as under automatic axes, each
        graph call partitions by its `custom_partitioning` rule there (`partitioning.py`), and the results are typed
        like the query. Called on the explicit axes themselves, a graph call's results (a `jax.ffi.ffi_call`'s) would
        be typed replicated: XLA would gather them onto every device, and their cotangents would not match the
        operands' types."""
        mesh = jax.sharding.get_abstract_mesh()
        if mesh_visibility.explicit_axes(mesh):
            run = lambda inputs: self._run(config, inputs, context)  # noqa: E731
            return mesh_visibility.with_automatic_axes(run, inputs, mesh)
        return self._run(config, inputs, context)

    def _run(self, config: AttentionConfig, inputs: AttentionInputs, context: Context) -> tuple[jax.Array, ...]:
        from . import attention, modifier, paged  # the graph code loads when a call is traced, not at import

        reason = self._policy_reason(config)
        if reason is not None:
            raise NotImplementedError(reason)
        graph_executor = self.graph_executor()
        if config.layout == "paged":
            return paged.attention(config, inputs, graph_executor, fallback=context.fallback)
        # Packed rows run as THD unless their structure rides in a bias next to a mask or modifier.
        if config.layout != "dense" or (config.has_segments and not modifier.visibility_as_bias(config)):
            options = varlen.Options(executor=graph_executor, ragged_stats=self.ragged_stats)
            return varlen.attention(config, inputs, options, unbounded=context.unbounded)
        return attention.attention(config, inputs, graph_executor, self.device)
