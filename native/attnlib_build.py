"""attnlib's PEP 517 build backend: scikit-build-core, told where the native extension's headers are and given the
wheels that supply the missing ones.

`ATTNLIB_ENABLE_CUDA` (environment variable, or `-C cmake.define.ATTNLIB_ENABLE_CUDA=...`) decides:
- `ON`: build the extension; header sets found nowhere are added to the build requirements as wheels
  (`cuda_headers.py` says which), so an isolated `pip install .` compiles it from wheels alone.
- `AUTO` (default): on Linux with an NVIDIA GPU visible (`/proc/driver/nvidia/version` or `/dev/nvidia0`) as `ON`;
  elsewhere the extension is built only if every header is already at hand, else the pure-JAX package is installed
  with one line saying why (a CPU-only machine downloads no GPU wheels).
- `OFF`: never build.

Where the extension is built (`ON`, or `AUTO` with a GPU), the wheel also requires the pinned
`nvidia-cudnn-frontend`, whose Python API builds the graphs the extension runs.
"""

import base64
import hashlib
import os
import pathlib
import sys
import zipfile

import cuda_headers
import cxx_compiler
from scikit_build_core import build as _scikit


_DEFINE = "cmake.define."
_MODES = ("AUTO", "ON", "OFF")


def gpu_visible() -> bool:
    """Whether this Linux machine has an NVIDIA driver and device."""
    return pathlib.Path("/proc/driver/nvidia/version").exists() or pathlib.Path("/dev/nvidia0").exists()


def _say(line: str) -> None:
    print(f"attnlib build: {line}", file=sys.stderr, flush=True)


def _mode(config_settings: dict | None) -> str:
    value = (config_settings or {}).get(_DEFINE + "ATTNLIB_ENABLE_CUDA") or os.environ.get("ATTNLIB_ENABLE_CUDA")
    value = str(value or "AUTO").upper()
    if value not in _MODES:
        raise ValueError(f"ATTNLIB_ENABLE_CUDA must be one of {', '.join(_MODES)}. Got {value!r}.")
    if value == "AUTO" and sys.platform.startswith("linux") and gpu_visible():
        _say("an NVIDIA GPU is visible: building the native cuDNN extension (ATTNLIB_ENABLE_CUDA=OFF skips it)")
        return "ON"
    return value


def _header_requirements(config_settings: dict | None) -> list[str]:
    if _mode(config_settings) != "ON":
        return []
    envs = cuda_headers.environments()
    found = cuda_headers.locate(envs)
    runtime = cuda_headers.version_from(envs, found["ATTNLIB_CUDA_INCLUDE_DIR"], "nvidia-cuda-runtime")
    wanted = cuda_headers.requirements_for_missing(found, cuda_headers.cuda_major(envs), runtime)
    if wanted:
        _say(f"fetching the extension's headers as build requirements: {', '.join(wanted)}")
    return wanted


def _pure(settings: dict, why: str) -> dict:
    """`settings` for a wheel without the extension: CMake is not run (no compiler needed), the wheel is pure."""
    _say(f"not building the native cuDNN extension: {why}; installing the pure-JAX package")
    return {**settings, "wheel.cmake": "false"}


def _with_native_settings(config_settings: dict | None) -> dict:
    settings = dict(config_settings or {})
    mode = _mode(settings)
    settings[_DEFINE + "ATTNLIB_ENABLE_CUDA"] = mode
    if mode == "OFF":
        return _pure(settings, "ATTNLIB_ENABLE_CUDA=OFF")
    if not sys.platform.startswith("linux"):
        return _pure(settings, f"it needs Linux; this is {sys.platform}")
    envs = cuda_headers.environments()
    found = cuda_headers.locate(envs)
    missing = [name for name, where in found.items() if not where.include_dir and not settings.get(_DEFINE + name)]
    if mode == "AUTO" and missing:
        names = ", ".join(cuda_headers.DESCRIPTIONS[name] for name in missing)
        return _pure(settings, f"no NVIDIA GPU is visible and {names} were not found "
                               "(ATTNLIB_ENABLE_CUDA=ON fetches them as wheels)")  # fmt: skip
    for name, where in found.items():
        if where.include_dir and not settings.get(_DEFINE + name):
            settings[_DEFINE + name] = where.include_dir
            _say(f"{name} = {where.include_dir} ({where.origin})")
    jaxlib = cuda_headers.version_from(envs, found["ATTNLIB_XLA_INCLUDE_DIR"], "jaxlib")
    settings.setdefault(_DEFINE + "ATTNLIB_JAXLIB_VERSION", jaxlib)
    compiler, why = cxx_compiler.choose(settings.get(_DEFINE + "CMAKE_CXX_COMPILER"))
    if compiler:
        settings[_DEFINE + "CMAKE_CXX_COMPILER"] = compiler
    _say(why)
    return settings


def frontend_requirement() -> str:
    return f"nvidia-cudnn-frontend=={cuda_headers.FRONTEND_VERSION}"


def with_requirement(metadata: str, requirement: str) -> str:
    """`metadata` (a METADATA file's text) with one more `Requires-Dist` header, placed with the others."""
    head, sep, body = metadata.partition("\n\n")
    lines = head.split("\n")
    last = max((i for i, line in enumerate(lines) if line.startswith("Requires-Dist:")), default=len(lines) - 1)
    lines.insert(last + 1, f"Requires-Dist: {requirement}")
    return "\n".join(lines) + sep + body


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def add_requirement_to_wheel(wheel: pathlib.Path, requirement: str) -> None:
    """Rewrites `wheel` with `requirement` in its METADATA (and RECORD's hash of it)."""
    with zipfile.ZipFile(wheel) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist()]
    metadata_name = next(info.filename for info, _ in entries if info.filename.endswith(".dist-info/METADATA"))
    record_name = metadata_name.removesuffix("METADATA") + "RECORD"
    metadata = with_requirement(dict((i.filename, d) for i, d in entries)[metadata_name].decode(), requirement)
    metadata_bytes = metadata.encode()
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, data in entries:
            if info.filename == metadata_name:
                data = metadata_bytes
            elif info.filename == record_name:
                lines = [
                    _record_line(metadata_name, metadata_bytes) if line.startswith(metadata_name + ",") else line
                    for line in data.decode().splitlines()
                ]
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(info, data)
    tmp.replace(wheel)


def get_requires_for_build_wheel(config_settings=None):
    return _scikit.get_requires_for_build_wheel(config_settings) + _header_requirements(config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _scikit.get_requires_for_build_editable(config_settings) + _header_requirements(config_settings)


def _prepare(hook, metadata_directory, config_settings):
    name = hook(metadata_directory, config_settings)
    if _mode(config_settings) == "ON":
        path = pathlib.Path(metadata_directory, name, "METADATA")
        path.write_text(with_requirement(path.read_text(), frontend_requirement()))
    return name


def _build(hook, wheel_directory, config_settings):
    # scikit-build-core checks a wheel's metadata against a prepared directory; the frontend requirement is added
    # to both afterwards, so it is given none.
    settings = _with_native_settings(config_settings)
    name = hook(wheel_directory, settings, None)
    if settings[_DEFINE + "ATTNLIB_ENABLE_CUDA"] == "ON":
        add_requirement_to_wheel(pathlib.Path(wheel_directory, name), frontend_requirement())
    return name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _prepare(_scikit.prepare_metadata_for_build_wheel, metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _prepare(_scikit.prepare_metadata_for_build_editable, metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(_scikit.build_wheel, wheel_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(_scikit.build_editable, wheel_directory, config_settings)


get_requires_for_build_sdist = _scikit.get_requires_for_build_sdist
build_sdist = _scikit.build_sdist
