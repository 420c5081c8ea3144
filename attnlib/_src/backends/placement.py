"""Where a call traced now will run, as far as attnlib can tell when it picks an implementation.

A computation with uncommitted inputs runs on `jax.default_device` where one is set, else on the devices of the mesh
`jax.set_mesh` names, else on JAX's default backend (the GPU or TPU of an accelerator machine). Devices of a
deviceless topology (`jax.experimental.topologies`: a TPU slice described on a host without one, for compiling ahead
of time) count as their platform's, so a program traced for them picks the kernels it would pick on the slice. The implementations that need an accelerator decline a call placed on
another platform, so that `with jax.default_device(jax.devices("cpu")[0])` on a GPU machine runs the plain-JAX
implementations instead of lowering a cuDNN call for the CPU.
"""

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np


T = TypeVar("T")

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def default_device_platform() -> str | None:
    """The platform of `jax.default_device` ("cpu", "gpu", "tpu"), or None when none is set."""
    device = jax.config.jax_default_device
    if device is None:
        return None
    platform = device if isinstance(device, str) else device.platform
    return _PLATFORM_ALIASES.get(platform.lower(), platform.lower())


def mesh_platform() -> str | None:
    """The platform of the mesh `jax.set_mesh` names ("cpu", "gpu", "tpu"), or None when none is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if getattr(mesh, "empty", True):
        return None
    platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    return None if platform is None else _PLATFORM_ALIASES.get(platform.lower(), platform.lower())


def placement_platform() -> str:
    """The platform a call traced now runs on when its inputs are not committed elsewhere: `jax.default_device`'s,
    else `jax.set_mesh`'s mesh's, else JAX's default backend."""
    platform = default_device_platform() or mesh_platform()
    return jax.default_backend() if platform is None else platform


def _attached(device: jax.Device) -> bool:
    try:
        return device in jax.devices(device.platform)
    except RuntimeError:  # no backend of that platform on this host
        return False


def _deviceless() -> bool:
    """Whether calls traced now are placed on devices of a deviceless topology (`jax.default_device`, or the mesh
    `jax.set_mesh` names)."""
    device = jax.config.jax_default_device
    if device is not None and not isinstance(device, str) and not _attached(device):
        return True
    platform = mesh_platform()
    if platform is None:
        return False
    try:
        return not jax.devices(platform)
    except RuntimeError:  # no backend of that platform on this host
        return True


def built_on_host(build: Callable[[], T]) -> T:
    """`build()`, whose concrete arrays (kernel tables built once) go to the host's CPU while calls are placed on a
    deviceless topology (`jax.default_device` or `jax.set_mesh`), where no array can live; elsewhere it runs as is.
    There it runs on a thread of its own: JAX's placement settings are per thread, and inside `jit` no mesh can be
    set."""
    if not _deviceless():
        return build()

    def on_host() -> T:
        with jax.default_device(jax.devices("cpu")[0]):
            return build()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(on_host).result()


def elsewhere_reason(platform: str) -> str | None:
    """Why an implementation for `platform` ("gpu" or "tpu") declines a call: `jax.default_device` places it on
    another platform; None when it does not."""
    placed = default_device_platform()
    if placed is None or placed == platform:
        return None
    return f"`jax.default_device` places this call on the {placed.upper()}, not a {platform.upper()}"
