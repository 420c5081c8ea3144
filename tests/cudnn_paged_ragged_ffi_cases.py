"""The mixed serving steps of `test_cudnn_paged_ragged.py` through the real graph call on the CPU.

Not collected by a plain `pytest` run: `test_cudnn_paged_ragged.py::test_the_ffi_call_on_the_cpu_handler` runs this
file in a subprocess, because the CPU model of a graph runs JAX inside the native extension's CPU handler and needs
asynchronous CPU dispatch off before JAX starts its backend. `implementation="cudnn"` then traces as on an H200 and
calls attnlib's `attnlib_cudnn_graph` FFI target (`cpu_graph.py`): the paged graph's operands as the GPU gets them
(rows `[B, max_seqlen_q, N, H]`, pools, page table, lengths) go to the emulated graph of its spec. Run it directly
with `python -m pytest tests/cudnn_paged_ragged_ffi_cases.py` (needs the native extension).
"""

import jax


jax.config.update("jax_cpu_enable_async_dispatch", False)

import cpu_graph  # noqa: E402 (after the dispatch setting)
import pytest  # noqa: E402
from test_cudnn_paged_ragged import _check_gradients, _check_step, _explain, _mixed_step, CASES, Step  # noqa: E402


@pytest.fixture(autouse=True)
def real_graph_call(monkeypatch):
    cpu_graph.install(monkeypatch)


@pytest.mark.parametrize("name", ["gqa_mla", "window", "mqa_page_16"])
def test_mixed_step_matches_the_float64_reference(name):
    step, kwargs = CASES[name]
    cache, queries = _mixed_step(step)
    assert _explain(step, cache, queries, **kwargs).implementation == "cudnn"
    _check_step(step, cache, queries, "cudnn", kwargs)


def test_rows_that_see_no_key_are_zero():
    step = Step(queries=(7, 1, 14, 0, 1, 2), max_seqlen_q=14)
    cache, queries = _mixed_step(step, seed=1)
    _check_step(step, cache, queries, "cudnn", {})


def test_gradient_differentiates_the_xla_fallback():
    step = Step()
    cache, queries = _mixed_step(step, seed=3)
    _check_gradients(step, cache, queries)
