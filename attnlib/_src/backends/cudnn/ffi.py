"""Guarded access to attnlib's native extension (`attnlib._attnlib_ffi`).

The extension is optional: a CPU-only install has none, and then the cuDNN implementation declines with the reason
`unavailable_reason()` gives. When it is present, importing this module's `extension()` registers the FFI target
`attnlib_cudnn_graph` and its state type for the CUDA platform (that needs no GPU: registration is lazy in JAX).
"""

import functools
import importlib.metadata
import os
import pathlib
import types

import jax
from jaxlib import xla_client


REBUILD = "ATTNLIB_ENABLE_CUDA=ON python3 -m pip install ."
"""The command, run in attnlib's source directory, that rebuilds and reinstalls attnlib with its extension."""

TARGET = "attnlib_cudnn_graph"
STATE_TYPE = "attnlib_cudnn_graph_state"


def _frontend_version_string(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _traits(command_buffer: bool) -> int:
    """The registration's traits. XLA reads command-buffer compatibility from the registration, not from the traits
    compiled into the handler: without this flag it never captures the call into a CUDA graph."""
    flags = xla_client.CustomCallTargetTraits
    return flags.COMMAND_BUFFER_COMPATIBLE if command_buffer else flags.DEFAULT


def shadowed_extension() -> pathlib.Path | None:
    """The installed attnlib's extension where the `attnlib` imported is another copy without one: a source tree in
    the working directory comes first on `sys.path` (`python -m` adds it) and hides the installed package."""
    import attnlib

    try:
        distribution = importlib.metadata.distribution("attnlib")
    except importlib.metadata.PackageNotFoundError:
        return None
    imported = pathlib.Path(attnlib.__file__).resolve().parent
    for file in distribution.files or ():
        if file.name.startswith("_attnlib_ffi.") and file.suffix in (".so", ".pyd"):
            path = pathlib.Path(distribution.locate_file(file)).resolve()
            if path.exists() and path.parent != imported:
                return path
    return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:3] if part.isdigit())


def older_jaxlib_reason(compiled: str, running: str) -> str | None:
    """Why an extension compiled against the XLA FFI headers of jaxlib `compiled` cannot run in jaxlib `running`
    (an older one may lack the FFI API version those headers declare), or None."""
    if compiled and _release(running) < _release(compiled):
        return (
            f"attnlib's extension was compiled against the XLA FFI headers of jaxlib {compiled}, newer than the "
            f"running jaxlib {running}. Fix: `{REBUILD}` (rebuilds it against this jaxlib)"
        )
    return None


def build_info() -> dict | None:
    """The versions the extension was compiled against (`_attnlib_ffi.build_info()`), or None without one."""
    try:
        from attnlib import _attnlib_ffi  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError:
        return None
    return _attnlib_ffi.build_info()


@functools.cache
def _load() -> tuple[types.ModuleType | None, str | None]:
    try:
        from attnlib import _attnlib_ffi  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError as e:
        if (installed := shadowed_extension()) is not None:
            import attnlib

            return None, (
                f"attnlib was imported from {pathlib.Path(attnlib.__file__).parent}, which hides the installed copy "
                f"whose extension is {installed}: run from another directory, `python -P -m ...` (no working "
                "directory on sys.path), or install with `pip install -e .`"
            )
        return None, (
            "attnlib's native cuDNN extension is not built (pip builds it on Linux when an NVIDIA GPU is visible or "
            f"ATTNLIB_ENABLE_CUDA=ON; `pip install -v` prints why it did not). Fix: `{REBUILD}`. Python said: {e}"
        )
    info = _attnlib_ffi.build_info()
    compiled = _frontend_version_string(info["cudnn_frontend"])
    try:
        installed = importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return None, (
            f"the cuDNN frontend Python package is not installed; attnlib's extension was compiled against "
            f"nvidia-cudnn-frontend {compiled}. Fix: `python3 -m pip install nvidia-cudnn-frontend=={compiled}`"
        )
    if installed != compiled:
        return None, (
            f"nvidia-cudnn-frontend {installed} is installed but attnlib's extension was compiled against "
            f"{compiled}; serialized graphs are only compatible between equal versions. Fix: "
            f"`python3 -m pip install nvidia-cudnn-frontend=={compiled}`"
        )
    if (reason := older_jaxlib_reason(info["jaxlib"], importlib.metadata.version("jaxlib"))) is not None:
        return None, reason
    # Command buffers (CUDA graphs) can be turned off for debugging: XLA then never captures the execute handler.
    command_buffer = os.environ.get("ATTNLIB_CUDNN_COMMAND_BUFFER", "1") != "0"
    # The state type first: XLA refuses handlers whose types are not registered yet.
    jax.ffi.register_ffi_type(STATE_TYPE, _attnlib_ffi.state_type(), platform="CUDA")
    for name, handlers in _attnlib_ffi.registrations(command_buffer).items():
        jax.ffi.register_ffi_target(name, handlers, platform="CUDA", traits=_traits(command_buffer))
    return _attnlib_ffi, None


def extension() -> types.ModuleType:
    """The registered native module.

    Raises:
        NotImplementedError: if it is unavailable (with the reason).
    """
    module, reason = _load()
    if module is None:
        raise NotImplementedError(f"cudnn: {reason}")
    return module


def unavailable_reason() -> str | None:
    """None when the native cuDNN extension is importable and registered, else why not."""
    return _load()[1]
