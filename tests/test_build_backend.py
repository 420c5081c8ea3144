"""The build backend (`native/attnlib_build.py`): when it builds the native extension, where it finds the headers,
which wheels it asks for, the frontend requirement it adds to the wheel; and the self-check's verdict on a machine
with a GPU whose cuDNN path cannot run.

The isolated builds themselves (a clean venv, `ATTNLIB_ENABLE_CUDA=ON` from wheels alone, and the plain install)
run in `.ci/run`: they download about a gigabyte.
"""

import base64
import hashlib
import pathlib
import sys
import zipfile

import pytest


NATIVE = pathlib.Path(__file__).resolve().parent.parent / "native"
pytest.importorskip("scikit_build_core", reason="the build backend needs scikit-build-core")
sys.path.insert(0, str(NATIVE))
import attnlib_build  # noqa: E402
import cuda_headers  # noqa: E402
import cxx_compiler  # noqa: E402


METADATA = (
    "Metadata-Version: 2.2\nName: attnlib\nVersion: 0.1.0\n"
    "Requires-Dist: jax>=0.10\nRequires-Dist: beartype\n\n# attnlib\n"
)


def test_the_frontend_requirement_joins_the_others():
    text = attnlib_build.with_requirement(METADATA, "nvidia-cudnn-frontend==1.32.0")
    head, body = text.split("\n\n", 1)
    assert head.splitlines()[-1] == "Requires-Dist: nvidia-cudnn-frontend==1.32.0"
    assert head.splitlines()[-2] == "Requires-Dist: beartype"
    assert body == "# attnlib\n"


def test_the_wheel_gets_the_requirement_and_a_matching_record(tmp_path):
    wheel = tmp_path / "attnlib-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("attnlib/__init__.py", "")
        z.writestr("attnlib-0.1.0.dist-info/METADATA", METADATA)
        z.writestr("attnlib-0.1.0.dist-info/RECORD", "attnlib/__init__.py,,0\nattnlib-0.1.0.dist-info/METADATA,x,1\n")
    attnlib_build.add_requirement_to_wheel(wheel, "nvidia-cudnn-frontend==1.32.0")
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read("attnlib-0.1.0.dist-info/METADATA")
        record = z.read("attnlib-0.1.0.dist-info/RECORD").decode().splitlines()
        assert z.read("attnlib/__init__.py") == b""
    assert b"Requires-Dist: nvidia-cudnn-frontend==1.32.0\n" in metadata
    digest = base64.urlsafe_b64encode(hashlib.sha256(metadata).digest()).rstrip(b"=").decode()
    assert f"attnlib-0.1.0.dist-info/METADATA,sha256={digest},{len(metadata)}" in record


@pytest.mark.parametrize(
    "env, gpu, expected",
    [("ON", False, "ON"), ("off", True, "OFF"), (None, False, "AUTO"), (None, True, "ON"), ("AUTO", True, "ON")],
)
def test_the_mode_builds_on_request_or_where_a_gpu_is_visible(monkeypatch, env, gpu, expected):
    monkeypatch.setattr(attnlib_build, "gpu_visible", lambda: gpu)
    monkeypatch.setattr(attnlib_build.sys, "platform", "linux")
    if env is None:
        monkeypatch.delenv("ATTNLIB_ENABLE_CUDA", raising=False)
    else:
        monkeypatch.setenv("ATTNLIB_ENABLE_CUDA", env)
    assert attnlib_build._mode(None) == expected


def test_a_config_setting_overrides_the_environment_and_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("ATTNLIB_ENABLE_CUDA", "ON")
    assert attnlib_build._mode({"cmake.define.ATTNLIB_ENABLE_CUDA": "OFF"}) == "OFF"
    monkeypatch.setenv("ATTNLIB_ENABLE_CUDA", "maybe")
    with pytest.raises(ValueError, match="ATTNLIB_ENABLE_CUDA must be one of AUTO, ON, OFF. Got 'MAYBE'"):
        attnlib_build._mode(None)


def _site_with(tmp_path, files):
    site = tmp_path / "site-packages"
    for f in files:
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).write_text("")
    return cuda_headers.Environment((str(site),), {"jaxlib": "0.10.2"})


CU13_WHEELS = [
    "jaxlib/include/xla/ffi/api/ffi.h",
    "nvidia/cudnn/include/cudnn.h",
    "nvidia/cudnn/include/cudnn_version.h",
    "nvidia/cu13/include/cuda.h",
    "nvidia/cu13/include/cuda_runtime_api.h",
    "nvidia/cu13/include/crt/host_defines.h",
    "nvidia/cu13/include/nv/target",
    "nvidia/cu13/include/nvrtc.h",
]


def test_a_jax_cuda13_environment_supplies_every_header(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    env = _site_with(tmp_path, CU13_WHEELS)
    found = cuda_headers.locate([("target environment", env)])
    assert all(f.include_dir for f in found.values()), found
    assert found["ATTNLIB_CUDNN_FRONTEND_INCLUDE_DIR"].include_dir.endswith("third_party/cudnn_frontend/include")
    assert (pathlib.Path(found["ATTNLIB_CUDNN_FRONTEND_INCLUDE_DIR"].include_dir) / "cudnn_frontend.h").is_file()
    assert found["ATTNLIB_CUDA_INCLUDE_DIR"].origin == "target environment"
    assert cuda_headers.requirements_for_missing(found, 13) == []
    assert (
        cuda_headers.version_from([("target environment", env)], found["ATTNLIB_XLA_INCLUDE_DIR"], "jaxlib") == "0.10.2"
    )


def test_crt_matches_the_environments_cuda_runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    env = _site_with(tmp_path, [f for f in CU13_WHEELS if "crt" not in f and "nv/target" not in f])
    found = cuda_headers.locate([("target environment", env)])
    assert cuda_headers.requirements_for_missing(found, 13, "13.0.96") == [
        "nvidia-cuda-crt==13.0.*", "nvidia-cuda-cccl>=13"]


@pytest.mark.parametrize(
    "major, expected",
    [
        (13, ["jaxlib", "nvidia-cudnn-jit-cu13", "nvidia-cuda-runtime>=13", "nvidia-cuda-crt>=13",
              "nvidia-cuda-cccl>=13", "nvidia-cuda-nvrtc>=13"]),
        (12, ["jaxlib", "nvidia-cudnn-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvcc-cu12",
              "nvidia-cuda-cccl-cu12", "nvidia-cuda-nvrtc-cu12"]),
    ],
)  # fmt: skip
def test_an_empty_environment_asks_for_every_header_wheel(tmp_path, monkeypatch, major, expected):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    found = cuda_headers.locate([("build environment", _site_with(tmp_path, []))])
    assert cuda_headers.requirements_for_missing(found, major) == expected


def test_a_toolkit_supplies_the_cuda_headers_but_not_xla_or_cudnn(tmp_path, monkeypatch):
    toolkit = tmp_path / "cuda"
    for f in ("cuda.h", "cuda_runtime_api.h", "crt/host_defines.h", "cccl/nv/target", "nvrtc.h"):
        (toolkit / "include" / f).parent.mkdir(parents=True, exist_ok=True)
        (toolkit / "include" / f).write_text("")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    found = cuda_headers.locate([("build environment", _site_with(tmp_path, []))])
    assert found["ATTNLIB_CUDA_CCCL_INCLUDE_DIR"].include_dir == str((toolkit / "include" / "cccl").resolve())
    assert found["ATTNLIB_NVRTC_INCLUDE_DIR"].origin == "CUDA toolkit"
    assert cuda_headers.requirements_for_missing(found, 13) == ["jaxlib", "nvidia-cudnn-jit-cu13"]


def test_jax_cuda12_plugin_selects_cuda12_wheels():
    env12 = cuda_headers.Environment((), {"jax-cuda12-plugin": "0.10.2"})
    assert cuda_headers.cuda_major([("target", env12)]) == 12
    assert cuda_headers.cuda_major([("target", cuda_headers.Environment((), {}))]) == 13


def test_the_target_environment_is_seen_from_an_isolated_build(tmp_path, monkeypatch):
    """pip's isolated build hides the target's site-packages with PYTHONPATH / PYTHONNOUSERSITE; the scan without them
    sees this interpreter's own."""
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    envs = cuda_headers.environments()
    assert envs[0][0] == "build environment"
    assert any(p.endswith("site-packages") for _, env in envs for p in env.path)


@pytest.mark.parametrize("pip_overlay", [True, False])
def test_an_activated_venv_is_a_target_only_outside_pips_overlay(tmp_path, monkeypatch, pip_overlay):
    """`/tmp/other/bin/python -m pip install .` with a venv active installs into /tmp/other, not into $VIRTUAL_ENV;
    a front end with a build venv of its own (`python -m build`) installs into $VIRTUAL_ENV."""
    active = tmp_path / "active"
    (active / "bin").mkdir(parents=True)
    (active / "bin" / "python").write_text("")
    scanned = []
    monkeypatch.setattr(cuda_headers, "_scan", lambda python, env: scanned.append(python) or
                        cuda_headers.Environment((python,), {}))
    monkeypatch.setenv("VIRTUAL_ENV", str(active))
    for name in ("PYTHONPATH", "PYTHONNOUSERSITE"):
        if pip_overlay:
            monkeypatch.setenv(name, "1")
        else:
            monkeypatch.delenv(name, raising=False)
    cuda_headers.environments()
    assert (str(active / "bin" / "python") in scanned) is not pip_overlay


def test_without_a_gpu_or_headers_the_wheel_is_pure(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(attnlib_build, "gpu_visible", lambda: False)
    monkeypatch.setattr(attnlib_build.sys, "platform", "linux")
    monkeypatch.delenv("ATTNLIB_ENABLE_CUDA", raising=False)
    monkeypatch.setattr(cuda_headers, "environments", lambda: [("build environment", _site_with(tmp_path, []))])
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    settings = attnlib_build._with_native_settings(None)
    assert settings["wheel.cmake"] == "false"
    assert "not building the native cuDNN extension: no NVIDIA GPU is visible" in capsys.readouterr().err
    assert attnlib_build._header_requirements(None) == []


def test_on_passes_every_header_directory_to_cmake(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLIB_ENABLE_CUDA", "ON")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    env = _site_with(tmp_path, CU13_WHEELS)
    monkeypatch.setattr(cuda_headers, "environments", lambda: [("target environment", env)])
    monkeypatch.setattr(cxx_compiler, "choose", lambda user: (None, "C++ compiler: CMake's default"))
    settings = attnlib_build._with_native_settings({})
    assert "wheel.cmake" not in settings
    assert settings["cmake.define.ATTNLIB_ENABLE_CUDA"] == "ON"
    assert settings["cmake.define.ATTNLIB_JAXLIB_VERSION"] == "0.10.2"
    for name in cuda_headers.DESCRIPTIONS:
        assert settings[f"cmake.define.{name}"], name


def test_a_compiler_named_by_the_build_is_kept(monkeypatch):
    monkeypatch.setattr(cxx_compiler, "links_shared_libstdcxx", lambda c: False)
    assert cxx_compiler.choose("/opt/my/g++") == (None, "C++ compiler named by the build: /opt/my/g++")


def test_a_shared_libstdcxx_cxx_is_kept(monkeypatch):
    monkeypatch.setenv("CXX", "/opt/my/g++")
    monkeypatch.setattr(cxx_compiler, "links_shared_libstdcxx", lambda c: True)
    assert cxx_compiler.choose(None) == (None, "C++ compiler: /opt/my/g++")


@pytest.mark.parametrize("cxx", [None, "/opt/gcc/bin/g++"])
def test_a_static_libstdcxx_compiler_is_replaced_even_when_cxx_names_it(monkeypatch, cxx):
    """The H200 image exports CXX=/opt/gcc/bin/g++, which links libstdc++ statically."""
    if cxx is None:
        monkeypatch.delenv("CXX", raising=False)
    else:
        monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(cxx_compiler, "links_shared_libstdcxx", lambda c: c == "/usr/bin/g++")
    monkeypatch.setattr(cxx_compiler.shutil, "which", lambda c: c if c.startswith("/") else f"/opt/gcc/bin/{c}")
    compiler, why = cxx_compiler.choose(None)
    assert compiler == "/usr/bin/g++" and "links libstdc++ statically" in why


def test_the_probe_tells_shared_from_static_libstdcxx():
    if cxx_compiler.shutil.which("g++") is None:
        pytest.skip("no g++ here")
    assert cxx_compiler.links_shared_libstdcxx("g++") is True
    assert cxx_compiler.links_shared_libstdcxx("no-such-compiler") is None
