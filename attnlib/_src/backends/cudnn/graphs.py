"""Forward and backward SDPA graphs built with the cuDNN frontend's Python API, serialized for the FFI executor.

A graph is fully described by a `GraphSpec` (`graph_spec.py`: the UID table shared with the C++ executor and the
tensors' layouts).

The plan is always a cuDNN *backend* plan (a Python-engine plan serializes to a blob C++ cannot read), and the blob
is canonicalized (its process-global graph id zeroed) so equal specs give equal bytes in every process. Which of the
heuristics' backend plans is kept is plan autotuning's choice (`autotune.py`).
"""

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

from . import ffi, support
from .autotune import _BuiltPlan, _candidates_wanted, _choose, autotune_mode
from .cache import GraphEntry
from .graph_spec import (
    _layout,
    _ragged_offset,
    FP8_AMAXES as FP8_AMAXES,
    FP8_SCALES as FP8_SCALES,
    graph_data_type,
    GraphSpec as GraphSpec,
    MODIFIER_ARG_UID as MODIFIER_ARG_UID,
    RAGGED_OFFSETS,
    Uid as Uid,
)
from .modifier import ScoreModifier


logger = logging.getLogger("attnlib")

PYPLAN_MAGIC = b"CUDNN_FE_PYPLAN"


class GraphRejected(NotImplementedError):
    """cuDNN refused to build a graph that attnlib's policy expected it to accept (its message says why)."""


def backend_plan_indices(engine_ids: Sequence[int], is_backend: Any) -> list[int]:
    """Indices, in heuristic order, of the plans served by the cuDNN backend (never a Python engine, whose blob C++
    cannot read).

    Raises:
        NotImplementedError: when every plan is a Python engine.
    """
    indices = [i for i, engine_id in enumerate(engine_ids) if engine_id == -1 or is_backend(engine_id)]
    if not indices:
        raise NotImplementedError(
            f"cudnn: only Python-engine plans (engine ids {list(engine_ids)}) serve this graph; their serialized form "
            "cannot be executed by attnlib's C++ extension."
        )
    return indices


def check_blob(blob: bytes) -> None:
    """Reject a blob the C++ executor cannot load."""
    if blob.startswith(PYPLAN_MAGIC):
        raise NotImplementedError(
            "cudnn: the cuDNN frontend serialized a Python-engine plan (CUDNN_FE_PYPLAN), which attnlib's C++ "
            "extension cannot execute."
        )


@functools.cache
def _handle() -> Any:
    import cudnn

    return cudnn.create_handle()


def _data_type(cudnn: Any, name: str) -> Any:
    return {
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
        "float32": cudnn.data_type.FLOAT,
        "int32": cudnn.data_type.INT32,
        "int64": cudnn.data_type.INT64,
        "float8_e4m3fn": cudnn.data_type.FP8_E4M3,
    }[name]


def _modifier_callbacks(modifier: ScoreModifier, args: list[Any]) -> tuple[Any, Any]:
    """cuDNN's `score_mod(graph, score)` and `score_mod_bprop(graph, d_score)` for `modifier`. Inside a backward
    graph cuDNN calls the first (recomputing the forward) before the second, which may read the forward's tensors
    through `store` (`score_mod_lowering.emit_backward`)."""
    import cudnn

    from . import score_mod_lowering as lowering

    store: dict[Any, Any] = {}

    class Indices:
        """batch, head, query row, key column of the callback's score tensor, each created on first use (an unused
        gen_index would be a dangling node, which cuDNN's fused attention does not build)."""

        def __init__(self, graph: Any, like: Any):
            self.graph, self.like, self.made = graph, like, {}

        def __getitem__(self, axis: int) -> Any:
            if axis not in self.made:
                index = self.graph.gen_index(input=self.like, axis=axis)
                index.set_data_type(cudnn.data_type.INT32)
                self.made[axis] = index
            return self.made[axis]

        def __len__(self) -> int:
            return 4

    def indices(graph: Any, like: Any) -> Any:
        return lambda: Indices(graph, like)

    def forward(graph: Any, score: Any) -> Any:
        ops = lowering.CudnnOps(graph)
        return lowering.emit_forward(ops, modifier.jaxpr, score, indices(graph, score), args, store)

    def backward(graph: Any, d_score: Any) -> Any:
        ops = lowering.CudnnOps(graph)
        return lowering.emit_backward(ops, modifier.jaxpr, d_score, indices(graph, d_score), args, store)

    return forward, backward


def _define(spec: GraphSpec) -> Any:
    """The pygraph of `spec` with its execution plans created (heuristics A, then the fallback list)."""
    import cudnn

    io = _data_type(cudnn, "float8_e4m3fn" if spec.fp8 else spec.dtype)
    graph = cudnn.pygraph(
        name=f"attnlib_{spec.direction}",
        io_data_type=io,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(),
    )
    tensors = {}
    uids = spec.in_uids()
    # Offsets first: the packed tensors refer to them.
    for uid in sorted(uids, key=lambda u: u not in RAGGED_OFFSETS.values()):
        dim, stride = _layout(uid, spec)
        extra = {}
        if _ragged_offset(uid, spec) is not None:
            extra["ragged_offset"] = tensors[_ragged_offset(uid, spec)]
        tensors[uid] = graph.tensor(
            dim=dim, stride=stride, data_type=_data_type(cudnn, graph_data_type(uid, spec)), uid=int(uid),
            name=getattr(uid, "name", f"ARG{int(uid)}"), **extra,
        )

    # A runtime scale is a float32 [1,1,1,1] device tensor like the dropout seeds and FP8 scales (not pass-by-value:
    # under jit its value lives on the device), bound by uid as every other operand.
    scale = tensors[Uid.ATTN_SCALE] if spec.scale is None else float(spec.scale)
    options: dict[str, Any] = {"attn_scale": scale}
    if spec.left_bound is not None or spec.right_bound is not None:
        alignment = cudnn.diagonal_alignment
        bottom_right = spec.alignment == "bottom_right"
        options["diagonal_alignment"] = alignment.BOTTOM_RIGHT if bottom_right else alignment.TOP_LEFT
        if spec.left_bound is not None:
            options["diagonal_band_left_bound"] = int(spec.left_bound)
        if spec.right_bound is not None:
            options["diagonal_band_right_bound"] = int(spec.right_bound)
    if spec.padding:
        options.update(use_padding_mask=True, seq_len_q=tensors[Uid.SEQ_Q], seq_len_kv=tensors[Uid.SEQ_KV])
    if spec.bias_b:
        options["bias"] = tensors[Uid.BIAS]
    if spec.dropout > 0:
        options["dropout"] = (float(spec.dropout), tensors[Uid.SEED], tensors[Uid.OFFSET])
    if spec.sinks:
        options["sink_token"] = tensors[Uid.SINK]
    if spec.pages:
        options.update(
            paged_attention_k_table=tensors[Uid.PT_K],
            paged_attention_v_table=tensors[Uid.PT_V],
            paged_attention_max_seq_len_kv=int(spec.s),
        )
    if spec.ragged and spec.direction == "bwd" and spec.t_total:
        options.update(max_total_seq_len_q=int(spec.t_total), max_total_seq_len_kv=int(spec.s_total))
    if spec.modifier is not None:
        arg_tensors = [tensors[u] for u in spec.in_uids() if u >= MODIFIER_ARG_UID]
        forward, backward = _modifier_callbacks(spec.modifier, arg_tensors)
        options["score_mod"] = forward
        if spec.direction == "bwd":
            options["score_mod_bprop"] = backward

    def set_output(t: Any, uid: Uid) -> None:
        dim, stride = _layout(uid, spec)
        t.set_output(True).set_dim(dim).set_stride(stride).set_uid(int(uid)).set_data_type(
            _data_type(cudnn, graph_data_type(uid, spec))
        )
        if _ragged_offset(uid, spec) is not None:
            t.set_ragged_offset(tensors[_ragged_offset(uid, spec)])

    if spec.direction == "fwd" and spec.fp8:
        scales = [tensors[u] for u in FP8_SCALES]
        for band in ("left", "right"):  # sdpa_fp8 names the diagonal band bounds without the prefix
            if f"diagonal_band_{band}_bound" in options:
                options[f"{band}_bound"] = options.pop(f"diagonal_band_{band}_bound")
        o, stats, amax_s, amax_o = graph.sdpa_fp8(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], *scales, generate_stats=spec.stats, name="sdpa_fp8",
            **options,
        )
        set_output(o, Uid.O)
        if spec.stats:
            set_output(stats, Uid.STATS)
        set_output(amax_s, Uid.AMAX_S)
        set_output(amax_o, Uid.AMAX_O)
    elif spec.direction == "fwd":
        row_max = {}
        if spec.row_max:
            for uid, option in ((Uid.SCORE_MAX, "score_max"), (Uid.SUM_EXP, "score_sum_exp")):
                dim, stride = _layout(uid, spec)
                row_max[uid] = options[option] = graph.tensor(
                    dim=dim, stride=stride, data_type=cudnn.data_type.FLOAT, uid=int(uid), name=uid.name
                )
        o, stats = graph.sdpa(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], generate_stats=spec.stats and not spec.row_max,
            name="sdpa", **options,
        )
        set_output(o, Uid.O)
        for uid, tensor in row_max.items():
            set_output(tensor, uid)
        if spec.stats and not spec.row_max:
            set_output(stats, Uid.STATS)
    else:
        if spec.bias_b and spec.bias_grad:
            dim, stride = _layout(Uid.DBIAS, spec)
            options["dBias"] = graph.tensor(dim=dim, stride=stride, data_type=io, uid=int(Uid.DBIAS), name="DBIAS")
        dq, dk, dv = graph.sdpa_backward(
            tensors[Uid.Q], tensors[Uid.K], tensors[Uid.V], tensors[Uid.O], tensors[Uid.DO], tensors[Uid.STATS],
            use_deterministic_algorithm=spec.deterministic, name="sdpa_backward", **options,
        )
        set_output(dq, Uid.DQ)
        set_output(dk, Uid.DK)
        set_output(dv, Uid.DV)
        if spec.bias_b and spec.bias_grad:
            set_output(options["dBias"], Uid.DBIAS)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return graph


def _finish(graph: Any, index: int) -> _BuiltPlan:
    """Build the plan at `index` of `graph` and serialize it (canonical bytes)."""
    graph.select_plan(index)
    graph.check_support()
    graph.build_plans()
    if graph.selected_engine is not None:
        raise NotImplementedError(
            f"cudnn: the frontend selected Python engine {graph.selected_engine.name!r}, which attnlib's C++ "
            "extension cannot execute."
        )
    workspace = int(graph.get_workspace_size())
    blob = bytes(graph.serialize(as_bytes=True))
    check_blob(blob)
    try:
        name = str(graph.get_plan_name_at_index(index))
    except Exception:  # a name is only for the record
        name = f"plan {index}"
    return _BuiltPlan(index, name, ffi.extension().canonicalize_graph(blob), workspace)


def _build_candidates(spec: GraphSpec, graph: Any, candidates: list[int], wanted: int) -> list[_BuiltPlan]:
    """The first `wanted` candidate plans that build, in heuristic order (plans cuDNN cannot build, e.g. a runtime
    compilation failure, are skipped as the frontend's own walk would).

    Raises:
        NotImplementedError: when none builds (with the first plan's error).
    """
    built: list[_BuiltPlan] = []
    errors: list[str] = []
    for index in candidates:
        if len(built) >= wanted:
            break
        try:
            built.append(_finish(graph, index))
            continue
        except Exception:  # the frontend may refuse to re-plan this graph object: retry the plan on a fresh one
            graph = _define(spec)
        try:
            built.append(_finish(graph, index))
        except Exception as e:
            errors.append(f"plan {index}: {e}")
            logger.info("attnlib: cuDNN plan %d of %s did not build (%s).", index, spec.label, e)
            graph = _define(spec)
    if not built:
        raise NotImplementedError("; ".join(errors) or "cuDNN offered no plan")
    return built


def build(spec: GraphSpec, autotune: str | None = None) -> GraphEntry:
    """Build, finalize and serialize the graph of `spec` on this process's GPU, choosing its plan as `autotune` says
    (`"autotuned"`, `"heuristics"` or `"all"`: `autotune.py`; default `ATTNLIB_CUDNN_AUTOTUNE`).

    Raises:
        NotImplementedError: when cuDNN rejects the graph (with its message).
    """
    mode = autotune_mode() if autotune is None else autotune
    support.device()  # initializes JAX's CUDA backend first, so the frontend binds the libcudnn JAX loaded
    import cudnn
    import cudnn.engines

    try:
        graph = _define(spec)
        candidates = backend_plan_indices([p.engine_id for p in graph.plans], cudnn.engines.is_backend_engine)
        built = _build_candidates(spec, graph, candidates, _candidates_wanted(spec, mode))
        if mode == "heuristics":
            chosen, record = built[0], f"{built[0].name} (heuristics' first)"
        elif len(built) == 1:
            chosen, record = built[0], f"{built[0].name} (the only backend plan that builds)"
        else:
            chosen, record = _choose(spec, built)
    except (cudnn.cudnnGraphNotSupportedError, RuntimeError, ValueError, NotImplementedError) as e:
        raise GraphRejected(f"cudnn: cuDNN rejected the {spec.direction} graph ({spec.label}): {e}") from e
    entry = GraphEntry(
        blob=chosen.blob,
        workspace_bytes=chosen.workspace,
        in_uids=tuple(int(u) for u in spec.in_uids()),
        out_uids=tuple(int(u) for u in spec.out_uids()),
        zero_fill=spec.zero_fill(),
        label=spec.label,
        plan=record,
    )
    return entry


def _frontend_package_version() -> str:
    """The installed nvidia-cudnn-frontend version ("absent" on a pure-JAX install, where no graph is ever built)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def cache_key(spec: GraphSpec, device: "support.Device", autotune: str | None = None) -> dict[str, Any]:
    """Everything the serialized graph depends on (`autotune` as `build`'s)."""
    mode = autotune_mode() if autotune is None else autotune

    described = dataclasses.asdict(dataclasses.replace(spec, modifier=None))
    described["modifier"] = None if spec.modifier is None else spec.modifier.key
    return {
        "format": 4,
        "spec": described,
        "plan_selection": {"all": "autotuned_all"}.get(mode, mode),
        "cudnn": device.cudnn_version,
        "cudnn_frontend": _frontend_package_version(),
        "compute_capability": list(device.compute_capability),
        "gpu": device.name,
    }
