"""`jax.default_device` steers attnlib's dispatch: the implementations that need an accelerator decline a call it
places elsewhere, so a GPU or TPU machine runs the plain-JAX implementations under a CPU default device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_out_close
from reference import reference_attention

import attnlib
from attnlib._src.backends import placement, xla_chunked
from attnlib._src.backends.cudnn import support


def test_default_device_platform_follows_the_context():
    with jax.default_device(None):  # the host tests of a GPU or TPU machine run under a CPU one (conftest.py)
        assert placement.default_device_platform() is None
        assert placement.placement_platform() == jax.default_backend()
    with jax.default_device(jax.devices("cpu")[0]):
        assert placement.default_device_platform() == "cpu"
        assert placement.placement_platform() == "cpu"
    with jax.default_device(None):
        with jax.default_device("cpu"):
            assert placement.default_device_platform() == "cpu"
        assert placement.default_device_platform() is None


@pytest.mark.parametrize("platform", ["gpu", "tpu"], ids=["for_cudnn", "for_pallas_tpu"])
def test_an_accelerator_declines_a_call_placed_on_the_cpu(platform):
    with jax.default_device(jax.devices("cpu")[0]):
        reason = placement.elsewhere_reason(platform)
        assert reason == f"`jax.default_device` places this call on the CPU, not a {platform.upper()}"
        assert placement.elsewhere_reason("cpu") is None
    with jax.default_device(None):
        assert placement.elsewhere_reason(platform) is None


def test_cudnn_declines_a_cpu_placed_call_on_a_gpu_machine(monkeypatch):
    """With a GPU visible (its description stood in), the cuDNN policy declines under a CPU default device, and
    automatic dispatch runs and explains the plain-JAX implementation; a `Cudnn(device=...)` named for its GPU keeps
    the policy's own answer."""
    gpu = support.Device((9, 0), "NVIDIA H200", 91900)
    monkeypatch.setattr(support, "_device", lambda: (gpu, None))
    r = np.random.default_rng(0)
    shapes = ((2, 33, 4, 64), (2, 41, 2, 64), (2, 41, 2, 64))
    q, k, v = (jnp.asarray(r.standard_normal(s), jnp.bfloat16) for s in shapes)
    with jax.default_device(jax.devices("cpu")[0]):
        text = str(attnlib.explain(q, k, v, is_causal=True))
        assert "cudnn declined: `jax.default_device` places this call on the CPU, not a GPU" in text, text
        out = attnlib.attention(q, k, v, is_causal=True)
        named = attnlib.explain(q, k, v, is_causal=True, implementation=attnlib.Cudnn(device=gpu))
        assert named.implementation == "cudnn" and not named.declined, named
    assert_out_close(out, reference_attention(q, k, v, is_causal=True)[0], jnp.bfloat16)


def test_automatic_chunking_threshold_follows_the_placement(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with jax.default_device(None):
        assert xla_chunked.auto_min_score_bytes() == xla_chunked.AUTO_MIN_SCORE_BYTES
    with jax.default_device(jax.devices("cpu")[0]):
        assert xla_chunked.auto_min_score_bytes() == 0
