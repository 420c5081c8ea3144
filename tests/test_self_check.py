"""`python -m attnlib`: passes on plain JAX without a GPU, fails with the reason and its fix when a GPU is there but
the cuDNN path cannot run."""

import pytest
from helpers import simulate_a_machine_without_a_gpu

import attnlib.__main__ as self_check
from attnlib._src.backends.cudnn import ffi, support


ARGS = ["--length", "16", "--batch", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]


def test_without_a_gpu_it_passes_and_asks_for_nothing(monkeypatch, capsys):
    simulate_a_machine_without_a_gpu(monkeypatch, nvidia_driver=False)
    assert self_check.main(ARGS) == 0
    out = capsys.readouterr().out
    assert "self-check passed" in out
    assert "cudnn        unavailable: no CUDA GPU visible to JAX" in out
    assert "Fix" not in out and "reinstall" not in out and "pip install" not in out


def test_a_gpu_without_jax_cuda_fails_with_the_install_command(monkeypatch, capsys):
    simulate_a_machine_without_a_gpu(monkeypatch, nvidia_driver=True)
    assert self_check.main(ARGS) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("self-check FAILED: this machine has an NVIDIA GPU but attnlib's cuDNN path cannot run:")
    assert 'Fix: `python3 -m pip install -U "jax[cuda13]"`' in last


@pytest.mark.parametrize(
    "reason",
    [
        "attnlib's native cuDNN extension is not built (…). Fix: `" + ffi.REBUILD + "`. Python said: …",
        "nvidia-cudnn-frontend 1.31.0 is installed but … Fix: `python3 -m pip install nvidia-cudnn-frontend==1.32.0`",
    ],
)
def test_a_gpu_whose_cudnn_path_cannot_run_fails_with_the_fix(monkeypatch, capsys, reason):
    def no_device():
        raise NotImplementedError(f"cudnn: {reason}")

    monkeypatch.setattr(support, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(support, "device", no_device)
    assert self_check.main(ARGS) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith(reason)
    assert "self-check passed" not in out


def test_an_extension_newer_than_the_running_jaxlib_is_refused():
    reason = ffi.older_jaxlib_reason("0.11.2", "0.10.2")
    assert "jaxlib 0.11.2, newer than the running jaxlib 0.10.2" in reason and ffi.REBUILD in reason
    assert ffi.older_jaxlib_reason("0.10.2", "0.11.2") is None
    assert ffi.older_jaxlib_reason("", "0.10.2") is None


def test_the_extension_line_names_the_build_versions(monkeypatch):
    info = {"cudnn_frontend": 13200, "cudnn": 91900, "cuda": 13000, "xla_ffi_api": (0, 3), "jaxlib": "0.10.2"}
    monkeypatch.setattr(ffi, "build_info", lambda: info)
    assert self_check._extension_line() == (
        "native cuDNN extension: built against cudnn-frontend 1.32.0, cuDNN headers 9.19.0, CUDA 13.0, "
        "XLA FFI API 0.3 of jaxlib 0.10.2"
    )
    monkeypatch.setattr(ffi, "build_info", lambda: None)
    assert self_check._extension_line() == "native cuDNN extension: not built"


def test_a_failure_of_jax_itself_is_one_line(monkeypatch, capsys):
    import jax

    def broken(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("UNAVAILABLE: No PTX compilation provider is available.\nDetails: ...")

    monkeypatch.setattr(self_check, "_check", broken)
    assert self_check.main(ARGS) == 1
    assert capsys.readouterr().out == (
        "self-check FAILED: JAX cannot run on this machine: UNAVAILABLE: No PTX compilation provider is available.\n"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--length", "0"], "python -m attnlib: error: --length must be at least 1. Got 0.\n"),
        (["--heads", "8", "--kv-heads", "3"],
         "python -m attnlib: error: --heads must be a multiple of --kv-heads. Got --heads 8, --kv-heads 3.\n"),
    ],
)  # fmt: skip
def test_bad_sizes_are_one_line(capsys, args, message):
    assert self_check.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err == message and captured.out == ""


def test_help_names_every_option_and_version_prints(capsys):
    with pytest.raises(SystemExit):
        self_check.main(["--help"])
    out = capsys.readouterr().out
    for option in ("--batch", "--length", "--heads", "--kv-heads", "--head-dim", "--version"):
        assert option in out
    assert out.count("default:") == 5
    with pytest.raises(SystemExit):
        self_check.main(["--version"])
    assert capsys.readouterr().out.startswith("attnlib ")
