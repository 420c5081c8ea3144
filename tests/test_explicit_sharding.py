"""Explicit mesh axes ("sharding in types": `jax.sharding.AxisType.Explicit` under `jax.set_mesh`) on the plain-JAX
implementations, the layers and `PagedKVCache`.

`test_eight_device_cases` runs `tests/explicit_sharding_cases.py` in a subprocess with 8 simulated CPU devices (the
flag must be set before JAX starts): each case compiles with the batch over a `data` axis and the heads over a
`model` axis (mesh 2 x 4), keeps the operands' shardings on its results, and equals the unsharded call.
"""

import pytest
from helpers import run_pytest_on_simulated_devices


def test_eight_device_cases():
    run_pytest_on_simulated_devices("explicit_sharding_cases.py", 8)


@pytest.mark.full
def test_eight_device_cases_full_matrix():
    run_pytest_on_simulated_devices("explicit_sharding_cases.py", 8, tier="full")
