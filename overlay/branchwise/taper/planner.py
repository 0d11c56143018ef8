"""TAPER's per-step planner (Algorithm 1): a decode batch in (`ArrayBatch`), widths out (`StepPlan`).

`plan_step` is the budget rule's plan: every request's protected row runs, even over budget; then
rows are admitted greedily by marginal utility per marginal predicted latency while T(S) <= budget,
each request offering only its next ready row. It takes one sort, one cumulative sum and one binary
search per step (no per-candidate objects), and stops at the first row that does not fit, which
keeps the plan monotone in the budget (`fill=True`: Algorithm 1's pruning rule exactly). Its
options are the policies' extras: pinned widths (taper-no-replan), row floors and a deferral price
(taper's terms, policies.py). The static policies (serial, cap:K, eager) plan with `plan_capped`: a
fixed width per request. Why the sort gives the greedy order and how the stopping rule compares
with Algorithm 1's: docs/design/taper-planner.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from branchwise.taper.predictor import LatencyModel
from branchwise.taper.utility import LINEAR, Utility

# The greedy order is one sort of int64 keys packing (price, row index): the price's float bits
# (order-preserving for floats >= 0) without their low _Q_SHIFT bits, then the row index. A plain
# sort of unique ints is ~3x faster than a stable argsort and breaks ties by row index, so a
# request's rows keep their order. Prices closer than ~2e-10 (relative) count as ties.
_Q_SHIFT = 20
_TINY = 1e-300  # a zero weight makes rows last, not NaN
_ROW_BITS = 20  # < 2^20 rows and requests per step
_Q_BITS = 63 - _ROW_BITS  # price bits: 0x7FF0... (inf) >> 20 < 2^43
_ROW_MASK = (1 << _ROW_BITS) - 1
_ROWS = np.arange(1 << 12, dtype=np.int64)  # 0..4095, sliced for the common batch sizes
_ROWS.flags.writeable = False
# the price of deferring (plan_step): (per step that defers, per deferred row) seconds, or a
# function that computes it on demand
Deferral = tuple[float, float] | Callable[[], tuple[float, float]]


@dataclass(frozen=True, slots=True, eq=False)
class ArrayBatch:
    """One snapshot of the decode batch as flat arrays, built by the step controller from its rows.

    A request (a serial request, or a parallel phase) has one ready row in a serial stage and one
    per ready branch in a phase; its first row is the protected one, the rest are opportunistic
    candidates in the order the hook would admit them.
    """

    rids: Sequence[str]  # n requests (the controller's grouping keys)
    ready: np.ndarray  # int64[n], ready rows per request (>= 1)
    ctx: np.ndarray  # int64[sum(ready)], row context lengths, request-major, protected row first
    slack_s: np.ndarray  # float64[n], residual TPOT slack in seconds (may be negative)
    weight: np.ndarray | None = None  # float64[n], the "priority" utility's weights; None: all 1.0
    phase: np.ndarray | None = None  # bool[n], in a parallel phase; None: none is
    fixed_width: np.ndarray | None = None  # int64[n], 0 = not pinned (taper-no-replan)
    extra_tokens: int = 0  # tokens in the same forward that are not decode rows (mixed prefill)
    slo_s: np.ndarray | None = None  # float64[n], each request's TPOT target; None: unknown (paper rule)
    waiting: int = 0  # requests queued for admission (SGLang's waiting queue): the backlog
    gap_slack_s: np.ndarray | None = None  # float64[n], slack_s read per gap (the paper's serial slack)
    # derived once here, read by every rule of the step (a numpy call costs ~1 us at these sizes)
    starts: np.ndarray = field(init=False, repr=False)  # int64[n], each request's first (protected) row
    protected_ctx: int = field(init=False, repr=False)  # context tokens of the protected rows, S0's

    def __post_init__(self) -> None:
        n = len(self.rids)
        if self.ready.shape != (n,) or self.slack_s.shape != (n,):
            raise ValueError(f"ArrayBatch: ready and slack_s need one entry per request ({n})")
        if n and int(self.ready.min()) < 1:
            raise ValueError("ArrayBatch: every request needs at least one ready row")
        starts = self.ready.cumsum()
        if self.ctx.shape != (int(starts[-1]) if n else 0,):
            raise ValueError("ArrayBatch: ctx needs one entry per ready row (sum of ready)")
        for name in ("weight", "phase", "fixed_width", "slo_s", "gap_slack_s"):
            a = getattr(self, name)
            if a is not None and a.shape != (n,):
                raise ValueError(f"ArrayBatch: {name} needs one entry per request ({n})")
        starts -= self.ready
        starts.flags.writeable = False  # shared by every reader of the batch
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "protected_ctx", int(self.ctx[starts].sum()))


@dataclass(slots=True)
class StepPlan:
    """Rows to run per request (aligned with the batch's rids), plus what the planner predicted."""

    rids: Sequence[str]
    widths: np.ndarray  # int64[n], in [1, ready] for every request
    predicted_s: float = 0.0
    budget_s: float = math.inf
    considered: int = 0  # opportunistic rows the greedy pass priced
    notes: dict[str, float] = field(default_factory=dict)  # protected_s, and the taper terms that applied

    @property
    def rows(self) -> int:
        return int(self.widths.sum())


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.int64)


def _arange(n: int) -> np.ndarray:
    if n <= len(_ROWS):
        return _ROWS[:n]
    if n > _ROW_MASK:
        raise ValueError(f"planner supports < {_ROW_MASK} rows per step, got {n}")
    return np.arange(n, dtype=np.int64)


def plan_capped(a: ArrayBatch, cap: int | None, model: LatencyModel | None) -> StepPlan:
    """The static rule: min(ready, cap) rows per request (cap None: every ready row).
    `model`, if set, only fills predicted_s."""
    w = a.ready if cap is None else np.minimum(a.ready, cap)
    predicted = 0.0
    if model is not None and len(a.rids):
        if cap is None:  # every row (eager)
            rows, ctx = len(a.ctx), int(a.ctx.sum())
        elif cap == 1:  # the protected rows (serial)
            rows, ctx = len(a.rids), a.protected_ctx
        else:
            keep = np.arange(len(a.ctx)) < (a.starts + w).repeat(a.ready)
            rows, ctx = int(w.sum()), int(a.ctx[keep].sum())
        predicted = model.predict(rows, ctx, a.extra_tokens)
    return StepPlan(a.rids, w, predicted)


def plan_step(a: ArrayBatch, model: LatencyModel, budget_s: float, utility: Utility = LINEAR,
              *, pinned: bool = False, fill: bool = False, floor: np.ndarray | None = None,
              deferral: Deferral | None = None) -> StepPlan:
    """Widths per request for one decode step.

    pinned: honour the fixed widths (taper-no-replan): such a request runs exactly
    min(fixed_width, ready) rows, counted in the base cost even over budget, and is not widened.
    floor: int64[n], rows per request that run whatever the budget (>= 1; capped by the ready rows);
    taper's late phases (policies.py). Rows above the floor are admitted as usual.
    deferral: (per step that defers, per deferred row) seconds, the price of deferring (taper's
    deferral-cost term): a plan that defers d rows is predicted at T(its rows) + the first + d x
    the second, so admitting a row saves its cost less the second, and the plan that defers runs
    only when it is predicted shorter than running every ready row. Or a function returning that
    nonzero price, called only when not every ready row fits (most steps never need it).
    """
    if budget_s != budget_s:  # NaN (a broken clock upstream) must not widen anything
        budget_s = -math.inf
    if deferral is not None and not callable(deferral) and not any(deferral):
        deferral = None
    rids = a.rids
    n = len(rids)
    if n == 0:
        return StepPlan(rids, _ones(0), 0.0, budget_s)
    ready, ctx, starts = a.ready, a.ctx, a.starts
    lo = None  # rows per request that run no matter what; None: one (the protected row)
    fixed = a.fixed_width if pinned else None
    if fixed is not None and fixed.any():
        lo = np.where(fixed > 0, np.minimum(fixed, ready), 1)
        cap = np.where(fixed > 0, lo, ready)  # a pinned request is never widened past its width
        seg = _arange(n).repeat(ready)
        ctx = ctx[_arange(len(ctx)) - starts[seg] < cap[seg]]
        ready = cap
        starts = ready.cumsum()
        starts -= ready
    elif floor is not None and bool((floor > 1).any()):
        lo = np.minimum(np.maximum(floor, 1), ready)
    else:
        t0 = model.predict(n, a.protected_ctx, a.extra_tokens)  # T(S0)
        if t0 > budget_s and deferral is None:  # the protected composition alone is over budget: it runs
            return StepPlan(rids, _ones(n), predicted_s=t0, budget_s=budget_s,
                            notes={"protected_s": t0})

    total = len(ctx)
    seg = _arange(n).repeat(ready)  # request index of every row
    pos = _arange(total) - starts[seg] if lo is not None or fill or utility is not LINEAR else None
    cost = model.row_costs(ctx)  # a new float64 array, >= 0: its bits sort like its values
    if lo is None:
        forced = starts
    else:
        forced = (pos < lo[seg]).nonzero()[0]
        t0 = model.predict(0, 0, a.extra_tokens) + float(cost[forced].sum())  # T is separable
        if t0 > budget_s and deferral is None:
            return StepPlan(rids, lo, predicted_s=t0, budget_s=budget_s,
                            notes={"protected_s": t0})
    notes = {"protected_s": t0}
    cost[forced] = 0.0  # in t0 already
    considered = total - len(forced)
    extra_s = float(cost.sum())
    if t0 + extra_s <= budget_s:  # everything ready fits (also taper-no-slack's infinite budget)
        return StepPlan(rids, ready, predicted_s=t0 + extra_s, budget_s=budget_s,
                        considered=considered, notes=notes)
    base = t0
    if deferral is not None:  # every row deferred costs its share; admitting it saves cost - per row
        per_step, per_row = deferral() if callable(deferral) else deferral
        base = t0 + per_step + per_row * considered
        cost = np.maximum(cost - per_row, 0.0)
        cost[forced] = 0.0
        if float(cost.sum()) <= per_step:  # no plan that defers beats running every row: no greedy pass
            notes["defer_cost"] = 1.0
            return StepPlan(rids, ready, predicted_s=t0 + extra_s, budget_s=budget_s,
                            considered=considered, notes=notes)

    # price = seconds per unit of marginal utility; greedy takes the lowest first (forced rows: 0)
    price = cost
    if utility is not LINEAR:
        gain = utility.table(int(ready.max()))[pos]
        if utility.weighted and a.weight is not None:
            gain *= a.weight[seg]
        price = cost / np.maximum(gain, _TINY)
    order = greedy_order(price, seg)
    cum = cost[order].cumsum()
    room = budget_s - base
    k = int(cum.searchsorted(room, side="right"))
    width = np.bincount(seg[order[:k]], minlength=n)
    if deferral is not None:  # over budget (room < 0) the forced rows still run
        width = np.maximum(width, 1 if lo is None else lo)
    used = float(cum[k - 1]) if k else 0.0
    if fill and k < total:
        used += _fill(order[k:], cost, seg, pos, width, room - used)
    if deferral is not None and t0 + extra_s <= base + used:  # deferring would not shorten the step
        notes["defer_cost"] = 1.0
        return StepPlan(rids, ready, predicted_s=t0 + extra_s, budget_s=budget_s,
                        considered=considered, notes=notes)
    return StepPlan(rids, width, predicted_s=base + used, budget_s=budget_s,
                    considered=considered, notes=notes)


def greedy_order(price: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Rows in greedy admission order: by price (float64 >= 0), a request's row never before its
    predecessors (it takes the running max of its request's prices), ties by row index. `seg`:
    each row's request index, non-decreasing (rows request-major). One sort of packed int64 keys
    (the module's constants); tests hold it to a plain sorted() over (running max, row)."""
    key = price.view(np.int64) >> _Q_SHIFT
    # running max along each request's rows, in one 1-D pass by lifting every request above the last
    lift = seg << _Q_BITS
    key += lift
    np.maximum.accumulate(key, out=key)
    key -= lift
    key <<= _ROW_BITS
    key |= _arange(len(price))
    key.sort()
    return key & _ROW_MASK


def _fill(rest: np.ndarray, cost: np.ndarray, seg: np.ndarray, pos: np.ndarray, width: np.ndarray,
          room: float) -> float:
    """Algorithm 1's pruning rule after the first misfit: a request whose next row does not fit is
    dropped, the others keep going. Updates `width` in place; returns the cost it added."""
    rc = cost[rest]
    fits = np.flatnonzero(rc <= room)  # rows costlier than the room now never fit later either
    done = width.tolist()
    dropped = np.zeros(len(done), dtype=bool)
    dropped[seg[rest[0]]] = True  # the row that ended the prefix did not fit
    added = 0.0
    for i, c in zip(rest[fits].tolist(), rc[fits].tolist(), strict=True):
        s = int(seg[i])
        if dropped[s] or pos[i] != done[s]:  # dropped, or an earlier row of it was skipped
            continue
        if c <= room - added:
            done[s] += 1
            added += c
        else:
            dropped[s] = True
    width[:] = done
    return added


def floor_cost(a: ArrayBatch, model: LatencyModel, floor: np.ndarray | None) -> float:
    """Predicted latency of the composition that runs `floor` rows per request (None: one each)."""
    if floor is None:
        return model.predict(len(a.rids), a.protected_ctx, a.extra_tokens)
    lo = np.minimum(np.maximum(floor, 1), a.ready)
    keep = _arange(len(a.ctx)) < (a.starts + lo).repeat(a.ready)  # a row below its request's floor
    return model.predict(int(lo.sum()), int(a.ctx[keep].sum()), a.extra_tokens)
