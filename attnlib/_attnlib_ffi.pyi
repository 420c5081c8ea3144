"""attnlib's native XLA FFI extension: executes serialized cuDNN graphs."""

from collections.abc import Sequence
from typing import Any

def registrations(command_buffer: bool = True) -> dict[str, dict[str, Any]]:
    """FFI handler bundles by target name; `command_buffer` marks execute capturable into CUDA graphs."""

def cpu_test_handler(callback: Any) -> dict[str, Any]:
    """TESTS ONLY: the CPU handler bundle of `attnlib_cudnn_graph`, which runs each call through
    `callback(label, args, rets)` (a CPU model of the graph); attnlib never registers it itself."""

def state_type() -> dict[str, Any]:
    """The FFI state type of `attnlib_cudnn_graph`, for `jax.ffi.register_ffi_type`."""

def graph_replay_counts() -> dict[str, int]:
    """Process-wide counts of graph executions: captured into a CUDA graph, replayed from one, run directly, failed
    captures, run while XLA captured them into its command buffer, and captures whose launches attnlib issued again
    itself."""

def frontend_version() -> int:
    """CUDNN_FRONTEND_VERSION of the headers this module was compiled against (13200 for 1.32.0)."""

def build_info() -> dict[str, Any]:
    """Versions of the headers this module was compiled against: cudnn_frontend, cudnn and cuda as integers (13200,
    91900, 13000), xla_ffi_api as (major, minor), jaxlib as a string."""

def graph_json_version() -> str:
    """The serialized-graph JSON version this module reads."""

def canonicalize_graph(blob: bytes) -> bytes:
    """The blob with its process-dependent graph id zeroed, so equal graphs give equal bytes."""

def graph_versions(blob: bytes) -> tuple[str, int, str]:
    """(json_version, cudnn_frontend_version, cudnn_backend_version) recorded in a blob."""

def load_cudnn(hint: str = "") -> int:
    """Binds the extension to libcudnn (the copy already loaded, else `hint`, else the soname); returns its version."""

def time_graph(
    blob: bytes, tensors: Sequence[tuple[int, int, bytes]], ws_bytes: int, repeats: int = 3, batch: int = 5
) -> float:
    """Best milliseconds of one execution of a serialized graph on fresh buffers of the current device. `tensors`
    lists (uid, bytes, contents) for every graph tensor; empty contents means zeros."""
