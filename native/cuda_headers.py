"""Where the native extension's headers are: the build environment, the environment being installed into, a CUDA
toolkit, or (failing those) which wheels to add to the build requirements.

The cudnn-frontend headers are those of the pinned `nvidia-cudnn-frontend` wheel, kept in
`native/third_party/cudnn_frontend` (a build requirement on that wheel would pull its run-time dependencies, about
200 MB of CUTLASS DSL libraries, into every build). The other header sets come from the first place that has them:
a package directory (in the site-packages of the build, then of the target environment), a toolkit directory, or else
the wheel requested:

- XLA FFI: packages `jaxlib/include`; toolkit —; wheel `jaxlib`.
- `cudnn.h`: packages `nvidia/cudnn`, `nvidia/cudnn_jit`; toolkit `include`; wheel `nvidia-cudnn-jit-cu13` /
  `nvidia-cudnn-cu12`.
- `cuda.h`, `cuda_runtime_api.h`: packages `nvidia/cu13`, `nvidia/cuda_runtime`; toolkit `include`; wheel
  `nvidia-cuda-runtime` / `-cu12`.
- `crt/host_defines.h` (read by `cuda_runtime_api.h`): packages `nvidia/cu13`, `nvidia/cuda_runtime`,
  `nvidia/cuda_nvcc`; toolkit `include`; wheel `nvidia-cuda-crt` / `nvidia-cuda-nvcc-cu12`.
- `nv/target` (read by `cuda_fp16.h`): packages `nvidia/cu13`, `nvidia/cuda_cccl`; toolkit `include`, `include/cccl`;
  wheel `nvidia-cuda-cccl` / `-cu12`.
- `nvrtc.h` (read by the frontend): packages `nvidia/cu13`, `nvidia/cuda_nvrtc`; toolkit `include`; wheel
  `nvidia-cuda-nvrtc` / `-cu12`.

The target environment is the one pip installs into: a GPU user's `jax[cuda13]` already holds them, so nothing is
fetched. pip's default isolated build runs the backend with the target's
interpreter and hides its site-packages with `PYTHONPATH` / `PYTHONNOUSERSITE`; the same interpreter without those
variables shows them. A front end that builds in a virtualenv of its own (`python -m build`) runs another interpreter;
there `$VIRTUAL_ENV`, an activated environment, is the target. Under pip's overlay `$VIRTUAL_ENV` is ignored: it may
name an environment other than the one pip installs into (`other-venv/bin/python -m pip install .` with a venv
active). The toolkit is `$CUDA_HOME` (or `$CUDA_PATH`) when set, else `/usr/local/cuda`.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys


FRONTEND_VERSION = "1.32.0"
"""The cudnn-frontend the extension compiles against; the runtime's Python package must be the same version."""

FRONTEND_INCLUDE = pathlib.Path(__file__).resolve().parent / "third_party" / "cudnn_frontend" / "include"

_SITE_SCAN = (
    "import json, sys, importlib.metadata as m\n"
    "versions = {}\n"
    "for name in ('jaxlib', 'jax-cuda12-plugin', 'jax-cuda13-plugin', 'nvidia-cuda-runtime'):\n"
    "    try:\n"
    "        versions[name] = m.version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps({'path': [p for p in sys.path if p], 'versions': versions}))\n"
)


@dataclasses.dataclass(frozen=True)
class Environment:
    """A Python environment's import path and the versions of the packages that matter here."""

    path: tuple[str, ...]
    versions: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Found:
    """One header set's include directory (empty when missing) and where it came from."""

    include_dir: str
    origin: str


def _scan(python: str, env: dict[str, str]) -> Environment | None:
    try:
        out = subprocess.run(
            [python, "-c", _SITE_SCAN], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    data = json.loads(out)
    return Environment(tuple(data["path"]), data["versions"])


def environments() -> list[tuple[str, Environment]]:
    """The build environment (this process) and the target environments seen from it, build first."""
    here = _scan(sys.executable, dict(os.environ))
    found = [("build environment", here)] if here else []
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    candidates = [sys.executable]
    pip_overlay = "PYTHONPATH" in os.environ and "PYTHONNOUSERSITE" in os.environ
    if (venv := os.environ.get("VIRTUAL_ENV")) and not pip_overlay:
        candidates.append(os.path.join(venv, "bin", "python"))
    for python in candidates:
        if not os.path.exists(python):
            continue
        target = _scan(python, clean)
        if target and all(target.path != env.path for _, env in found):
            found.append((f"target environment ({python})", target))
    return found


def cuda_major(envs: list[tuple[str, Environment]]) -> int:
    """12 when the target runs JAX's CUDA 12 plugin, else 13."""
    versions = {k: v for _, env in envs for k, v in env.versions.items()}
    return 12 if "jax-cuda12-plugin" in versions and "jax-cuda13-plugin" not in versions else 13


def toolkit_include() -> pathlib.Path | None:
    root = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    include = pathlib.Path(root) / "include"
    return include if include.is_dir() else None


def _first(envs, relative_dirs: tuple[str, ...], files: tuple[str, ...], toolkit: tuple[str, ...] = (".",)) -> Found:
    for origin, env in envs:
        for site in env.path:
            for rel in relative_dirs:
                d = pathlib.Path(site) / rel
                if all((d / f).is_file() for f in files):
                    return Found(str(d), origin)
    if include := toolkit_include():
        for rel in toolkit:
            if all((include / rel / f).is_file() for f in files):
                return Found(str((include / rel).resolve()), "CUDA toolkit")
    return Found("", "")


def locate(envs: list[tuple[str, Environment]]) -> dict[str, Found]:
    """Each header set's directory, by the CMake variable that takes it."""
    return {
        "ATTNLIB_XLA_INCLUDE_DIR": _first(envs, ("jaxlib/include",), ("xla/ffi/api/ffi.h",), toolkit=()),
        "ATTNLIB_CUDNN_FRONTEND_INCLUDE_DIR": Found(str(FRONTEND_INCLUDE), "native/third_party/cudnn_frontend"),
        "ATTNLIB_CUDNN_INCLUDE_DIR": _first(
            envs, ("nvidia/cudnn/include", "nvidia/cudnn_jit/include"), ("cudnn.h", "cudnn_version.h")
        ),
        "ATTNLIB_CUDA_INCLUDE_DIR": _first(
            envs, ("nvidia/cu13/include", "nvidia/cuda_runtime/include"), ("cuda.h", "cuda_runtime_api.h")
        ),
        "ATTNLIB_CUDA_CRT_INCLUDE_DIR": _first(
            envs,
            ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvcc/include"),
            ("crt/host_defines.h",),
        ),
        "ATTNLIB_CUDA_CCCL_INCLUDE_DIR": _first(
            envs, ("nvidia/cu13/include", "nvidia/cuda_cccl/include"), ("nv/target",), (".", "cccl")
        ),
        "ATTNLIB_NVRTC_INCLUDE_DIR": _first(envs, ("nvidia/cu13/include", "nvidia/cuda_nvrtc/include"), ("nvrtc.h",)),
    }


DESCRIPTIONS = {
    "ATTNLIB_XLA_INCLUDE_DIR": "the XLA FFI headers (jaxlib)",
    "ATTNLIB_CUDNN_FRONTEND_INCLUDE_DIR": "the cudnn-frontend headers",
    "ATTNLIB_CUDNN_INCLUDE_DIR": "cudnn.h",
    "ATTNLIB_CUDA_INCLUDE_DIR": "cuda.h",
    "ATTNLIB_CUDA_CRT_INCLUDE_DIR": "crt/host_defines.h",
    "ATTNLIB_CUDA_CCCL_INCLUDE_DIR": "nv/target",
    "ATTNLIB_NVRTC_INCLUDE_DIR": "nvrtc.h",
}
"""What each header set is, for messages."""


def requirements_for_missing(found: dict[str, Found], major: int, runtime: str = "") -> list[str]:
    """The wheels that supply the missing header sets; `crt` of the same CUDA release as the environment's
    `nvidia-cuda-runtime` (version `runtime`), whose `cuda_runtime_api.h` reads it."""
    release = f"=={'.'.join(runtime.split('.')[:2])}.*" if runtime else ">=13"
    wheels = {
        "ATTNLIB_XLA_INCLUDE_DIR": "jaxlib",
        "ATTNLIB_CUDNN_INCLUDE_DIR": "nvidia-cudnn-jit-cu13" if major == 13 else "nvidia-cudnn-cu12",
        "ATTNLIB_CUDA_INCLUDE_DIR": "nvidia-cuda-runtime>=13" if major == 13 else "nvidia-cuda-runtime-cu12",
        "ATTNLIB_CUDA_CRT_INCLUDE_DIR": f"nvidia-cuda-crt{release}" if major == 13 else "nvidia-cuda-nvcc-cu12",
        "ATTNLIB_CUDA_CCCL_INCLUDE_DIR": "nvidia-cuda-cccl>=13" if major == 13 else "nvidia-cuda-cccl-cu12",
        "ATTNLIB_NVRTC_INCLUDE_DIR": "nvidia-cuda-nvrtc>=13" if major == 13 else "nvidia-cuda-nvrtc-cu12",
    }
    return [wheels[name] for name, f in found.items() if not f.include_dir]


def version_from(envs: list[tuple[str, Environment]], found: Found, package: str) -> str:
    """The version of `package` in the environment `found` came from ("" if none)."""
    for origin, env in envs:
        if origin == found.origin:
            return env.versions.get(package, "")
    return ""
