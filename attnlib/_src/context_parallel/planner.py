"""Context parallelism: the plan. Interval arithmetic on chunks of global positions turns every (ring step, device)
into a few `attnlib.attention` calls on sub-blocks (see the package docstring)."""

import dataclasses
import math
from collections.abc import Sequence


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
