"""GPU tests of the native executor's CUDA-graph replay (native/src/graph_replay.h).

A cuDNN graph call whose buffer addresses repeat is captured into a CUDA graph on the second use of those addresses
and replayed from it afterwards. These tests check what replay must never change — every call's result, against
the float64 reference of tests/reference.py, while the addresses repeat with new contents, change, or outnumber the
cache — and that replay happens at all (the extension's process-wide counts).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import reference_attention, reference_attention_vjp


pytestmark = pytest.mark.gpu

EPS = float(ml_dtypes.finfo(jnp.bfloat16).eps)
KW = dict(is_causal=True, diagonal_alignment="bottom_right")
NO_COMMAND_BUFFERS = {"xla_gpu_graph_min_graph_size": 1000}  # no XLA command buffer forms in these small programs


def _counts():
    from attnlib import _attnlib_ffi

    return _attnlib_ffi.graph_replay_counts()


def _delta(before):
    after = _counts()
    return {name: after[name] - before[name] for name in after}


def _inputs(seed, t=37, s=91, n=6, kh=2, h=64, hv=64):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    shapes = ((2, t, n, h), (2, s, kh, h), (2, s, kh, hv), (2, t, n, hv))
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in
            zip((kq, kk, kv, kd), shapes)]  # fmt: skip


def _as64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _assert_close(actual, expected, what, scale_by_max=False):
    actual, expected = _as64(actual), np.asarray(expected, np.float64)
    atol = (8 * EPS * np.abs(expected).max()) if scale_by_max else 2 * EPS
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=EPS, err_msg=what)


def test_repeated_addresses_with_new_contents_replay_the_captured_graph():
    """Calls of one jitted step whose graphs read and write only XLA's temporary buffers (q scaled by a traced factor
    in, converted results out) reuse the same addresses with new contents: they are replayed, and every call's output,
    log-sum-exp and gradients are those of its own inputs. The step is compiled without XLA's own command buffers,
    which would otherwise capture the graph calls with the fusions around them and replay them without calling
    attnlib's handler at all (measured on the H200: 6 direct calls in 7 steps, none through the cache)."""
    import attnlib

    q, k, v, d_out = _inputs(1)

    def loss(q, k, v, factor):
        out, lse = attnlib.attention(q * factor.astype(q.dtype), k, v, implementation="cudnn", return_residual=True,
                                     **KW)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), (out.astype(jnp.float32), 2 * lse)

    def step(q, k, v, factor):
        grads, (out, twice_lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, factor)
        return tuple(g.astype(jnp.float32) for g in grads), out, twice_lse

    step = jax.jit(step, compiler_options=NO_COMMAND_BUFFERS)
    factors = [1.0, 0.5, 2.0, 0.5, 1.5, 1.0, 0.25]
    jax.block_until_ready(step(q, k, v, jnp.float32(3.0)))  # compiled; its addresses seen once
    before = _counts()
    for factor in factors:
        results = jax.device_get(step(q, k, v, jnp.float32(factor)))  # the device buffers are dropped at once
        (dq, dk, dv), out, twice_lse = results
        qs = _as64(jnp.asarray(q * jnp.asarray(factor, q.dtype)))
        ref_out, ref_lse = reference_attention(qs, _as64(k), _as64(v), **KW)
        ref = reference_attention_vjp(qs, _as64(k), _as64(v), d_out=_as64(d_out), **KW)
        _assert_close(out, ref_out, f"out, factor {factor}")
        _assert_close(twice_lse / 2, ref_lse, f"lse, factor {factor}")
        _assert_close(dq, ref["query"] * factor, f"dq, factor {factor}", scale_by_max=True)
        _assert_close(dk, ref["key"], f"dk, factor {factor}", scale_by_max=True)
        _assert_close(dv, ref["value"], f"dv, factor {factor}", scale_by_max=True)
    delta = _delta(before)
    assert delta["failures"] == 0, delta
    assert delta["captures"] >= 2, delta  # the forward and the backward graph
    assert delta["reissued"] == delta["captures"], delta  # every capture's launches issued again by attnlib
    assert delta["replays"] >= len(factors), delta


def test_layer_loop_replays_give_each_layer_its_own_result():
    """A `lax.scan` over layers runs one graph call per layer with new contents (each layer its own query): every
    layer's output, log-sum-exp and gradients match the float64 reference, whichever calls were replayed."""
    import attnlib

    layers = 6
    _, k, v, _ = _inputs(1)
    qs = jnp.stack([_inputs(10 + i)[0] for i in range(layers)])
    d_outs = jnp.stack([_inputs(20 + i)[3] for i in range(layers)])

    def loss(qs, k, v):
        def layer(_, q):
            return None, attnlib.attention(q, k, v, implementation="cudnn", return_residual=True, **KW)

        outs, lses = jax.lax.scan(layer, None, qs)[1]
        return jnp.sum(outs.astype(jnp.float32) * d_outs.astype(jnp.float32)), (outs, lses)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    before = _counts()
    for _ in range(3):
        (dqs, dk, dv), (outs, lses) = jax.device_get(step(qs, k, v))
    delta = _delta(before)
    ref_dk, ref_dv = 0.0, 0.0
    for i in range(layers):
        q64 = _as64(qs[i])
        ref_out, ref_lse = reference_attention(q64, _as64(k), _as64(v), **KW)
        ref = reference_attention_vjp(q64, _as64(k), _as64(v), d_out=_as64(d_outs[i]), **KW)
        _assert_close(outs[i], ref_out, f"out, layer {i}")
        _assert_close(lses[i], ref_lse, f"lse, layer {i}")
        _assert_close(dqs[i], ref["query"], f"dq, layer {i}", scale_by_max=True)
        ref_dk, ref_dv = ref_dk + ref["key"], ref_dv + ref["value"]
    _assert_close(dk, ref_dk, "dk", scale_by_max=True)
    _assert_close(dv, ref_dv, "dv", scale_by_max=True)
    assert delta["failures"] == 0, delta


def test_changing_addresses_run_directly_and_captures_stay_bounded():
    """Forty distinct inputs, each called twice and kept alive: every result is right, and no executable captures
    more than its budget of 16 graphs however many address sets it meets."""
    import attnlib

    f = jax.jit(lambda q, k, v: attnlib.attention(q, k, v, implementation="cudnn", **KW))
    _, k, v, _ = _inputs(2)
    ref_k, ref_v = _as64(k), _as64(v)
    kept = []
    before = _counts()
    for seed in range(40):
        q = _inputs(100 + seed)[0]
        ref, _ = reference_attention(_as64(q), ref_k, ref_v, **KW)
        for _ in range(2):
            out = f(q, k, v)
            _assert_close(out, ref, f"input {seed}")
            kept.append(out)
        kept.append(q)
    delta = _delta(before)
    assert delta["failures"] == 0, delta
    assert delta["captures"] <= 16, delta
    assert delta["replays"] + delta["direct"] == 80, delta


def test_replay_modes_give_the_same_results(tmp_path):
    """A short graph's calls are replayed by default; ATTNLIB_CUDNN_GRAPH_REPLAY (read when an executable is loaded)
    "0" runs every call directly, "always" replays whatever the call's size; the results are the same bit for bit."""
    code = (
        "import sys, jax, jax.numpy as jnp, numpy as np, attnlib\n"
        "from attnlib import _attnlib_ffi\n"
        "q = jax.random.normal(jax.random.key(0), (2, 96, 4, 64)).astype(jnp.bfloat16)\n"
        "f = jax.jit(lambda q, s: attnlib.attention(q * s, q, q, is_causal=True, implementation='cudnn') * 1)\n"
        "outs = [np.asarray(f(q, jnp.bfloat16(s)), np.float32) for s in (1.0, 0.5, 2.0, 0.75, 1.0)]\n"
        "np.save(sys.argv[1], np.stack(outs))\n"
        "print('COUNTS', _attnlib_ffi.graph_replay_counts())\n"
    )
    results, counts = [], []
    for flag in ("", "0", "always"):
        path = tmp_path / f"out_{flag}.npy"
        env = dict(os.environ, ATTNLIB_CUDNN_GRAPH_REPLAY=flag, ATTNLIB_CACHE_DIR=str(tmp_path / "cache"))
        run = subprocess.run([sys.executable, "-c", code, str(path)], check=True, env=env, capture_output=True,
                             text=True)  # fmt: skip
        line = next(line for line in run.stdout.splitlines() if line.startswith("COUNTS"))
        counts.append(eval(line.removeprefix("COUNTS ")))  # a dict literal printed by the child
        results.append(np.load(path))
    on, off, always = counts
    assert on["replays"] >= 3 and on["failures"] == 0, on
    assert off["replays"] == 0 and off["captures"] == 0 and off["direct"] == 5, off
    assert always["replays"] >= 3 and always["failures"] == 0, always
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_graphs_with_and_without_a_workspace_run_replayed_and_directly():
    """Plans that need no workspace run without a workspace result, the others on XLA's temporary buffer, replayed
    or not: the forward (with and without statistics) and backward of a short call match the float64 reference, and
    each lowered call has its workspace result exactly when its plan needs one."""
    import attnlib
    from attnlib._src.backends.cudnn import executor

    # Shapes no other test traces: a graph call already traced in this worker process is reused from JAX's trace
    # caches without asking the executor for its entry (the README's test command on the H200, 2026-12-06).
    q, k, v, d_out = _inputs(3, t=29, s=59)
    entries = []

    def recorded_entry(self, spec, get=executor.FfiExecutor.get_entry):
        entries.append(get(self, spec))
        return entries[-1]

    def step(q, k, v):
        def loss(q, k, v):
            out = attnlib.attention(q, k, v, implementation="cudnn", **KW)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        inference = attnlib.attention(q, k, v, implementation="cudnn", **KW)
        return out, inference, grads

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(executor.FfiExecutor, "get_entry", recorded_entry)
        lowered = jax.jit(step).lower(q, k, v)
    calls = [line for line in lowered.as_text().splitlines() if "custom_call @attnlib_cudnn_graph" in line]
    assert len(calls) == len(entries) == 3, (len(calls), len(entries))
    for line in calls:
        ws = int(line.split("ws_bytes = ")[1].split(" ")[0])
        assert (f"tensor<{ws}xui8>" in line) is (ws > 0), line
    compiled = lowered.compile()
    ref_out, _ = reference_attention(_as64(q), _as64(k), _as64(v), **KW)
    ref = reference_attention_vjp(_as64(q), _as64(k), _as64(v), d_out=_as64(d_out), **KW)
    before = _counts()
    for _ in range(4):  # direct, captured, replayed
        out, inference, (dq, dk, dv) = jax.device_get(compiled(q, k, v))
        _assert_close(out, ref_out, "out")
        _assert_close(inference, ref_out, "inference out")
        _assert_close(dq, ref["query"], "dq", scale_by_max=True)
        _assert_close(dk, ref["key"], "dk", scale_by_max=True)
        _assert_close(dv, ref["value"], "dv", scale_by_max=True)
    assert _delta(before)["failures"] == 0
    print("workspace bytes:", {entry.label: entry.workspace_bytes for entry in entries})


@pytest.mark.parametrize("command_buffers", [False, True], ids=["replayed", "in_xla_command_buffer"])
def test_zero_filled_results_replayed_and_in_xla_command_buffers(command_buffers):
    """A backward with a padded bias gradient zeroes dBias before cuDNN runs (its `zero_fill`), so a captured call
    holds the memset ahead of the plan's launches. Called with new contents at the same addresses, replayed (XLA's
    command buffers off) or captured into XLA's command buffer (`xla_gpu_graph_min_graph_size=1`), every call's
    gradients match the float64 reference and dBias is zero past the key lengths."""
    import attnlib

    q, k, v, d_out = _inputs(4)
    bias = jax.random.normal(jax.random.key(5), (2, 6, 37, 91), jnp.float32).astype(jnp.bfloat16)
    lengths = dict(key_value_seq_lengths=jnp.asarray([91, 50], jnp.int32))

    def loss(q, k, v, bias, factor):
        out = attnlib.attention(q * factor.astype(q.dtype), k, v, bias, implementation="cudnn", is_causal=True,
                                **lengths)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    def step(q, k, v, bias, factor):
        return tuple(g.astype(jnp.float32) for g in jax.grad(loss, argnums=(0, 3))(q, k, v, bias, factor))

    options = {"xla_gpu_graph_min_graph_size": 1} if command_buffers else NO_COMMAND_BUFFERS
    step = jax.jit(step, compiler_options=options)
    lengths64 = {name: np.asarray(x) for name, x in lengths.items()}
    before = _counts()
    jax.block_until_ready(step(q, k, v, bias, jnp.float32(1.0)))  # XLA records its command buffer on this one
    for factor in (0.5, 2.0, 1.0, 0.75):
        dq, dbias = jax.device_get(step(q, k, v, bias, jnp.float32(factor)))
        qs = _as64(jnp.asarray(q * jnp.asarray(factor, q.dtype)))
        ref = reference_attention_vjp(qs, _as64(k), _as64(v), _as64(bias), d_out=_as64(d_out), is_causal=True,
                                      **lengths64)  # fmt: skip
        _assert_close(dq, ref["query"] * factor, f"dq, factor {factor}", scale_by_max=True)
        _assert_close(dbias, ref["bias"], f"dbias, factor {factor}", scale_by_max=True)
        assert not np.any(dbias[1, :, :, 50:]), "dbias past the key length"
    delta = _delta(before)
    assert delta["failures"] == 0, delta
    if command_buffers:
        assert delta["xla_records"] >= 1 and delta["reissued"] == delta["xla_records"], delta
    else:
        assert delta["captures"] >= 1 and delta["replays"] >= 1 and delta["xla_records"] == 0, delta
        assert delta["reissued"] == delta["captures"], delta
