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

from ... import ffi
from ...config import AttentionConfig


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


@functools.cache
def _device() -> tuple[Device | None, str | None]:
    try:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError as e:
        return None, f"JAX has no GPU backend ({e})"
    if not gpus:
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
        return None, f"cannot load cuDNN: {e}"
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


def _bottom_right(config: AttentionConfig) -> bool:
    """Whether the diagonal alignment changes anything for this call."""
    padded = config.has_q_lengths or config.has_kv_lengths
    masked = config.is_causal or config.window is not None
    return config.diagonal_alignment == "bottom_right" and masked and (config.q_len != config.kv_len or padded)


def effective_right(config: AttentionConfig) -> int | None:
    """How far right of its aligned diagonal a query sees (None = unbounded)."""
    right = None if config.window is None else config.window[1]
    if config.is_causal:
        right = 0 if right is None else min(right, 0)
    return right


def policy_reason(config: AttentionConfig, capability: tuple[int, int], cudnn_version: int) -> str | None:
    """Why cuDNN cannot serve `config` on a GPU of `capability` with cuDNN `cudnn_version`, or None if it can."""
    T, S, H, Hv = config.q_len, config.kv_len, config.head_dim, config.value_head_dim
    padded = config.has_q_lengths or config.has_kv_lengths
    bottom_right = _bottom_right(config)
    sm = f"sm_{capability[0]}{capability[1]}"

    if config.layout == "thd":
        return "cudnn: THD layouts (`cu_seqlens_q`/`cu_seqlens_kv`) are not supported yet; only dense `[*B, T, N, H]`."
    if config.layout == "paged":
        return "cudnn: paged key/value caches (`page_table`) are not supported yet; only dense `[*B, S, K, H]`."
    if config.has_segments:
        return "cudnn: packed rows (`q_segment_ids`/`kv_segment_ids`) are not supported yet."
    if config.has_mask:
        return (
            "cudnn: a boolean `mask` is not supported; express padding with `query_seq_lengths`/"
            "`key_value_seq_lengths`, causality with `is_causal`, or pass an additive `bias`."
        )
    if config.logits_soft_cap is not None:
        return (
            "cudnn: `logits_soft_cap` is not supported (cuDNN's score modifier excludes causal, window and padding "
            "masks, and attnlib does not wire it yet)."
        )
    dtype = np.dtype(config.dtype)
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
    if T == 1 and S == 1:
        return "cudnn: T = S = 1 is not supported by cuDNN's backward."
    if config.has_sinks:
        if cudnn_version < 91300:
            return f"cudnn: `sinks` need cuDNN 9.13 or newer; found {version_string(cudnn_version)}."
        if T == 1:
            return "cudnn: `sinks` with a single query (T = 1) are not supported by cuDNN."
    if bottom_right:
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
            if config.has_bias:
                return "cudnn: `diagonal_alignment='bottom_right'` with a `bias` is not supported by cuDNN."
            if config.dropout_rate > 0:
                return "cudnn: `diagonal_alignment='bottom_right'` with dropout is not supported by cuDNN."
    elif config.window is not None and T > S and not padded:
        return f"cudnn: `local_window_size` with T > S (T={T}, S={S}) needs sequence lengths in cuDNN."
    if config.deterministic_backward and capability[0] >= 10:
        if cudnn_version < 91800:
            return f"cudnn: `deterministic_backward` on {sm} needs cuDNN 9.18 or newer."
        if config.has_bias or config.dropout_rate > 0:
            return f"cudnn: `deterministic_backward` with a bias or dropout is not supported on {sm}."
    return None


def decline_reason(config: AttentionConfig) -> str | None:
    """Why the cuDNN implementation cannot serve `config` in this process, or None if it can."""
    if config.layout != "dense":
        return policy_reason(config, (9, 0), 91900)
    reason = ffi.unavailable_reason()
    if reason is not None:
        return f"cudnn: {reason}"
    dev, reason = _device()
    if dev is None:
        return f"cudnn: {reason}"
    return policy_reason(config, dev.compute_capability, dev.cudnn_version)
