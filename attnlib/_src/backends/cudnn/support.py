"""What cuDNN's fused attention accepts: a pure-Python policy with a reason for every refusal.

`policy_reason` is a pure function of the static configuration, the GPU's compute capability and the cuDNN version
(testable anywhere). `decline_reason` gathers those from the running process: it never imports the cuDNN frontend
and does nothing GPU-specific unless JAX sees a CUDA device.
"""

import dataclasses
import functools
import os
import sys

import jax
import numpy as np

from ...band import Band
from ...config import AttentionConfig
from .. import placement
from . import ffi, modifier as modifier_lib


@dataclasses.dataclass(frozen=True)
class Device:
    """The GPU graphs are built for.

    Attributes:
        compute_capability: `(major, minor)`, e.g. `(9, 0)`.
        name: the device kind, e.g. `"NVIDIA H200"`.
        cudnn_version: the loaded cuDNN backend, e.g. `91900` for 9.19.0.
    """

    compute_capability: tuple[int, int]
    name: str
    cudnn_version: int


def version_string(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def cudnn_library_hint() -> str:
    """A path to `libcudnn.so.9` from the nvidia-cudnn wheels on `sys.path`, or ""."""
    for entry in sys.path:
        candidate = os.path.join(entry or ".", "nvidia", "cudnn", "lib", "libcudnn.so.9")
        if os.path.exists(candidate):
            return candidate
    return ""


JAX_CUDA = 'python3 -m pip install -U "jax[cuda13]"'
"""The command that installs JAX's CUDA plugin with the newest CUDA and cuDNN wheels."""


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver and device, whatever JAX sees."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


@functools.cache
def _device() -> tuple[Device | None, str | None]:
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:
        return None, f"JAX has no GPU backend ({e})"
    if not gpus:
        if nvidia_driver_present():
            return None, (
                "no CUDA GPU visible to JAX, though this machine has an NVIDIA GPU: JAX's CUDA plugin is not "
                f"installed. Fix: `{JAX_CUDA}`"
            )
        return None, "no CUDA GPU visible to JAX"
    gpu = gpus[0]
    capability = getattr(gpu, "compute_capability", None)
    if capability is None:
        return None, f"JAX device {gpu} reports no CUDA compute capability (not an NVIDIA GPU?)"
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    kinds = {d.device_kind for d in gpus}
    if len(kinds) > 1:
        return None, f"mixed GPU models {sorted(kinds)}: cuDNN plans are built for one model"
    try:
        version = ffi.extension().load_cudnn(cudnn_library_hint())
    except NotImplementedError as e:
        return None, str(e).removeprefix("cudnn: ")
    except RuntimeError as e:
        return None, f"cannot load cuDNN: {e}. Fix: `{JAX_CUDA}`"
    return Device((major, minor), gpu.device_kind, int(version)), None


def device() -> Device:
    """The GPU and cuDNN of this process.

    Raises:
        NotImplementedError: when there is none usable (with the reason).
    """
    dev, reason = _device()
    if dev is None:
        raise NotImplementedError(f"cudnn: {reason}")
    return dev


def writes_padding_zeros(cudnn_version: int) -> bool:
    """Whether this cuDNN is known to write zeros in the rows past each query and key length of a padded dense graph
    (O, dQ, dK, dV), which its documentation does not promise: checked on 9.19 and 9.27 on the H200 (2026-12-06,
    `tests/test_cudnn_version_limits_gpu.py`) and by the GPU tests' exact-zero checks. On the versions between and
    after them, not measured, attnlib zero-fills those results itself (a memset before the graph, 5-8 % of a padded
    call; docs/performance.md, "How attnlib's choices were measured")."""
    return cudnn_version // 100 in (919, 927)


def _bottom_right(config: AttentionConfig) -> bool:
    """Whether the diagonal alignment changes anything for this call."""
    padded = config.has_q_lengths or config.has_kv_lengths
    return Band.of(config).bottom_right and (config.q_len != config.kv_len or padded)


def effective_right(config: AttentionConfig) -> int | None:
    """How far right of its aligned diagonal a query sees (None = unbounded): `Band.of(config).right`."""
    return Band.of(config).right


MAX_OFFSET = 2**31
"""Ragged offsets are computed in int32 (JAX runs without 64-bit integers): element offsets must stay below this."""


def is_ragged(config: AttentionConfig) -> bool:
    """THD, or packed rows (segment ids) mapped to THD."""
    return config.layout == "thd" or (config.layout == "dense" and config.has_segments)


def _layout_reason(config: AttentionConfig, capability: tuple[int, int], cudnn_version: int) -> str | None:
    """The limits specific to THD, packed rows and paged caches (None for a plain dense call)."""
    sm = f"sm_{capability[0]}{capability[1]}"
    left = None if config.window is None else config.window[0]
    right = effective_right(config)
    masked = left is not None or right is not None
    if config.layout == "paged":
        return _paged_reason(config, cudnn_version)
    if not is_ragged(config):
        return None
    reason = _mask_or_modifier_reason(config)
    if reason is not None:
        return reason
    what = "THD (`cu_seqlens_q`)" if config.layout == "thd" else "packed rows (`q_segment_ids`/`kv_segment_ids`)"
    if config.layout == "thd" and config.num_sequences is None:
        return "cudnn: a THD call needs `cu_seqlens_q` (the number of sequences is unknown)."
    if cudnn_version < 90600:
        return f"cudnn: {what} needs cuDNN 9.6 or newer (64-bit ragged offsets, GQA backward); found " + (
            f"{version_string(cudnn_version)}."
        )
    if capability < (9, 0) and cudnn_version < 91801:
        return f"cudnn: {what} needs compute capability 9.0 or newer before cuDNN 9.18.1; the GPU is {sm}."
    if config.has_bias:
        return f"cudnn: a `bias` with {what} is not supported."
    if config.diagonal_alignment == "bottom_right" and masked:
        if right is None or right > 0:
            return (
                f"cudnn: `diagonal_alignment='bottom_right'` with {what} needs causal masking or a window with "
                f"right <= 0 (queries that see no key are then sliced off per sequence); got window={config.window}."
            )
        if config.dropout_rate > 0:
            return "cudnn: `diagonal_alignment='bottom_right'` with dropout is not supported by cuDNN."
    if config.deterministic_backward and capability[0] in (8, 12):
        return f"cudnn: `deterministic_backward` with {what} is not supported on {sm}."
    width = max(config.head_dim, config.value_head_dim)
    q_tokens = config.q_len * config.batch_size
    kv_tokens = config.kv_len * config.batch_size
    if q_tokens * config.num_q_heads * width >= MAX_OFFSET or kv_tokens * config.num_kv_heads * width >= MAX_OFFSET:
        return (
            f"cudnn: {what} with more than 2**31 elements per packed tensor is not supported (attnlib computes "
            f"ragged offsets in int32); got {q_tokens} query and {kv_tokens} key tokens."
        )
    return None


def _mask_or_modifier_reason(config: AttentionConfig) -> str | None:
    """Why THD or packed rows cannot take the call's boolean `mask` or score modifier, or None."""
    kind = "THD (`cu_seqlens_q`)" if config.layout == "thd" else "packed rows (segment ids)"
    if config.has_mask:
        return f"cudnn: a boolean `mask` with {kind} is not supported."
    if modifier_lib.uses_modifier(config):
        return (
            f"cudnn: `score_mod`/`mask_mod`/`logits_soft_cap` with {kind} is not supported (cuDNN 9.19 and 9.27 "
            "refuse its padding mask together with a score modifier; without it a packed graph would write each "
            "sequence's rows over the next one's)."
        )
    return None


def _paged_reason(config: AttentionConfig, cudnn_version: int) -> str | None:
    """The limits of cuDNN's paged forward graph (`paged.py`), dense or ragged queries."""
    if config.kv_layout != "token_major":
        return (
            f"cudnn: a PagedKVCache in the {config.kv_layout!r} layout is not read by cuDNN's paged graphs (they "
            "read token-major pools): create it with layout=\"token_major\" (the default on a GPU) or convert it "
            "once with cache.to_layout(\"token_major\")."
        )
    if config.page_size is None or config.pages_per_seq is None or config.num_pages is None:
        return "cudnn: a paged call needs `page_table` geometry (page size, pages per sequence, pool size)."
    if not config.has_kv_lengths:
        return "cudnn: `page_table` needs `key_value_seq_lengths` (cuDNN's paged attention uses a padding mask)."
    if cudnn_version < 90500:
        return f"cudnn: paged key/value caches need cuDNN 9.5 or newer; found {version_string(cudnn_version)}."
    if max(config.head_dim, config.value_head_dim) > 128 and cudnn_version < 91000:
        return "cudnn: paged key/value caches with head dims above 128 need cuDNN 9.10 or newer."
    if config.has_bias:
        return "cudnn: a `bias` with a paged key/value cache (`page_table`) is not supported."
    if config.has_mask:
        return "cudnn: a boolean `mask` with a paged key/value cache (`page_table`) is not supported."
    if modifier_lib.uses_modifier(config):
        return (
            "cudnn: `score_mod`/`mask_mod`/`logits_soft_cap` with a paged key/value cache (`page_table`) is not "
            "supported (attnlib's cuDNN paged graph has no score modifier)."
        )
    if config.dropout_rate > 0:
        return "cudnn: dropout with a paged key/value cache (`page_table`) is not supported (inference only)."
    if config.has_sinks:
        return (
            "cudnn: `sinks` with a paged key/value cache (`page_table`) are not supported (cuDNN rejects sinks "
            "for single-query decode, and attnlib does not wire them for paged prefill)."
        )
    if config.ragged_queries:
        if config.num_sequences is None or config.max_seqlen_q is None:
            return "cudnn: ragged paged queries need `cu_seqlens_q` (the number of sequences is unknown)."
        if config.max_seqlen_q > config.kv_len:
            return (
                "cudnn: ragged queries (`cu_seqlens_q`) against a paged cache run as rows of max_seqlen_q queries per "
                "sequence, which cuDNN's paged graph needs <= pages_per_seq * page_size (max query length <= max key "
                f"length); got max_seqlen_q={config.max_seqlen_q}, pages_per_seq * page_size={config.kv_len}. Pass "
                "`max_seqlen_q` (the longest chunk of the step; it defaults to all the packed tokens)."
            )
    elif config.q_len > config.kv_len:
        return (
            f"cudnn: a paged call needs T <= pages_per_seq * page_size (cuDNN's max query length <= max key "
            f"length); got T={config.q_len}, pages_per_seq * page_size={config.kv_len}."
        )
    return None


def runtime_scale_reason(config: AttentionConfig) -> str | None:
    """Why a dense call with `scale` as an array is not served, or None. The runtime-scale graphs ran correctly on
    an H200 with cuDNN 9.19 only without score masks (plain and with `logits_soft_cap`, values and gradients against
    `xla`); with `is_causal` the results were wrong and a `bias` with a window was refused (no engine), measured
    2026-12-05 by `tests/test_traced_scale.py::test_cudnn_gpu_traced_scale`. Everything else not measured there
    declines too, so no unmeasured combination can be silently wrong. THD and paged layouts have no runtime-scale
    graphs at all."""
    if config.layout != "dense":
        return (
            f"cudnn: `scale` as an array (traced or learned) is supported on dense calls only, not on {config.layout} "
            "ones; pass a Python float, or use implementation='xla_chunked'."
        )
    extras = [
        (config.is_causal, "a causal mask"), (config.window is not None, "a window"), (config.has_bias, "a bias"),
        (config.has_mask, "a mask"), (config.has_q_lengths or config.has_kv_lengths, "padding lengths"),
        (config.has_segments, "segment ids"), (config.has_modifiers, "a score_mod / mask_mod"),
        (config.has_sinks, "sinks"), (config.dropout_rate > 0, "dropout"),
    ]  # fmt: skip
    named = [name for present, name in extras if present]
    if not named:
        return None
    return (
        f"cudnn: `scale` as an array (traced or learned) is served only without masks and extras, not with "
        f"{', '.join(named)}: on an H200 with cuDNN 9.19 its causal graph gave wrong results and its bias + window "
        "graph was refused; pass a Python float, or let automatic dispatch run it on xla_chunked."
    )


def policy_reason(config: AttentionConfig, capability: tuple[int, int], cudnn_version: int) -> str | None:
    """Why cuDNN cannot serve `config` on a GPU of `capability` with cuDNN `cudnn_version`, or None if it can."""
    if config.scale is None:
        reason = runtime_scale_reason(config)
        if reason is not None:
            return reason
    if config.fp8 is not None:
        reason = fp8_reason(config, capability)
        if reason is not None:
            return reason
    if modifier_lib.visibility_as_bias(config):
        # Segments / per-sequence alignment travel in an additive bias: the graph is a plain dense one.
        if modifier_lib.reads_positions(config):
            return (
                "cudnn: a `score_mod`/`mask_mod` that reads `q_idx`/`kv_idx` together with segment ids, or with "
                "padding lengths and `diagonal_alignment='bottom_right'`, is not supported (the positions restart per "
                "sequence, and cuDNN 9.19 and 9.27 cannot compare index tensors against per-sequence offsets)."
            )
        config = modifier_lib.without_visibility(config)
    T, S, H, Hv = config.q_len, config.kv_len, config.head_dim, config.value_head_dim
    padded = config.has_q_lengths or config.has_kv_lengths
    bottom_right = _bottom_right(config)
    sm = f"sm_{capability[0]}{capability[1]}"

    layout_reason = _layout_reason(config, capability, cudnn_version)
    if layout_reason is not None:
        return layout_reason
    dtype = np.dtype(config.output_dtype)
    if dtype not in (np.dtype("float16"), np.dtype("bfloat16")):
        return f"cudnn: dtype {dtype.name} is not supported; cuDNN fused attention runs float16 and bfloat16 only."
    if H % 8 or Hv % 8:
        return f"cudnn: head dims must be multiples of 8; got H={H}, Hv={Hv}."
    if capability < (8, 0):
        return f"cudnn: the GPU is {sm}; cuDNN fused attention needs compute capability 8.0 or newer."
    if cudnn_version < 90000:
        return f"cudnn: cuDNN {version_string(cudnn_version)} is too old; attnlib needs cuDNN 9."
    if capability[0] == 9:
        if H > 256 or Hv > 256:
            return f"cudnn: head dims above 256 are not supported on {sm}; got H={H}, Hv={Hv}."
    elif capability[0] >= 10:
        d256 = H == Hv == 256 and cudnn_version >= 92300
        if not (max(H, Hv) <= 128 or (H, Hv) == (192, 128) or d256):
            return (
                f"cudnn: on {sm} the backward supports head dims up to 128, (192, 128), and (256, 256) from cuDNN "
                f"9.23; got H={H}, Hv={Hv}."
            )
    else:
        if H != Hv:
            return f"cudnn: H != Hv (MLA) needs compute capability 9.0 or newer; the GPU is {sm}."
        if H > 128:
            return f"cudnn: head dims above 128 need compute capability 9.0 or newer; got H={H} on {sm}."
    if config.has_sinks and cudnn_version < 91300:
        return f"cudnn: `sinks` need cuDNN 9.13 or newer; found {version_string(cudnn_version)}."
    if is_ragged(config) or config.layout == "paged":
        # Graph dims are bucketed (ragged) or fixed by the pools (paged): the dense T/S limits below do not apply;
        # `_layout_reason` checked what does.
        return None
    if T == 1 and S == 1:
        return "cudnn: T = S = 1 is not supported by cuDNN's backward."
    if config.has_sinks and T == 1:
        return "cudnn: `sinks` with a single query (T = 1) are not supported by cuDNN."
    with_modifier = modifier_lib.uses_modifier(config)
    if bottom_right and not with_modifier:
        if T > S:
            if padded:
                return (
                    "cudnn: `diagonal_alignment='bottom_right'` with T > S and sequence lengths is not supported "
                    f"(cuDNN needs max query length <= max key length); got T={T}, S={S}."
                )
            right = effective_right(config)
            if right is None or right > 0:
                return (
                    "cudnn: `diagonal_alignment='bottom_right'` with T > S needs the first T - S queries to see no "
                    f"key (causal, or a window with right <= 0); got T={T}, S={S}, window={config.window}."
                )
        if T <= S or padded:
            # The graph keeps the bottom-right mask (T > S without lengths becomes a square top-left problem).
            if config.has_bias or config.has_mask:
                return (
                    "cudnn: `diagonal_alignment='bottom_right'` with a `bias` or a boolean `mask` (fed as a bias) "
                    "is not supported by cuDNN."
                )
            if config.dropout_rate > 0:
                return "cudnn: `diagonal_alignment='bottom_right'` with dropout is not supported by cuDNN."
    elif config.window is not None and T > S and not padded and not with_modifier:
        return f"cudnn: `local_window_size` with T > S (T={T}, S={S}) needs sequence lengths in cuDNN."
    if config.deterministic_backward and capability[0] >= 10:
        if cudnn_version < 91800:
            return f"cudnn: `deterministic_backward` on {sm} needs cuDNN 9.18 or newer."
        if config.has_bias or config.dropout_rate > 0:
            return f"cudnn: `deterministic_backward` with a bias or dropout is not supported on {sm}."
    if with_modifier:
        return _modifier_reason(config)
    return None


FP8_FEATURES = "GQA/MQA, causal (both alignments), windows and padding lengths"
"""What attnlib's cuDNN FP8 graphs serve (the GPU tests' matrix, tests/test_fp8_gpu.py)."""


def fp8_reason(config: AttentionConfig, capability: tuple[int, int]) -> str | None:
    """Why cuDNN's FP8 graphs (`sdpa_fp8` forward, 16-bit backward) cannot serve the `fp8=` call `config`."""
    sm = f"sm_{capability[0]}{capability[1]}"
    if capability < (9, 0):
        return f"cudnn: FP8 attention needs FP8 tensor cores of compute capability 9.0 or newer; the GPU is {sm}."
    H, Hv = config.head_dim, config.value_head_dim
    if H != Hv or H % 16 or H > 128:
        return (
            f"cudnn: FP8 attention needs equal head dims that are multiples of 16 up to 128; got H={H}, Hv={Hv}."
        )
    unsupported = [
        name
        for name, present in (
            ("a `bias`", config.has_bias),
            ("a boolean `mask`", config.has_mask),
            ("`score_mod`/`mask_mod`", config.has_modifiers),
            ("`logits_soft_cap`", config.logits_soft_cap is not None),
            ("`sinks`", config.has_sinks),
            ("segment ids", config.has_segments),
            ("THD (`cu_seqlens`)", config.layout == "thd"),
            ("a paged KV cache", config.layout == "paged"),
        )
        if present
    ]
    if unsupported:
        return (
            f"cudnn: FP8 attention with {', '.join(unsupported)} is not supported; attnlib's cuDNN FP8 graphs serve "
            f"{FP8_FEATURES}."
        )
    padded = config.has_q_lengths or config.has_kv_lengths
    graph_keeps_bottom_right = _bottom_right(config) and (padded or config.q_len < config.kv_len)
    if graph_keeps_bottom_right and capability[0] < 10:
        return (
            f"cudnn: FP8 attention with `diagonal_alignment='bottom_right'` and T < S or sequence lengths needs "
            f"Blackwell (cuDNN 9.19 and 9.27 reject it on {sm}: 'sdpa fp8 forward operation is only supported on "
            "Blackwell')."
        )
    return None


def graph_rows(config: AttentionConfig) -> tuple[int, int]:
    """`(t, offset)` of a dense call's graphs: the query rows after dropping bottom-right rows that see no key, and
    the aligned position of row 0 (`q_idx = row + offset`)."""
    T, S = config.q_len, config.kv_len
    padded = config.has_q_lengths or config.has_kv_lengths
    right = effective_right(config)
    bottom_right = config.diagonal_alignment == "bottom_right"
    skip = T - S if bottom_right and T > S and not padded and right is not None and right <= 0 else 0
    t = T - skip
    return t, (S - t if bottom_right else 0)


def _modifier_reason(config: AttentionConfig) -> str | None:
    """The limits of dense graphs with a score modifier (`modifier.py`)."""
    if config.has_bias:
        return (
            "cudnn: a `bias` together with `score_mod`, `mask_mod` or `logits_soft_cap` is not supported (cuDNN adds "
            "its bias after the score modifier, while attnlib's order is bias first, and with a mask_mod alone the "
            "H200 gave wrong results with cuDNN 9.19)."
        )
    mods = config.modifiers
    if mods is not None:
        for i, shape in enumerate(mods.arg_shapes):
            batch_dims = tuple(shape[:-3])
            if any(d != 1 for d in batch_dims):
                return (
                    f"cudnn: `score_mod_args[{i}]` has batch dims {batch_dims}; cuDNN 9.19 and 9.27 read "
                    "score_mod tensors with a batch dimension wrongly, so only arrays broadcast over the batch "
                    "([N|1, T|1, S|1]) are served."
                )
    t, offset = graph_rows(config)
    return modifier_lib.lowering_reason(config, offset, t, config.kv_len)


def decline_reason(config: AttentionConfig, device: Device | None = None) -> str | None:
    """Why the cuDNN implementation cannot serve `config` on `device` (default: this process's GPU), or None if it
    can. Without a GPU that is the reason, before anything about the native extension; with one, a call that
    `jax.default_device` places on another platform is declined next (`placement.py`)."""
    dev, reason = (device, None) if device is not None else _device()
    if dev is None:
        return f"cudnn: {reason}"
    if device is None and (elsewhere := placement.elsewhere_reason("gpu")) is not None:
        return f"cudnn: {elsewhere}"
    return policy_reason(config, dev.compute_capability, dev.cudnn_version)
