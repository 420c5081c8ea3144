"""The real cuDNN graph call on CPU, for tests: attnlib's FFI target with a test-only CPU handler.

`install(monkeypatch)` makes `implementation="cudnn"` trace as on an H200 with an executor that replaces only the
graph *build* (`CpuGraphExecutor.get_entry` returns a stand-in whose `label` names its `GraphSpec`), and registers the
native extension's test-only CPU handler of `attnlib_cudnn_graph` (`_attnlib_ffi.cpu_test_handler`). Every call is then
the real `jax.ffi.ffi_call` inside attnlib's `custom_partitioning`, so XLA partitions it (or, without the rule,
replicates it) as on a GPU, and each call's buffers go to the CPU model of the graph (`cudnn_emulation.emulate_graph`)
with the spec of its label.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from cudnn_emulation import emulate_graph, h200

import attnlib
from attnlib._src import dispatch
from attnlib._src.backends.cudnn import cache, executor, ffi
from attnlib._src.backends.cudnn.graphs import GraphSpec


_SPECS: dict[str, GraphSpec] = {}
_NUMBERS = itertools.count()

# XLA FFI dtype codes (xla/ffi/api/c_api.h) of the arrays a graph call binds.
_DTYPES = {4: np.int32, 6: np.uint8, 10: np.float16, 11: np.float32, 16: jnp.bfloat16, 20: jnp.float8_e4m3fn}


def entry_for(spec: GraphSpec) -> cache.GraphEntry:
    """A stand-in built graph whose label is a key of `spec` (the CPU model reads the spec back from it)."""
    label = f"{spec.label}#{next(_NUMBERS)}"
    _SPECS[label] = spec
    return cache.GraphEntry(
        blob=b"{}", workspace_bytes=0, in_uids=tuple(map(int, spec.in_uids())),
        out_uids=tuple(map(int, spec.out_uids())), zero_fill=spec.zero_fill(), label=label,
    )  # fmt: skip


def _model(label: str, args: list, rets: list) -> list[bytes]:
    """The CPU handler's callback: the emulated graph of `label`'s spec on the call's buffers."""
    spec = _SPECS[label]
    arrays = [jnp.asarray(np.frombuffer(data, _DTYPES[code]).reshape(dims)) for code, dims, data in args]
    tokens = (args[0][1][0], args[1][1][0]) if spec.ragged else None
    with jax.default_device(jax.devices("cpu")[0]):
        outs = emulate_graph(spec, None, *arrays, tokens=tokens)
    produced = []
    for (code, dims), x in zip(rets, outs, strict=True):
        x = np.asarray(x).astype(_DTYPES[code])
        assert x.shape == tuple(dims), (label, x.shape, dims)
        produced.append(x.tobytes())
    return produced


@functools.cache
def _register() -> None:
    handlers = ffi.extension().cpu_test_handler(_model)
    jax.ffi.register_ffi_target(ffi.TARGET, handlers, platform="cpu")


@dataclasses.dataclass(frozen=True)
class CpuGraphExecutor(executor.FfiExecutor):
    """The real executor's call (the FFI call inside attnlib's partitioning) with stand-in built graphs."""

    def get_entry(self, spec: GraphSpec) -> cache.GraphEntry:
        return entry_for(spec)


def install(monkeypatch, version: int = 91900) -> attnlib.Cudnn:
    """Route `implementation="cudnn"` through the real FFI call and attnlib's partitioning, run by the CPU model."""
    _register()
    cudnn = attnlib.Cudnn(executor=CpuGraphExecutor(), device=h200(version))
    monkeypatch.setitem(dispatch.REGISTRY, "cudnn", lambda: cudnn)
    return cudnn
