"""Context parallelism: attention over a sequence sharded across a mesh axis (`attnlib.context_parallel`).

Called inside `shard_map`, each device holds `T / D` query tokens and `S / D` key/value tokens of every sequence
(`D` = size of the mesh axis). Two strategies:

- `"all_gather"`: keys/values (and key segment ids) are all-gathered once; each device attends its own queries.
  Plain autodiff: the transpose of `all_gather` reduce-scatters dK/dV back to their owners.
- `"ring"`: key/value blocks travel around the ring with `ppermute` (the next transfer is issued before the current
  step's compute); a `custom_vjp` backward rings again, dK/dV accumulators travelling with their block and going
  home at the end. The forward saves only local arrays, so memory per device is O(S / D).

How masks become per-step work (the *plan*). Every local token has a global position fixed by the layout
(contiguous shards, or the load-balanced "dual chunk" order of `reorder`). The causal / window rule is a band on
`key_position - query_position`; since every layout is made of contiguous *chunks* of global positions, the plan
uses interval arithmetic on chunks, at trace time, to turn every (step, device) into a few `attnlib.attention`
calls on sub-blocks, each

- fully visible: no mask;
- a band that `attnlib.attention` expresses natively on the sub-block (`is_causal`, `local_window_size`,
  `diagonal_alignment`; padding lengths become local prefix lengths): those flags;
- anything else: a small boolean `mask` `[T_sub, S_sub]` built from global positions.

Empty chunk pairs are skipped, key columns no query sees are trimmed, and a ring step that no device needs is
dropped, transfers included (windows cost only the steps they reach). Chunks are combined into one call when that
computes no more score entries than separate calls. Packed rows (segment ids) always use the boolean-mask form,
built from global segment ids and global positions (within one contiguous segment, differences of in-segment
positions are differences of global positions). Partial results `(out_i, lse_i)` merge exactly through `lse`;
sinks enter once, in the final merge. Devices whose plans differ (the causal diagonal, load-balanced halves) pick
their branch with `lax.switch` on `axis_index`.
"""

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .attention import attention as _attention
from .varying import match, vary_over, varying_axes


_STRATEGIES = ("ring", "all_gather")

# Options forwarded unchanged to every per-step `attnlib.attention` call.
_FORWARDED = ("scale", "logits_soft_cap", "implementation", "deterministic_backward")
# Options interpreted here.
_HANDLED = (
    "is_causal", "query_seq_lengths", "key_value_seq_lengths", "local_window_size", "return_residual",
    "diagonal_alignment", "q_segment_ids", "kv_segment_ids", "max_segments_per_row", "sinks",
)  # fmt: skip
# Options of `attnlib.attention` that context parallelism cannot serve yet (checked for non-default values).
_UNSUPPORTED = {
    "bias": "a `bias` would have to be sharded along both sequence axes",
    "mask": "a dense `mask` would have to be sharded along both sequence axes; use segment ids, lengths, "
    "`is_causal` or `local_window_size`",
    "dropout_rate": "dropout masks are indexed by local, not global, positions",
    "dropout_key": "dropout masks are indexed by local, not global, positions",
    "cu_seqlens_q": "the THD layout (`cu_seqlens_q`) is not sharded by context parallelism; use segment ids",
    "cu_seqlens_kv": "the THD layout (`cu_seqlens_kv`) is not sharded by context parallelism; use segment ids",
    "max_seqlen_q": "the THD layout (`max_seqlen_q`) is not sharded by context parallelism",
    "max_seqlen_kv": "the THD layout (`max_seqlen_kv`) is not sharded by context parallelism",
    "page_table": "paged key/value caches (`page_table`) are for decoding, not context parallelism",
    "fp8": "per-tensor FP8 scales would have to be agreed across the shards",
}
# `score_mod` / `mask_mod` would see shard-local positions and blocks (checked for anything but None / empty).
_UNSUPPORTED_MODIFIERS = ("score_mod", "mask_mod", "score_mod_args")


# ----------------------------------------------------------------------------------------------------------------
# Load-balanced layout


def _chunk_order(num_shards: int) -> np.ndarray:
    """Global chunk index of each load-balanced slot: device r holds chunks r and 2D-1-r."""
    D = num_shards
    return np.array([c for r in range(D) for c in (r, 2 * D - 1 - r)], np.int32)


def _permute_chunks(x: Any, num_shards: Any, axis: int, name: str, inverse: bool) -> jax.Array:
    x = jnp.asarray(x)
    if isinstance(num_shards, bool) or not isinstance(num_shards, numbers.Integral) or num_shards < 1:
        raise ValueError(f"`num_shards` must be a positive Python int. Got {num_shards!r}.")
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"`axis` must be an int in [-{x.ndim}, {x.ndim}) for `x` of rank {x.ndim}. Got {axis!r}.")
    ax = axis % x.ndim
    L = x.shape[ax]
    D = int(num_shards)
    if L % (2 * D):
        raise ValueError(
            f"`{name}` splits the sequence axis into 2 * num_shards = {2 * D} equal chunks, so its length must be "
            f"a multiple of {2 * D}. Got x.shape={tuple(x.shape)}, axis={axis}, num_shards={D}."
        )
    order = _chunk_order(D)
    if inverse:
        order = np.argsort(order).astype(np.int32)
    chunks = jnp.reshape(x, x.shape[:ax] + (2 * D, L // (2 * D)) + x.shape[ax + 1 :])
    return jnp.reshape(jnp.take(chunks, order, axis=ax), x.shape)


def reorder(x: Any, num_shards: int, axis: int = -3) -> jax.Array:
    """Global token order -> the load-balanced order that `attention(..., load_balanced=True)` expects.

    The sequence is cut into `2 * num_shards` equal chunks and laid out so that shard `r` (the `r`-th contiguous
    slice after sharding) holds chunks `r` and `2 * num_shards - 1 - r`: under a causal mask every shard then
    has the same amount of work. With `num_shards=4` and 16 tokens the order is
    `[0 1 | 14 15 | 2 3 | 12 13 | 4 5 | 10 11 | 6 7 | 8 9]`.

    Args:
        x: array whose axis `axis` is the sequence: `[*B, T, N, H]` with `axis=-3` (the default) for queries,
            keys, values and outputs; `[*B, T]` with `axis=-1` for segment ids.
        num_shards: the size `D` of the mesh axis the sequence will be sharded over.
        axis: the sequence axis. Defaults to -3.

    Returns:
        `x` with its sequence axis permuted (same shape and dtype).

    Raises:
        ValueError: the sequence length is not a multiple of `2 * num_shards`, or `num_shards` / `axis` is
            invalid.
    """
    return _permute_chunks(x, num_shards, axis, "reorder", inverse=False)


def restore(x: Any, num_shards: int, axis: int = -3) -> jax.Array:
    """The inverse of `reorder`: load-balanced order -> global token order.

    Args:
        x: array in the load-balanced order along `axis` (e.g. the output of `attention`).
        num_shards: the `num_shards` given to `reorder`.
        axis: the sequence axis. Defaults to -3 (`axis=-1` for segment ids and for `lse` `[*B, T, N]` use -2).

    Returns:
        `x` in global token order.

    Raises:
        ValueError: the sequence length is not a multiple of `2 * num_shards`, or `num_shards` / `axis` is
            invalid.
    """
    return _permute_chunks(x, num_shards, axis, "restore", inverse=True)


# ----------------------------------------------------------------------------------------------------------------
# The static plan


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How global positions are laid out over the devices of the mesh axis."""

    num_shards: int
    local_len: int
    load_balanced: bool

    def chunks(self, shard: int) -> tuple[tuple[int, int, int], ...]:
        """`(local_start, global_start, size)` of the contiguous global runs held by `shard`."""
        D, L = self.num_shards, self.local_len
        if not self.load_balanced:
            return ((0, shard * L, L),)
        C = L // 2
        return ((0, shard * C, C), (C, (2 * D - 1 - shard) * C, C))


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Key `k` is visible to query `q` when `lo <= k - (q + shift) <= hi` (positions global)."""

    lo: float
    hi: float
    shift: int


@dataclasses.dataclass(frozen=True)
class _Task:
    """One `attnlib.attention` call of a step: local query rows x local key columns.

    `kind` is "full" (no mask), "native" (the flags below), or "mask" (boolean mask from global positions).
    """

    q_start: int
    q_size: int
    k_start: int
    k_size: int
    kind: str
    is_causal: bool = False
    window: tuple[int, int] | None = None
    alignment: str = "top_left"


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A task on one device: the `(global_start, size)` of each contiguous run of its query rows and key columns."""

    task: _Task
    q_globals: tuple[tuple[int, int], ...]
    k_globals: tuple[tuple[int, int], ...]


# A run is `(local_start, global_start, size)`: `size` tokens, local and global indices both contiguous. A task's
# rows (columns) are one or two runs adjacent in local memory; global positions increase from run to run.


def _band(q_run, k_run, rule: _Rule, nlo: float, nhi: float, dl: int):
    """The visible set of a run pair as a closed interval of `x = kk - qq` (local offsets in the pair), or None.

    Args:
        q_run, k_run: the runs.
        rule, nlo, nhi, dl: with `rule`, use the global positions; otherwise the native band `[nlo, nhi]` on
            `x + dl` (`dl` = the pair's offset in the task's local coordinates, alignment shift included).
    """
    _, qg, n = q_run
    _, kg, m = k_run
    if rule is not None:
        d = kg - (qg + rule.shift)
        a, b = rule.lo - d, rule.hi - d
    else:
        a, b = nlo - dl, nhi - dl
    a, b = max(a, -(n - 1)), min(b, m - 1)
    return (int(a), int(b)) if a <= b else None


def _trim(q_runs, k_runs, rule: _Rule):
    """Drop the key columns at the two ends of `k_runs` that no query of `q_runs` sees (None: nothing visible)."""
    seen = []  # per key run: (first, last) visible offset within the run, over all query runs, or None
    for _, kg, m in k_runs:
        first, last = m, -1
        for _, qg, n in q_runs:
            qa = qg + rule.shift
            f = max(kg, qa + rule.lo) if math.isfinite(rule.lo) else kg
            l = min(kg + m - 1, qa + n - 1 + rule.hi) if math.isfinite(rule.hi) else kg + m - 1
            if f <= l:
                first, last = min(first, int(f - kg)), max(last, int(l - kg))
        seen.append((first, last) if last >= 0 else None)
    keep = [j for j, v in enumerate(seen) if v is not None]
    if not keep:
        return None
    runs = list(k_runs[keep[0] : keep[-1] + 1])
    (kl, kg, m), first = runs[0], seen[keep[0]][0]
    runs[0] = (kl + first, kg + first, m - first)
    (kl, kg, m), last = runs[-1], seen[keep[-1]][1]
    cut = first if len(runs) == 1 else 0  # the run's start moved already
    runs[-1] = (kl, kg, last - cut + 1)
    return tuple(runs)


def _native_candidates(q_runs, k_runs, rule: _Rule, allow_bottom_right: bool):
    """`(is_causal, window, alignment)` forms of `attnlib.attention` that may reproduce the rule on the block."""
    n_tot = sum(r[2] for r in q_runs)
    m_tot = sum(r[2] for r in k_runs)
    big = n_tot + m_tot
    q0, k0 = q_runs[0][0], k_runs[0][0]
    out = []
    for alignment in ("top_left", "bottom_right") if allow_bottom_right else ("top_left",):
        sh = 0 if alignment == "top_left" else m_tot - n_tot
        for ql, qg, n in q_runs:
            for kl, kg, m in k_runs:
                d = kg - (qg + rule.shift)
                dl = (kl - k0) - (ql - q0) - sh
                nlo, nhi = rule.lo - d + dl, rule.hi - d + dl  # the pair's band in native coordinates
                for lo_opt in {nlo, -math.inf}:
                    for hi_opt in {nhi, math.inf}:
                        left = None if lo_opt == -math.inf else -lo_opt
                        right = None if hi_opt == math.inf else hi_opt
                        if (left is not None and left < 0) or (right is not None and right < 0):
                            continue
                        is_causal = right == 0
                        window = None
                        if not (left is None and right in (None, 0)):
                            window = (int(big if left is None else left), int(big if right is None else right))
                        out.append((is_causal, window, alignment))
    # prefer plain causal, then top-left, then narrower descriptions
    return sorted(set(out), key=lambda c: (c[1] is not None, c[2] != "top_left", str(c)))


def _native_bounds(is_causal, window):
    nlo = -window[0] if window is not None else -math.inf
    nhi = window[1] if window is not None else math.inf
    return nlo, (min(nhi, 0) if is_causal else nhi)


def _form(q_runs, k_runs, rule: _Rule, allow_bottom_right: bool):
    """"full", a native `(is_causal, window, alignment)`, or None when the block needs an explicit mask."""
    pairs = [(qr, kr) for qr in q_runs for kr in k_runs]
    exact = [_band(qr, kr, rule, 0, 0, 0) for qr, kr in pairs]
    if all(e == (-(qr[2] - 1), kr[2] - 1) for e, (qr, kr) in zip(exact, pairs, strict=True)):
        return "full"
    n_tot = sum(r[2] for r in q_runs)
    m_tot = sum(r[2] for r in k_runs)
    q0, k0 = q_runs[0][0], k_runs[0][0]
    for cand in _native_candidates(q_runs, k_runs, rule, allow_bottom_right):
        is_causal, window, alignment = cand
        sh = 0 if alignment == "top_left" else m_tot - n_tot
        nlo, nhi = _native_bounds(is_causal, window)
        if all(
            _band(qr, kr, None, nlo, nhi, (kr[0] - k0) - (qr[0] - q0) - sh) == e
            for e, (qr, kr) in zip(exact, pairs, strict=True)
        ):
            return cand
    return None


def _make_task(q_runs, k_runs, form) -> _Placed:
    q_start, k_start = q_runs[0][0], k_runs[0][0]
    q_size, k_size = sum(r[2] for r in q_runs), sum(r[2] for r in k_runs)
    if form == "full":
        task = _Task(q_start, q_size, k_start, k_size, "full")
    elif form is None or form == "mask":
        task = _Task(q_start, q_size, k_start, k_size, "mask")
    else:
        task = _Task(q_start, q_size, k_start, k_size, "native", *form)
    return _Placed(task, tuple((g, n) for _, g, n in q_runs), tuple((g, m) for _, g, m in k_runs))


def _device_tasks(q_layout, k_layout, shard, block, rule, allow_bottom_right, segments) -> tuple[_Placed, ...]:
    """Tasks of device `shard` when it holds key/value block `block`.

    Per query run: its visible key runs in one call when that block is fully visible or native (or, with segment
    ids, one mask call), else one call per (query run, key run) pair (fully visible, native, or an explicit mask),
    key columns that no query sees trimmed off. Then all query runs in a single call instead, when that is fully
    visible or native (or masked, with segments) and computes no more score entries than the per-run calls: the
    plan minimises computed entries first (right on every implementation), calls second.
    """
    q_all, k_all = q_layout.chunks(shard), k_layout.chunks(block)
    visible = {
        (i, j): _band(qr, kr, rule, 0, 0, 0) is not None for i, qr in enumerate(q_all) for j, kr in enumerate(k_all)
    }
    fine: list[_Placed] = []
    for i, qr in enumerate(q_all):
        kr_vis = tuple(kr for j, kr in enumerate(k_all) if visible[i, j])
        if not kr_vis:
            continue
        ks = _trim((qr,), kr_vis, rule)
        form = "mask" if segments else _form((qr,), ks, rule, allow_bottom_right)
        if form is not None:
            fine.append(_make_task((qr,), ks, form))
            continue
        for kr in kr_vis:
            ks = _trim((qr,), (kr,), rule)
            fine.append(_make_task((qr,), ks, _form((qr,), ks, rule, allow_bottom_right)))
    if not fine:
        return ()
    qs = tuple(qr for i, qr in enumerate(q_all) if any(visible[i, j] for j in range(len(k_all))))
    if len(qs) > 1:
        ks = _trim(qs, k_all, rule)
        form = "mask" if segments else _form(qs, ks, rule, allow_bottom_right)
        area = lambda t: t.task.q_size * t.task.k_size
        if form is not None:
            coarse = _make_task(qs, ks, form)
            if area(coarse) <= sum(area(t) for t in fine):
                return (coarse,)
    return tuple(fine)


@dataclasses.dataclass(frozen=True)
class _StepPlan:
    """The branches of one step and which branch each device takes."""

    branches: tuple[tuple[_Task, ...], ...]
    branch_of: tuple[int, ...]  # per device
    q_globals: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]  # per device, per task
    k_globals: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]  # per device, per task

    @property
    def empty(self) -> bool:
        return all(len(b) == 0 for b in self.branches)


def _step_plan(per_device: Sequence[tuple[_Placed, ...]]) -> _StepPlan:
    branches: list[tuple[_Task, ...]] = []
    branch_of = []
    signatures: list[tuple] = []
    for placed in per_device:
        # devices share a branch when their calls have the same static shapes and flags
        sig = tuple((p.task, tuple(n for _, n in p.q_globals), tuple(m for _, m in p.k_globals)) for p in placed)
        if sig not in signatures:
            signatures.append(sig)
            branches.append(tuple(p.task for p in placed))
        branch_of.append(signatures.index(sig))
    return _StepPlan(
        tuple(branches),
        tuple(branch_of),
        tuple(tuple(p.q_globals for p in placed) for placed in per_device),
        tuple(tuple(p.k_globals for p in placed) for placed in per_device),
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    steps: tuple[int, ...]  # ring offsets visited (all_gather: (0,))
    step_plans: tuple[_StepPlan, ...]


def _make_plan(strategy, D, q_layout, k_layout, rule, allow_bottom_right, segments) -> _Plan:
    if strategy == "all_gather":
        gathered = _Layout(1, k_layout.local_len * D, False)
        per_device = [
            _device_tasks(q_layout, gathered, r, 0, rule, allow_bottom_right, segments) for r in range(D)
        ]
        return _Plan((0,), (_step_plan(per_device),))
    steps, plans = [], []
    for idx in range(D):
        per_device = [
            _device_tasks(q_layout, k_layout, r, (r - idx) % D, rule, allow_bottom_right, segments)
            for r in range(D)
        ]
        sp = _step_plan(per_device)
        if not sp.empty:
            steps.append(idx)
            plans.append(sp)
    return _Plan(tuple(steps), tuple(plans))


# ----------------------------------------------------------------------------------------------------------------
# Runtime


@dataclasses.dataclass(frozen=True)
class _Options:
    """Static options of one call (hashable: a `custom_vjp` non-differentiable argument)."""

    axis_name: Any
    num_shards: int
    rule: _Rule
    forwarded: tuple[tuple[str, Any], ...]
    plan: _Plan


def _merge(o, lse, o_i, lse_i):
    """Exact merge of two partial softmax results; rows empty in both stay `(0, -inf)`; NaN-free gradients."""
    m = jnp.maximum(lse, lse_i)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    a = jnp.exp(lse - m_safe)
    b = jnp.exp(lse_i - m_safe)
    total = a + b
    has = total > 0
    total_safe = jnp.where(has, total, 1.0)
    o_new = (a[..., None] * o + b[..., None] * o_i) / total_safe[..., None]
    lse_new = jnp.where(has, m_safe + jnp.log(total_safe), -jnp.inf)
    return o_new, lse_new


def _add_sinks(o, lse, sinks):
    """The final merge with the sink logit (one extra denominator term with no value)."""
    s = jnp.broadcast_to(sinks.astype(jnp.float32)[None, None, :], lse.shape)
    return _merge(o, lse, jnp.zeros_like(o), s)


def _take(table, index):
    return jnp.asarray(np.asarray(table, np.int32))[index]


def _task_call(opts: _Options, task: _Task, qt, kt, vt, aux, q_pos, k_pos):
    """Run one task: `(out [B, n, N, Hv], lse [B, n, N])` of `attnlib.attention` on the sub-block."""
    kwargs = dict(opts.forwarded)
    rule = opts.rule
    q_len, kv_len = aux.get("q_len"), aux.get("kv_len")
    if task.kind == "mask":
        offset = k_pos[None, :] - (q_pos[:, None] + jnp.int32(rule.shift))
        allowed = jnp.ones(offset.shape, bool)
        if math.isfinite(rule.lo):
            allowed &= offset >= jnp.int32(rule.lo)
        if math.isfinite(rule.hi):
            allowed &= offset <= jnp.int32(rule.hi)
        allowed = allowed[None]  # [1, n, m]
        if q_len is not None:
            allowed = allowed & (q_pos[None, :] < q_len[:, None])[:, :, None]
        if kv_len is not None:
            allowed = allowed & (k_pos[None, :] < kv_len[:, None])[:, None, :]
        q_seg = aux.get("q_seg")
        if q_seg is not None:
            qs = jax.lax.dynamic_slice_in_dim(q_seg, task.q_start, task.q_size, axis=1)
            ks = jax.lax.dynamic_slice_in_dim(aux["kv_seg"], task.k_start, task.k_size, axis=1)
            allowed = allowed & ((qs[:, :, None] != 0) & (qs[:, :, None] == ks[:, None, :]))
        return _attention(qt, kt, vt, mask=allowed[:, None], return_residual=True, **kwargs)
    if q_len is not None:
        kwargs["query_seq_lengths"] = jnp.sum(
            (q_pos[None, :] < q_len[:, None]).astype(jnp.int32), axis=1
        )
    if kv_len is not None:
        kwargs["key_value_seq_lengths"] = jnp.sum(
            (k_pos[None, :] < kv_len[:, None]).astype(jnp.int32), axis=1
        )
    if task.kind == "native":
        kwargs.update(
            is_causal=task.is_causal, local_window_size=task.window, diagonal_alignment=task.alignment
        )
    return _attention(qt, kt, vt, return_residual=True, **kwargs)


def _slices(task, q, k, v):
    qt = q[:, task.q_start : task.q_start + task.q_size]
    kt = k[:, task.k_start : task.k_start + task.k_size]
    vt = v[:, task.k_start : task.k_start + task.k_size]
    return qt, kt, vt


def _run_positions(tables, index):
    """int32 global positions of concatenated runs; `tables[r]` = the runs `((start, size), ...)` of device r."""
    sizes = [n for _, n in next(t for t in tables if t is not None)]
    parts = []
    for j, n in enumerate(sizes):
        start = _take([0 if t is None else t[j][0] for t in tables], index)
        parts.append(start + jnp.arange(n, dtype=jnp.int32))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _task_positions(sp: _StepPlan, b: int, i: int, index):
    """Global positions of the rows and columns of task `i` of branch `b` on the running device.

    The starts come from per-device tables indexed by `index` (devices on other branches hold unused zeros).
    """
    on_b = [sp.branch_of[r] == b for r in range(len(sp.branch_of))]
    q_pos = _run_positions([sp.q_globals[r][i] if on_b[r] else None for r in range(len(on_b))], index)
    k_pos = _run_positions([sp.k_globals[r][i] if on_b[r] else None for r in range(len(on_b))], index)
    return q_pos, k_pos


def _step_forward(opts: _Options, sp: _StepPlan, index, q, k, v, aux, o, lse):
    """Merge this step's partial results into the running `(o, lse)` (float32, local query rows)."""

    def branch(b, q, k, v, aux, o, lse):
        for i, task in enumerate(sp.branches[b]):
            q_pos, k_pos = _task_positions(sp, b, i, index)
            o_i, lse_i = _task_call(opts, task, *_slices(task, q, k, v), aux, q_pos, k_pos)
            rows = slice(task.q_start, task.q_start + task.q_size)
            o_r, lse_r = _merge(o[:, rows], lse[:, rows], o_i.astype(jnp.float32), lse_i)
            o = o.at[:, rows].set(o_r)
            lse = lse.at[:, rows].set(lse_r)
        return o, lse

    if len(sp.branches) == 1:
        return branch(0, q, k, v, aux, o, lse)
    fns = [functools.partial(branch, b) for b in range(len(sp.branches))]
    return jax.lax.switch(_take(sp.branch_of, index), fns, q, k, v, aux, o, lse)


def _step_backward(opts: _Options, sp: _StepPlan, index, q, k, v, aux, O, L, dO, dL, dq, dk, dv):
    """Add this step's gradient contributions, recomputing each task's `(out_i, lse_i)`.

    With the global `O`, `L` (sinks included), the step's cotangents are `d out_i = w_i dO` and
    `d lse_i = w_i (dO . (out_i - O) + dL)` with `w_i = exp(lse_i - L)` (0 where `L = -inf`).
    """

    def branch(b, q, k, v, aux, O, L, dO, dL, dq, dk, dv):
        for i, task in enumerate(sp.branches[b]):
            q_pos, k_pos = _task_positions(sp, b, i, index)
            rows = slice(task.q_start, task.q_start + task.q_size)
            cols = slice(task.k_start, task.k_start + task.k_size)
            fn = lambda qt, kt, vt: _task_call(opts, task, qt, kt, vt, aux, q_pos, k_pos)  # noqa: B023
            (o_i, lse_i), vjp = jax.vjp(fn, *_slices(task, q, k, v))
            L_r = L[:, rows]
            w = jnp.exp(lse_i - jnp.where(jnp.isfinite(L_r), L_r, 0.0))
            dO_r = dO[:, rows]
            d_o = (w[..., None] * dO_r).astype(o_i.dtype)
            d_lse = w * (jnp.sum(dO_r * (o_i.astype(jnp.float32) - O[:, rows]), axis=-1) + dL[:, rows])
            dqt, dkt, dvt = vjp(match((d_o, d_lse), (o_i, lse_i)))
            dq = dq.at[:, rows].add(dqt.astype(jnp.float32))
            dk = dk.at[:, cols].add(dkt.astype(jnp.float32))
            dv = dv.at[:, cols].add(dvt.astype(jnp.float32))
        return dq, dk, dv

    operands = (q, k, v, aux, O, L, dO, dL, dq, dk, dv)
    if len(sp.branches) == 1:
        return branch(0, *operands)
    fns = [functools.partial(branch, b) for b in range(len(sp.branches))]
    return jax.lax.switch(_take(sp.branch_of, index), fns, *operands)


def _shift(x, delta: int, opts: _Options):
    """Send every device's `x` to device `index + delta` (mod D)."""
    D = opts.num_shards
    perm = [(i, (i + delta) % D) for i in range(D)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, opts.axis_name, perm), x)


def _vma(*trees, axis_name) -> tuple:
    """The mesh axes the arrays of `trees` vary over, plus `axis_name`."""
    names = set(axis_name) if isinstance(axis_name, tuple) else {axis_name}
    for leaf in jax.tree.leaves(trees):
        names |= varying_axes(leaf) or set()
    return tuple(sorted(names, key=str))


def _varying(x, names: tuple):
    """`x` typed as varying over `names`, so states of steps and switch branches that skip all work keep one type."""
    return vary_over(x, names)


def _initial_state(q, v, names):
    B, T, N, _ = q.shape
    o = jnp.zeros((B, T, N, v.shape[-1]), jnp.float32)
    lse = jnp.full((B, T, N), -jnp.inf, jnp.float32)
    return _varying(o, names), _varying(lse, names)


def _ring_forward(opts: _Options, q, k, v, sinks, aux):
    index = jax.lax.axis_index(opts.axis_name)
    o, lse = _initial_state(q, v, _vma(q, k, v, aux, axis_name=opts.axis_name))
    steps = opts.plan.steps
    block = (k, v, aux.get("kv_seg"))
    for s, idx in enumerate(steps):
        nxt = _shift(block, steps[s + 1] - idx, opts) if s + 1 < len(steps) else None  # issued before compute
        step_aux = {**aux, "kv_seg": block[2]}
        o, lse = _step_forward(opts, opts.plan.step_plans[s], index, q, block[0], block[1], step_aux, o, lse)
        block = nxt
    if sinks is not None:
        o, lse = _add_sinks(o, lse, sinks)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(opts: _Options, q, k, v, sinks, aux):
    o, lse = _ring_forward(opts, q, k, v, sinks, aux)
    return o.astype(q.dtype), lse


def _ring_fwd(opts, q, k, v, sinks, aux):
    o, lse = _ring_forward(opts, q, k, v, sinks, aux)
    # Residuals are local: this device's queries, key/value block, output and lse (O(S / D) memory).
    return (o.astype(q.dtype), lse), (q, k, v, sinks, aux, o, lse)


def _ring_bwd(opts, residuals, cotangents):
    q, k, v, sinks, aux, O, L = residuals
    dO, dL = cotangents
    dO = dO.astype(jnp.float32)
    dL = dL.astype(jnp.float32)
    index = jax.lax.axis_index(opts.axis_name)
    names = _vma(q, k, v, aux, O, L, dO, dL, axis_name=opts.axis_name)
    dq = _varying(jnp.zeros(q.shape, jnp.float32), names)
    steps = opts.plan.steps
    block = (k, v, aux.get("kv_seg"))
    grads = (_varying(jnp.zeros(k.shape, jnp.float32), names), _varying(jnp.zeros(v.shape, jnp.float32), names))
    for s, idx in enumerate(steps):
        last = s + 1 == len(steps)
        nxt = None if last else _shift(block, steps[s + 1] - idx, opts)  # issued before compute
        step_aux = {**aux, "kv_seg": block[2]}
        dq, dk, dv = _step_backward(
            opts, opts.plan.step_plans[s], index, q, block[0], block[1], step_aux, O, L, dO, dL, dq, *grads
        )
        # dK/dV accumulators travel with their block ...
        grads = (dk, dv) if last else _shift((dk, dv), steps[s + 1] - idx, opts)
        block = nxt
    # ... and go home after the last step (the block held at offset `idx` belongs to device index - idx).
    if steps and steps[-1] % opts.num_shards:
        grads = _shift(grads, (opts.num_shards - steps[-1]) % opts.num_shards, opts)
    d_sinks = None
    if sinks is not None:
        s_f = sinks.astype(jnp.float32)[None, None, :]
        p_sink = jnp.exp(s_f - jnp.where(jnp.isfinite(L), L, jnp.inf))
        local = jnp.sum(p_sink * (dL - jnp.sum(dO * O, axis=-1)), axis=(0, 1))
        # the replicated sinks get the sum over every mesh axis their cotangent varies over (sequence, batch, ...)
        have, want = varying_axes(local), varying_axes(sinks)
        axes = (opts.axis_name,) if have is None or want is None else tuple(sorted(have - want, key=str))
        d_sinks = (jax.lax.psum(local, axes) if axes else local).astype(sinks.dtype)
    return dq.astype(q.dtype), grads[0].astype(k.dtype), grads[1].astype(v.dtype), d_sinks, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def _all_gather(opts: _Options, q, k, v, sinks, aux, load_balanced: bool):
    D = opts.num_shards
    gather = lambda x: jax.lax.all_gather(x, opts.axis_name, axis=1, tiled=True)
    k_all, v_all = gather(k), gather(v)
    kv_seg = aux.get("kv_seg")
    kv_seg_all = None if kv_seg is None else gather(kv_seg)
    if load_balanced:
        k_all, v_all = restore(k_all, D, axis=1), restore(v_all, D, axis=1)
        kv_seg_all = None if kv_seg_all is None else restore(kv_seg_all, D, axis=1)
    index = jax.lax.axis_index(opts.axis_name)
    o, lse = _initial_state(q, v, _vma(q, k_all, v_all, aux, axis_name=opts.axis_name))
    o, lse = _step_forward(
        opts, opts.plan.step_plans[0], index, q, k_all, v_all, {**aux, "kv_seg": kv_seg_all}, o, lse
    )
    if sinks is not None:
        o, lse = _add_sinks(o, lse, sinks)
    return o.astype(q.dtype), lse


# ----------------------------------------------------------------------------------------------------------------
# Public entry point


def _window(local_window_size: Any) -> tuple[int, int] | None:
    is_count = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0
    if local_window_size is None:
        return None
    if is_count(local_window_size):
        return int(local_window_size), int(local_window_size)
    if isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 and all(
        is_count(x) for x in local_window_size
    ):
        return int(local_window_size[0]), int(local_window_size[1])
    raise ValueError(
        "`local_window_size` must be a non-negative int or a pair (left, right) of non-negative ints. "
        f"Got {local_window_size!r}."
    )


def _int_array(name: str, x: Any, shape: tuple[int, ...], meaning: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype. Got {name}.dtype={x.dtype}.")
    if tuple(x.shape) != shape:
        raise ValueError(f"`{name}` must have shape {meaning}={shape}. Got {name}.shape={tuple(x.shape)}.")
    return x.astype(jnp.int32)


def attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    axis_name: Any,
    strategy: str = "ring",
    load_balanced: bool = True,
    **attention_kwargs: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    r"""`attnlib.attention` over a sequence sharded across the mesh axis `axis_name`; call inside `shard_map`.

    Each device holds `T_l = T / D` query tokens and `S_l = S / D` key/value tokens of every sequence (`D` =
    size of `axis_name`): contiguous shards with `load_balanced=False`, the order of `reorder` with
    `load_balanced=True`. The result on each device is its rows of `attnlib.attention` on the whole sequence
    (in the same layout), forward and backward.

    Shapes (local, per device): `B` batch, `T_l` local query length, `S_l` local key/value length, `N` query
    heads, `K` key/value heads, `H` query/key head dim, `Hv` value head dim.

    Args:
        query: `[*B, T_l, N, H]`.
        key: `[*B, S_l, K, H]`.
        value: `[*B, S_l, K, Hv]`.
        axis_name: the `shard_map` mesh axis the sequence axis is sharded over.
        strategy: `"ring"` (key/value blocks circulate with `ppermute`; memory O(S / D) per device, forward and
            backward) or `"all_gather"` (keys/values gathered once; memory O(S)). Defaults to `"ring"`.
        load_balanced: the tokens are laid out with `reorder` (device `r` holds chunks `r` and `2D - 1 - r`), so
            causal work is equal on every device. Needs `T_l` and `S_l` even. Defaults to True.
        **attention_kwargs: options of `attnlib.attention`, with *global* meaning: `scale`, `is_causal`,
            `local_window_size`, `diagonal_alignment` (`"bottom_right"` only without lengths or segment ids),
            `query_seq_lengths` / `key_value_seq_lengths` (int `[*B]`, global valid lengths, replicated),
            `q_segment_ids` `[*B, T_l]` / `kv_segment_ids` `[*B, S_l]` (global ids, sharded like the tokens),
            `max_segments_per_row` (accepted; unused since segment steps use a mask), `logits_soft_cap`,
            `sinks` `[N]` (replicated), `implementation`, `return_residual`, `deterministic_backward`.

    Returns:
        `out` `[*B, T_l, N, Hv]` in `query.dtype`; with `return_residual=True`, `(out, lse)` with the global
        float32 `lse` `[*B, T_l, N]` (differentiable).

    Raises:
        ValueError: a shape or value is invalid (names the argument and shows what was given), or `axis_name` is
            not a mesh axis bound by `shard_map`.
        TypeError: an unknown option or a non-integer segment id / length array.
        NotImplementedError: an option context parallelism cannot serve yet (`bias`, `mask`, dropout, THD
            `cu_seqlens_*`, `page_table`, `score_mod` / `mask_mod`, `diagonal_alignment="bottom_right"` with
            lengths or segment ids).

    !!! Example
        ```python
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("sp",))
        spec = jax.sharding.PartitionSpec(None, "sp")
        f = jax.shard_map(
            lambda q, k, v: attnlib.context_parallel.attention(q, k, v, axis_name="sp", is_causal=True),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
        )
        out = attnlib.context_parallel.restore(
            f(*(attnlib.context_parallel.reorder(x, 8) for x in (q, k, v))), 8
        )
        ```
    """
    with jax.named_scope("attnlib.context_parallel.attention"):
        return _attention_impl(query, key, value, axis_name, strategy, load_balanced, attention_kwargs)


def _attention_impl(query, key, value, axis_name, strategy, load_balanced, kwargs):
    for name in _UNSUPPORTED_MODIFIERS:
        given = kwargs.get(name)
        if given is not None and not (isinstance(given, (tuple, list)) and len(given) == 0):
            raise NotImplementedError(
                f"context parallelism does not support `{name}` yet: `score_mod` / `mask_mod` would see "
                "shard-local positions and blocks, not the global sequence. Use `attnlib.attention` on the whole "
                "sequence, or the built-in masks (`is_causal`, `local_window_size`, segment ids)."
            )
    for name in kwargs:
        if name in _UNSUPPORTED_MODIFIERS:
            continue
        if name not in _FORWARDED and name not in _HANDLED and name not in _UNSUPPORTED:
            raise TypeError(f"`attnlib.context_parallel.attention` got an unexpected keyword argument `{name}`.")
    for name, why in _UNSUPPORTED.items():
        value_ = kwargs.get(name)
        if value_ is not None and not (name == "dropout_rate" and value_ == 0):
            raise NotImplementedError(f"context parallelism does not support `{name}` yet: {why}.")
    if getattr(query, "dtype", None) == jnp.float64:
        raise NotImplementedError(
            "context parallelism does not support float64 inputs yet (it merges partial results in float32); use "
            "attnlib.attention on the whole sequence."
        )
    if strategy not in _STRATEGIES:
        raise ValueError(f"`strategy` must be one of {list(_STRATEGIES)}. Got {strategy!r}.")
    if not isinstance(load_balanced, (bool, np.bool_)):
        raise TypeError(f"`load_balanced` must be a Python bool. Got {load_balanced!r}.")
    is_causal = kwargs.get("is_causal", False)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"`is_causal` must be a Python bool. Got {is_causal!r}.")
    return_residual = bool(kwargs.get("return_residual", False))
    try:
        D = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"`axis_name` must name a mesh axis bound by the enclosing `shard_map`. Got axis_name={axis_name!r}."
        ) from None

    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "`query`, `key` and `value` must be `[*B, T_l, N, H]`, `[*B, S_l, K, H]`, `[*B, S_l, K, Hv]` with the "
            f"same rank >= 3. Got query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}."
        )
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape or key.shape[-3] != value.shape[-3]:
        raise ValueError(
            "`query`, `key` and `value` must share the batch dims and `key`, `value` the sequence length. "
            f"Got query.shape={query.shape}, key.shape={key.shape}, value.shape={value.shape}."
        )
    T_l, S_l = query.shape[-3], key.shape[-3]
    if load_balanced and (T_l % 2 or S_l % 2):
        raise ValueError(
            "With `load_balanced=True` each device holds two equal chunks, so the local query and key lengths "
            f"must be even. Got query.shape={query.shape}, key.shape={key.shape} (local)."
        )
    T, S = T_l * D, S_l * D
    B = math.prod(batch_shape)
    flat = lambda x: jnp.reshape(x, (B,) + x.shape[len(batch_shape) :])

    # Non-differentiable per-call arrays: `q_seg [B, T_l]`, `kv_seg [B, S_l]`, `q_len [B]`, `kv_len [B]`.
    aux: dict[str, jax.Array] = {}
    for name, meaning in (("query_seq_lengths", "q_len"), ("key_value_seq_lengths", "kv_len")):
        if kwargs.get(name) is not None:
            aux[meaning] = jnp.reshape(_int_array(name, kwargs[name], batch_shape, "[*B]"), (B,))
    q_seg = kwargs.get("q_segment_ids")
    kv_seg = kwargs.get("kv_segment_ids")
    if kv_seg is not None and q_seg is None:
        raise ValueError("`kv_segment_ids` requires `q_segment_ids`. Got q_segment_ids=None.")
    if q_seg is not None:
        aux["q_seg"] = flat(_int_array("q_segment_ids", q_seg, batch_shape + (T_l,), "[*B, T_l]"))
        if kv_seg is None:
            if T_l != S_l:
                raise ValueError(
                    "Without `kv_segment_ids`, keys reuse `q_segment_ids`, so S must equal T. "
                    f"Got T_l={T_l}, S_l={S_l} (local)."
                )
            aux["kv_seg"] = aux["q_seg"]
        else:
            aux["kv_seg"] = flat(_int_array("kv_segment_ids", kv_seg, batch_shape + (S_l,), "[*B, S_l]"))
    sinks = kwargs.get("sinks")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (query.shape[-2],):
            raise ValueError(
                f"`sinks` must have shape [N]=({query.shape[-2]},). Got sinks.shape={tuple(sinks.shape)}."
            )
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"`sinks` must have a floating dtype. Got sinks.dtype={sinks.dtype}.")

    alignment = kwargs.get("diagonal_alignment", "top_left")
    if alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"`diagonal_alignment` must be 'top_left' or 'bottom_right'. Got {alignment!r}.")
    dynamic_rows = q_seg is not None or "q_len" in aux or "kv_len" in aux
    if alignment == "bottom_right" and dynamic_rows and (is_causal or kwargs.get("local_window_size") is not None):
        raise NotImplementedError(
            'context parallelism does not support `diagonal_alignment="bottom_right"` together with '
            "`query_seq_lengths`, `key_value_seq_lengths` or segment ids yet: the diagonal would depend on "
            "per-sequence lengths across shards."
        )
    window = _window(kwargs.get("local_window_size"))
    lo = -window[0] if window is not None else -math.inf
    hi = window[1] if window is not None else math.inf
    if is_causal:
        hi = min(hi, 0)
    rule = _Rule(lo, hi, (S - T) if alignment == "bottom_right" else 0)

    q_layout = _Layout(D, T_l, bool(load_balanced))
    k_layout = _Layout(D, S_l, bool(load_balanced))
    plan = _make_plan(
        strategy, D, q_layout, k_layout, rule, allow_bottom_right=not dynamic_rows, segments=q_seg is not None
    )
    forwarded = tuple((name, kwargs[name]) for name in _FORWARDED if kwargs.get(name) is not None)
    if "implementation" in dict(forwarded) and not isinstance(dict(forwarded)["implementation"], str):
        forwarded = tuple((n, tuple(x) if n == "implementation" else x) for n, x in forwarded)
    opts = _Options(axis_name, D, rule, forwarded, plan)

    q, k, v = flat(query), flat(key), flat(value)
    if strategy == "ring":
        out, lse = _ring(opts, q, k, v, sinks, aux)
    else:
        out, lse = _all_gather(opts, q, k, v, sinks, aux, bool(load_balanced))
    out = jnp.reshape(out, batch_shape + out.shape[1:])
    if return_residual:
        return out, jnp.reshape(lse, batch_shape + lse.shape[1:])
    return out
