"""CPU test: the cuDNN path lowers (for CUDA) to one `attnlib_cudnn_graph` custom call with its attributes.

Needs attnlib's native extension (compiled in CI from the header packages) but no GPU: a stand-in `GraphEntry`
replaces the graph build, which needs a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnlib
from attnlib._src import dispatch
from attnlib._src.backends.cudnn import cache, executor, ffi, support


pytestmark = pytest.mark.skipif(ffi.unavailable_reason() is not None, reason=f"{ffi.unavailable_reason()}")


@dataclasses.dataclass(frozen=True)
class StandInEntries(executor.FfiExecutor):
    """The real FFI call of stand-in built graphs (no cuDNN here): what the CUDA lowering shows."""

    workspace_bytes: int = 4 << 20

    def get_entry(self, spec):
        return cache.GraphEntry(
            blob=b"\x7bblob-" + spec.label.encode(), workspace_bytes=self.workspace_bytes,
            in_uids=tuple(int(u) for u in spec.in_uids()), out_uids=tuple(int(u) for u in spec.out_uids()),
            zero_fill=spec.zero_fill(), label=spec.label,
        )


def _lowering_cudnn(monkeypatch) -> attnlib.Cudnn:
    """`attnlib.Cudnn` with stand-in built graphs as on an H200 with cuDNN 9.19, which the name `"cudnn"` stands for
    in this test (context parallelism passes the name on)."""
    device = support.Device(compute_capability=(9, 0), name="NVIDIA H200", cudnn_version=91900)
    cudnn = attnlib.Cudnn(executor=StandInEntries(), device=device)
    monkeypatch.setitem(dispatch.REGISTRY, "cudnn", lambda: cudnn)
    return cudnn


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_forward_lowers_to_one_custom_call_with_attributes():
    from attnlib._src.backends.cudnn.graphs import GraphSpec

    spec = GraphSpec("fwd", "bfloat16", 2, 16, 24, 4, 2, 64, 32, 0.125, padding=True)
    q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 24, 2, 64), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 24, 2, 32), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    text = _lower(lambda *a: executor.graph_call(spec, StandInEntries())(*a), q, k, v, lengths, lengths)
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @attnlib_cudnn_graph" in line]
    assert len(calls) == 1, text
    call = calls[0]
    blob = list(b"\x7bblob-" + spec.label.encode())
    assert f"graph = dense<{blob}> : tensor<{len(blob)}xui8>".replace(" ", "") in call.replace(" ", "")
    assert "in_uids = dense<[1, 2, 3, 12, 13]> : tensor<5xi64>" in call
    assert "out_uids = dense<[4, 5]> : tensor<2xi64>" in call
    assert "ws_bytes = 4194304 : i64" in call
    assert f'label = "{spec.label}"' in call
    assert "replay = true" in call
    assert "-> (tensor<2x16x4x32xbf16>, tensor<2x4x16xf32>, tensor<4194304xui8>)" in call


@pytest.mark.parametrize("workspace_bytes", [0, 1, 4 << 20])
def test_workspace_result_only_when_the_plan_needs_one(workspace_bytes):
    """A plan that needs no workspace gets no workspace result (XLA allocates no temporary buffer for it)."""
    from attnlib._src.backends.cudnn.graphs import GraphSpec

    spec = GraphSpec("fwd", "bfloat16", 2, 16, 24, 4, 2, 64, 64, 0.125)
    q = jax.ShapeDtypeStruct((2, 16, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 24, 2, 64), jnp.bfloat16)
    text = _lower(lambda *a: executor.graph_call(spec, StandInEntries(workspace_bytes=workspace_bytes))(*a), q, kv, kv)
    call = next(line for line in text.splitlines() if "custom_call @attnlib_cudnn_graph" in line)
    assert f"ws_bytes = {workspace_bytes} : i64" in call, call
    results = "(tensor<2x16x4x64xbf16>, tensor<2x4x16xf32>"
    if workspace_bytes:
        assert f"-> {results}, tensor<{workspace_bytes}xui8>)" in call, call
    else:
        assert f"-> {results})" in call and "xui8>)" not in call, call


def test_vmap_folds_into_one_bigger_call():
    from attnlib._src.backends.cudnn.graphs import GraphSpec

    spec = GraphSpec("bwd", "float16", 2, 16, 16, 4, 4, 64, 64, 0.125, bias_b=1, bias_n=4)
    x = jax.ShapeDtypeStruct((3, 2, 16, 4, 64), jnp.float16)
    stats = jax.ShapeDtypeStruct((3, 2, 4, 16), jnp.float32)
    bias = jax.ShapeDtypeStruct((1, 4, 16, 16), jnp.float16)
    fn = jax.vmap(lambda q, k, v, o, do, st, b: executor.graph_call(spec, StandInEntries())(q, k, v, o, do, st, b),
                  in_axes=(0, 0, 0, 0, 0, 0, None))
    text = _lower(fn, x, x, x, x, x, stats, bias)
    assert text.count("stablehlo.custom_call @attnlib_cudnn_graph") == 1, text
    call = next(line for line in text.splitlines() if "custom_call @attnlib_cudnn_graph" in line)
    assert "tensor<6x16x4x64xf16>" in call and "tensor<6x4x16x16xf16>" in call, call  # batch 3*2, bias tiled


def _ubjson(value) -> bytes:
    """A minimal UBJSON encoder (objects, strings, small ints) matching nlohmann's output."""
    if isinstance(value, dict):
        out = b"{"
        for key in sorted(value):
            out += b"i" + bytes([len(key)]) + key.encode() + _ubjson(value[key])
        return out + b"}"
    if isinstance(value, str):
        return b"S" + b"i" + bytes([len(value)]) + value.encode()
    if isinstance(value, int):
        for marker, size in ((b"i", 1), (b"I", 2), (b"l", 4), (b"L", 8)):
            if -(1 << (8 * size - 1)) <= value < (1 << (8 * size - 1)):
                return marker + int(value).to_bytes(size, "big", signed=True)
    raise TypeError(value)


def test_canonicalize_zeroes_the_graph_id():
    ext = ffi.extension()
    graph = {"json_version": "2.0", "cudnn_frontend_version": 13200, "cudnn_backend_version": "9.19.0", "gid": 0}
    canonical = ext.canonicalize_graph(_ubjson(graph))
    assert canonical == _ubjson(graph)  # already canonical: unchanged
    for gid in (0, 7, 123456):
        assert ext.canonicalize_graph(_ubjson({**graph, "gid": gid})) == canonical
    assert ext.canonicalize_graph(_ubjson({**graph, "json_version": "2.1"})) != canonical
    assert ext.graph_versions(canonical) == ("2.0", 13200, "9.19.0")
    with pytest.raises(ValueError, match="not a serialized cuDNN graph"):
        ext.canonicalize_graph(b"CUDNN_FE_PYPLAN\0")


def test_extension_matches_the_frontend_package():
    import importlib.metadata

    code = ffi.extension().frontend_version()
    assert f"{code // 10000}.{code // 100 % 100}.{code % 100}" == importlib.metadata.version("nvidia-cudnn-frontend")
    assert ffi.extension().graph_json_version() == "2.0"
    assert np.int64(code) == 13200


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_context_parallel_gradient_traces_on_cudnn_inside_shard_map(monkeypatch, strategy):
    """Inside `shard_map`, cuDNN's FFI results must vary like its operands, or the VJPs of the per-step calls reject
    their cotangents at trace time (found on the H200; this catches it without a GPU)."""
    from jax.sharding import Mesh, PartitionSpec as P

    import attnlib.context_parallel as cp

    _lowering_cudnn(monkeypatch)
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    seq = P(None, "sp")

    def local(q, k, v, sinks):
        return cp.attention(q, k, v, axis_name="sp", strategy=strategy, sinks=sinks, is_causal=True,
                            implementation="cudnn")  # fmt: skip

    def loss(q, k, v, sinks):
        out = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq)(q, k, v, sinks)
        return jnp.sum(out.astype(jnp.float32))

    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 64, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
    text = _lower(jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, sinks)
    labels = [line for line in text.splitlines() if "custom_call @attnlib_cudnn_graph" in line]
    assert any("sdpa_fwd_" in line for line in labels) and any("sdpa_bwd_" in line for line in labels), text


def test_forward_only_call_runs_the_graph_without_stats(monkeypatch):
    import attnlib

    _lowering_cudnn(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 48, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 40, 2, 64), jnp.bfloat16)

    def calls(**kw):
        attend = lambda q, k, v: attnlib.attention(q, k, v, is_causal=True, implementation="cudnn", **kw)
        text = _lower(attend, q, kv, kv)
        return [line for line in text.splitlines() if "custom_call @attnlib_cudnn_graph" in line]

    inference = calls()
    assert len(inference) == 1 and "sdpa_fwd_nostats_" in inference[0] and "out_uids = dense<4>" in inference[0]
    with_lse = calls(return_residual=True)
    assert len(with_lse) == 1 and "sdpa_fwd_b2" in with_lse[0] and "out_uids = dense<[4, 5]>" in with_lse[0]
    key = jax.random.key(0)
    with_dropout = calls(dropout_rate=0.1, dropout_key=key)
    assert len(with_dropout) == 1 and "nostats" not in with_dropout[0]
