"""`attnlib.context_parallel`: layout helpers, the static block plan, argument errors, and the 8-device cases.

The numerical cases need 8 devices (`--xla_force_host_platform_device_count=8`), a flag that must be set before JAX
initialises its CPU backend; in this pytest process other test files (and `conftest.py`) have initialised it
already with one device. So `test_eight_device_cases` runs `tests/cp_cases.py` in a fresh `python -m pytest`
subprocess with the flag in its environment and fails with that run's report when any case fails (or when the
subprocess cannot see 8 devices: `cp_cases.py` refuses to run with fewer). Everything else here runs in-process:
pure-Python checks of the plan against brute-force visibility, `reorder` / `restore`, errors, and a one-device
mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grad_close, assert_out_close, run_pytest_on_simulated_devices

import attnlib
from attnlib import context_parallel as cp
from attnlib._src.band import Band
from attnlib._src.context_parallel import planner as cp_src


P = jax.sharding.PartitionSpec


# ------------------------------------------------------------------------------------------------------------------
# The 8-device cases (subprocess)


def test_eight_device_cases():
    run_pytest_on_simulated_devices("cp_cases.py", 8)


@pytest.mark.full
def test_eight_device_cases_full_matrix():
    run_pytest_on_simulated_devices("cp_cases.py", 8, tier="full")


# ------------------------------------------------------------------------------------------------------------------
# reorder / restore


def test_reorder_documented_order():
    x = jnp.arange(16)
    np.testing.assert_array_equal(
        cp.reorder(x, 4, axis=-1), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    )


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
def test_restore_inverts_reorder(num_shards):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2 * num_shards * 3, 5, 7)), jnp.float32)
    y = cp.reorder(x, num_shards)
    assert y.shape == x.shape
    assert not num_shards > 1 or not np.array_equal(y, x)
    np.testing.assert_array_equal(cp.restore(y, num_shards), x)
    ids = jnp.arange(2 * 2 * num_shards * 3).reshape(2, -1)
    np.testing.assert_array_equal(cp.restore(cp.reorder(ids, num_shards, axis=-1), num_shards, axis=-1), ids)


def test_reorder_balances_causal_work():
    """Device r's two chunks hold as many causal (query, key) pairs as every other device's."""
    D, L = 4, 32
    pos = np.asarray(cp.reorder(jnp.arange(L), D, axis=-1)).reshape(D, -1)
    work = [(p[:, None] >= np.arange(L)[None, :]).sum() for p in pos]
    assert len(set(work)) == 1
    contiguous = [(p[:, None] >= np.arange(L)[None, :]).sum() for p in np.arange(L).reshape(D, -1)]
    assert len(set(contiguous)) == D


def test_reorder_errors():
    with pytest.raises(ValueError, match=r"multiple of 8\. Got x\.shape=\(2, 12, 3, 4\), axis=-3, num_shards=4"):
        cp.reorder(jnp.zeros((2, 12, 3, 4)), 4)
    with pytest.raises(ValueError, match=r"`num_shards` must be a positive Python int\. Got 0"):
        cp.restore(jnp.zeros((2, 12, 3, 4)), 0)
    with pytest.raises(ValueError, match=r"`axis` must be an int in \[-4, 4\)"):
        cp.reorder(jnp.zeros((2, 12, 3, 4)), 1, axis=4)


# ------------------------------------------------------------------------------------------------------------------
# The static plan, against brute force


def _allowed(q_pos, k_pos, is_causal, window, shift):
    """Written from the definition: query `q` sees key `k` at offset `k - (q + shift)` (`shift` = S - T bottom-right,
    0 top-left) when the offset is <= 0 under `is_causal` and within `-left … +right` of a `window`."""
    off = k_pos[None, :] - (q_pos[:, None] + shift)
    allowed = np.ones(off.shape, bool)
    if is_causal:
        allowed &= off <= 0
    if window is not None:
        allowed &= (off >= -window[0]) & (off <= window[1])
    return allowed


def _native_mask(n, m, is_causal, window, alignment):
    """attnlib's rule on an `n x m` block (no padding): `masks.visible` with top-left / bottom-right positions."""
    return _allowed(np.arange(n), np.arange(m), is_causal, window, 0 if alignment == "top_left" else m - n)


def _rule(T, S, is_causal=False, window=None, alignment="top_left"):
    """The planner's rule for a whole call of `T` queries and `S` keys with these flags."""
    return cp_src._Rule(Band.from_flags(is_causal=is_causal, window=window, diagonal_alignment=alignment), T, S)


PLAN_CONFIGS = [
    (D, lb, Tl, Sl, causal, window, align)
    for D in (1, 2, 3, 4, 8)
    for lb in (False, True)
    for Tl, Sl in ((6, 6), (4, 8), (8, 4))
    for causal, window, align in (
        (False, None, "top_left"), (True, None, "top_left"), (True, None, "bottom_right"),
        (True, (5, 0), "top_left"), (False, (3, 2), "top_left"), (False, (0, 7), "bottom_right"),
        (True, (20, 0), "top_left"), (False, (1, 1), "top_left"),
    )
]  # fmt: skip


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("segments,allow_br", [(False, True), (False, False), (True, False)])
def test_plan_covers_exactly_the_visible_pairs(strategy, segments, allow_br):
    """Every visible (query, key) pair is computed exactly once, with the right mask, on every device and step."""
    checked = 0
    for D, lb, Tl, Sl, causal, window, align in PLAN_CONFIGS:
        T, S = D * Tl, D * Sl
        rule = _rule(T, S, causal, window, align)
        rule_mask = lambda q_pos, k_pos: _allowed(q_pos, k_pos, causal, window, S - T if align == "bottom_right" else 0)
        q_layout, k_layout = cp_src._Layout(D, Tl, lb), cp_src._Layout(D, Sl, lb)
        plan = cp_src._make_plan(strategy, D, q_layout, k_layout, rule, allow_br, segments)
        positions = lambda layout, r: np.concatenate([g + np.arange(n) for _, g, n in layout.chunks(r)])
        covered = {r: np.zeros((Tl, S), int) for r in range(D)}  # per device: query row x global key
        for idx, sp in zip(plan.steps, plan.step_plans, strict=True):
            for r in range(D):
                b = sp.branch_of[r]
                if strategy == "ring":
                    k_pos = positions(k_layout, (r - idx) % D)
                else:
                    k_pos = np.arange(S)
                q_pos = positions(q_layout, r)
                for i, task in enumerate(sp.branches[b]):
                    rows = slice(task.q_start, task.q_start + task.q_size)
                    cols = slice(task.k_start, task.k_start + task.k_size)
                    # the tables give the task's global positions
                    tq = np.concatenate([g + np.arange(n) for g, n in sp.q_globals[r][i]])
                    tk = np.concatenate([g + np.arange(n) for g, n in sp.k_globals[r][i]])
                    np.testing.assert_array_equal(tq, q_pos[rows])
                    np.testing.assert_array_equal(tk, k_pos[cols])
                    if segments:
                        assert task.kind == "mask"
                    if task.kind == "full":
                        m = np.ones((task.q_size, task.k_size), bool)
                    elif task.kind == "native":
                        assert allow_br or task.alignment == "top_left"
                        m = _native_mask(task.q_size, task.k_size, task.is_causal, task.window, task.alignment)
                        assert task.window is None or min(task.window) >= 0
                    else:
                        m = rule_mask(q_pos[rows], k_pos[cols])
                    np.testing.assert_array_equal(m, m & rule_mask(q_pos[rows], k_pos[cols]))
                    block = np.zeros((Tl, S), int)
                    block[rows, k_pos[cols]] = m
                    covered[r] += block
        for r in range(D):
            q_pos = positions(q_layout, r)
            expected = rule_mask(q_pos, np.arange(S)).astype(int)
            np.testing.assert_array_equal(covered[r], expected, err_msg=f"{D=} {lb=} {Tl=} {Sl=} {rule} device {r}")
        checked += 1
    assert checked == len(PLAN_CONFIGS)


def _work(plan, D):
    """Per device: the number of (query, key) entries its calls compute."""
    work = [0] * D
    for sp in plan.step_plans:
        for r in range(D):
            work[r] += sum(t.q_size * t.k_size for t in sp.branches[sp.branch_of[r]])
    return work


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
@pytest.mark.parametrize("D", [2, 4, 8])
def test_load_balanced_causal_plan_gives_equal_work(strategy, D):
    L = 6
    rule = _rule(D * L, D * L, is_causal=True)
    plan = cp_src._make_plan(strategy, D, cp_src._Layout(D, L, True), cp_src._Layout(D, L, True), rule, True, False)
    work = _work(plan, D)
    assert len(set(work)) == 1, work
    # every step after the diagonal is one half-block call on every device (no wasted score entries)
    if strategy == "ring":
        assert all(
            len(b) == 1 and b[0].kind == "full" and b[0].q_size * b[0].k_size == L * L // 2
            for sp in plan.step_plans[1:] for b in sp.branches
        )  # fmt: skip
    contiguous = cp_src._make_plan(
        strategy, D, cp_src._Layout(D, L, False), cp_src._Layout(D, L, False), rule, True, False
    )
    assert len(set(_work(contiguous, D))) == D


def test_ring_plan_skips_steps_outside_the_window():
    D, L = 8, 6
    plan = lambda is_causal, window: cp_src._make_plan(
        "ring", D, cp_src._Layout(D, L, False), cp_src._Layout(D, L, False), _rule(D * L, D * L, is_causal, window),
        True, False,
    )
    assert plan(True, None).steps == tuple(range(8))
    assert plan(True, (5, 0)).steps == (0, 1)
    assert plan(True, (13, 0)).steps == (0, 1, 2, 3)
    assert plan(False, (2, 7)).steps == (0, 1, 6, 7)  # later shards arrive from the other side of the ring


# ------------------------------------------------------------------------------------------------------------------
# One-device mesh (in-process) and errors


def _one_device(fn, *args):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("sp",))
    spec = P(None, "sp")
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec)(*args)


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_one_device_mesh_matches_attention(strategy):
    r = np.random.default_rng(1)
    q = jnp.asarray(r.standard_normal((2, 12, 4, 8)), jnp.float32)
    k = jnp.asarray(r.standard_normal((2, 12, 2, 8)), jnp.float32)
    v = jnp.asarray(r.standard_normal((2, 12, 2, 4)), jnp.float32)
    kwargs = {"is_causal": True, "local_window_size": (4, 1)}
    ref = lambda q, k, v: jnp.sum(jnp.sin(attnlib.attention(q, k, v, **kwargs)))
    f = lambda q, k, v: jnp.sum(
        jnp.sin(_one_device(lambda *a: cp.attention(*a, axis_name="sp", strategy=strategy, **kwargs), q, k, v))
    )
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    grads_ref = jax.jit(jax.grad(ref, argnums=(0, 1, 2)))(q, k, v)
    out = jax.jit(
        lambda q, k, v: _one_device(lambda *a: cp.attention(*a, axis_name="sp", strategy=strategy, **kwargs), q, k, v)
    )(q, k, v)
    assert_out_close(out, attnlib.attention(q, k, v, **kwargs), jnp.float32)
    for g, gr, name in zip(grads, grads_ref, "qkv", strict=True):
        assert_grad_close(g, gr, jnp.float32, what=f"d{name}")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"bias": jnp.zeros((1, 1, 4, 4))}, NotImplementedError, r"does not support `bias` yet"),
        ({"mask": jnp.ones((4, 4), bool)}, NotImplementedError, r"does not support `mask` yet"),
        ({"dropout_rate": 0.1}, NotImplementedError, r"does not support `dropout_rate` yet"),
        ({"cu_seqlens_q": jnp.array([0, 4])}, NotImplementedError, r"does not support `cu_seqlens_q` yet"),
        ({"page_table": jnp.zeros((1, 1), jnp.int32)}, NotImplementedError, r"does not support `page_table` yet"),
        (
            {"is_causal": True, "diagonal_alignment": "bottom_right", "query_seq_lengths": jnp.array([3])},
            NotImplementedError, r'`diagonal_alignment="bottom_right"` together with `query_seq_lengths`',
        ),
        ({"strategy": "tree"}, ValueError, r"`strategy` must be one of \['ring', 'all_gather'\]\. Got 'tree'"),
        ({"load_balanced": False, "q_segment_ids": jnp.zeros((1, 3), jnp.int32)}, ValueError,
         r"`q_segment_ids` must have shape \[\*B, T_l\]=\(1, 4\)\. Got q_segment_ids.shape=\(1, 3\)"),
        ({"query_seq_lengths": jnp.array([1.0])}, TypeError, r"`query_seq_lengths` must have an integer dtype"),
        ({"sinks": jnp.zeros((3,))}, ValueError, r"`sinks` must have shape \[N\]=\(2,\)\. Got sinks.shape=\(3,\)"),
        ({"local_window_size": -1}, ValueError, r"`local_window_size` must be a non-negative int"),
        ({"frobnicate": 1}, TypeError, r"unexpected keyword argument `frobnicate`"),
        ({"load_balanced": 1}, TypeError, r"`load_balanced` must be a Python bool\. Got 1 of type int"),
        ({"is_causal": "yes"}, TypeError, r"`is_causal` must be a Python bool\. Got 'yes'"),
        ({"return_residual": 1}, TypeError, r"`return_residual` must be a Python bool\. Got 1 of type int"),
        ({"diagonal_alignment": "center"}, ValueError,
         r"`diagonal_alignment` must be 'top_left' or 'bottom_right'\. Got 'center'"),
        ({"sinks": jnp.zeros((2,), jnp.int32)}, TypeError, r"`sinks` must have a floating dtype\. Got sinks"),
    ],
    ids=["bias", "mask", "dropout", "thd", "paged", "bottom_right_lengths", "strategy", "segment_shape",
         "length_dtype", "sinks_shape", "window", "unknown", "load_balanced", "is_causal", "return_residual",
         "alignment", "sinks_dtype"],
)  # fmt: skip
def test_errors(kwargs, error, match):
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(error, match=match):
        _one_device(lambda q, k, v: cp.attention(q, k, v, axis_name="sp", **kwargs), x, x, x)


def test_load_balanced_needs_even_local_lengths():
    x = jnp.zeros((1, 3, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"local query and key lengths must be even\. Got query.shape=\(1, 3, 2, 8\)"):
        _one_device(lambda q, k, v: cp.attention(q, k, v, axis_name="sp"), x, x, x)


def test_axis_name_outside_shard_map():
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"`axis_name` must name a mesh axis bound by the enclosing `shard_map`"):
        cp.attention(x, x, x, axis_name="sp")


def test_public_names():
    assert {n for n in dir(cp) if not n.startswith("_")} >= {"attention", "reorder", "restore"}
    assert all(callable(getattr(cp, n)) for n in ("attention", "reorder", "restore"))

