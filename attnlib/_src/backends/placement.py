"""Where a call traced now will run, as far as attnlib can tell when it picks an implementation.

A computation with uncommitted inputs runs on `jax.default_device` where one is set, else on JAX's default backend
(the GPU or TPU of an accelerator machine). The implementations that need an accelerator decline a call placed on
another platform, so that `with jax.default_device(jax.devices("cpu")[0])` on a GPU machine runs the plain-JAX
implementations instead of lowering a cuDNN call for the CPU.
"""

import jax


_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def default_device_platform() -> str | None:
    """The platform of `jax.default_device` ("cpu", "gpu", "tpu"), or None when none is set."""
    device = jax.config.jax_default_device
    if device is None:
        return None
    platform = device if isinstance(device, str) else device.platform
    return _PLATFORM_ALIASES.get(platform.lower(), platform.lower())


def placement_platform() -> str:
    """The platform a call traced now runs on when its inputs are not committed elsewhere: `jax.default_device`'s,
    else JAX's default backend."""
    platform = default_device_platform()
    return jax.default_backend() if platform is None else platform


def elsewhere_reason(platform: str) -> str | None:
    """Why an implementation for `platform` ("gpu" or "tpu") declines a call: `jax.default_device` places it on
    another platform; None when it does not."""
    placed = default_device_platform()
    if placed is None or placed == platform:
        return None
    return f"`jax.default_device` places this call on the {placed.upper()}, not a {platform.upper()}"
