"""Context parallelism: the plan. Interval arithmetic on chunks of global positions turns every (ring step, device)
into a few `attnlib.attention` calls on sub-blocks (see the package docstring)."""

import dataclasses
from collections.abc import Sequence

from ..band import Band


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
    """Which global keys each global query sees: `band` on the whole call, `q_len` queries by `kv_len` keys."""

    band: Band
    q_len: int
    kv_len: int

    def on(self, q_run, k_run) -> Band:
        """The band on a pair of runs, aligned top-left on the pair (its row `i` is the query run's `i`-th token)."""
        return self.band.block(q_run[1], k_run[1], self.q_len, self.kv_len)


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


def _visible(q_run, k_run, rule: _Rule):
    """The visible set of a run pair as a closed interval of `x = kk - qq` (local offsets in the pair), or None."""
    return rule.on(q_run, k_run).visible_offsets(q_run[2], k_run[2])


def _trim(q_runs, k_runs, rule: _Rule):
    """Drop the key columns at the two ends of `k_runs` that no query of `q_runs` sees (None: nothing visible)."""
    seen = []  # per key run: (first, last) visible offset within the run, over all query runs, or None
    for k_run in k_runs:
        keys = [rule.on(q_run, k_run).visible_keys(q_run[2], k_run[2]) for q_run in q_runs]
        keys = [k for k in keys if k is not None]
        seen.append((min(f for f, _ in keys), max(l for _, l in keys)) if keys else None)
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
    q0, k0 = q_runs[0][0], k_runs[0][0]
    out = []
    for bottom_right in (False, True) if allow_bottom_right else (False,):
        for q_run in q_runs:
            for k_run in k_runs:
                # the rule on the pair, as a band of the whole block with this alignment
                pair = rule.on(q_run, k_run).around(q_run[0] - q0, k_run[0] - k0, n_tot, m_tot, bottom_right)
                for left in {pair.left, None}:
                    for right in {pair.right, None}:
                        flags = Band(left, right, bottom_right).flags(unbounded=n_tot + m_tot)
                        if flags is not None:
                            out.append(flags)
    # prefer plain causal, then top-left, then narrower descriptions
    return sorted(set(out), key=lambda c: (c[1] is not None, c[2] != "top_left", str(c)))


def _form(q_runs, k_runs, rule: _Rule, allow_bottom_right: bool):
    """"full", a native `(is_causal, window, alignment)`, or None when the block needs an explicit mask."""
    pairs = [(qr, kr) for qr in q_runs for kr in k_runs]
    exact = [_visible(qr, kr, rule) for qr, kr in pairs]
    if all(e == (-(qr[2] - 1), kr[2] - 1) for e, (qr, kr) in zip(exact, pairs, strict=True)):
        return "full"
    n_tot = sum(r[2] for r in q_runs)
    m_tot = sum(r[2] for r in k_runs)
    q0, k0 = q_runs[0][0], k_runs[0][0]
    for cand in _native_candidates(q_runs, k_runs, rule, allow_bottom_right):
        is_causal, window, alignment = cand
        native = Band.from_flags(is_causal=is_causal, window=window, diagonal_alignment=alignment)
        if all(
            native.block(qr[0] - q0, kr[0] - k0, n_tot, m_tot).visible_offsets(qr[2], kr[2]) == e
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
        (i, j): _visible(qr, kr, rule) is not None for i, qr in enumerate(q_all) for j, kr in enumerate(k_all)
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
