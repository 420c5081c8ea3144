"""Choosing a C++ compiler that links libstdc++ as a shared library.

The extension shares the process with JAX's own C++ libraries; built by a compiler that links libstdc++ statically
(the default `g++` of some CUDA images, e.g. `/opt/gcc/bin/g++`, which the H200 image also exports as `CXX`) its
iostreams crash there (measured: a segfault while the cuDNN frontend deserializes a plan). Unless the build names a
compiler (`-C cmake.define.CMAKE_CXX_COMPILER=...`), the one CMake would take (`$CXX`, else `c++`) is probed and, if
it links libstdc++ statically, the first system compiler that links it shared is used instead.
"""

import os
import pathlib
import shutil
import subprocess
import tempfile


_PROBE = "#include <sstream>\nint main() { std::ostringstream s; s << 42L; return s.str().size() != 2; }\n"
_CANDIDATES = ("c++", "g++", "/usr/bin/c++", "/usr/bin/g++", *(f"/usr/bin/g++-{v}" for v in range(16, 8, -1)),
               "clang++", "/usr/bin/clang++")  # fmt: skip


def links_shared_libstdcxx(compiler: str) -> bool | None:
    """Whether a program `compiler` links needs `libstdc++.so` at run time; None if it cannot compile one."""
    path = shutil.which(compiler)
    if path is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = pathlib.Path(tmp, "probe.cc"), pathlib.Path(tmp, "probe")
        source.write_text(_PROBE)
        try:
            subprocess.run([path, str(source), "-o", str(binary)], capture_output=True, timeout=120, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        data = binary.read_bytes()
    # The dynamic section names each needed library; a static libstdc++ leaves no such name in the binary.
    return b"libstdc++.so" in data or b"libc++.so" in data


def choose(user_choice: str | None) -> tuple[str | None, str]:
    """The compiler to pass to CMake (None: CMake's default) and a line saying why."""
    if user_choice:
        return None, f"C++ compiler named by the build: {user_choice}"
    default = os.environ.get("CXX") or "c++"
    if links_shared_libstdcxx(default) is not False:
        return None, f"C++ compiler: {default}"
    for candidate in _CANDIDATES:
        if links_shared_libstdcxx(candidate):
            path = shutil.which(candidate)
            return path, f"C++ compiler: {path} ({default} links libstdc++ statically, which crashes inside JAX)"
    return None, f"C++ compiler: {default} and every other one found link libstdc++ statically; CMake will refuse it"
