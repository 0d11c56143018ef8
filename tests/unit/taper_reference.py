"""TAPER's per-step decision as it stood before it was made cheaper (issue 19, commit a4c8e76),
frozen: test_taper_equivalence.py checks that the live code chooses exactly what this chose.

Only the functions whose bodies changed are copied here (verbatim, methods as functions of the
policy); the rest is the live code. A rule change meant to change decisions updates this with it.
"""

from __future__ import annotations

import math
import time

import numpy as np

from branchwise.taper.controller import _COUNTED, Row, StepController
from branchwise.taper.planner import (
    _Q_BITS,
    _Q_SHIFT,
    _ROW_BITS,
    _ROW_MASK,
    _TINY,
    ArrayBatch,
    StepPlan,
    _arange,
    _fill,
    _ones,
)
from branchwise.taper.policies import _HELD_FOREVER, Policy
from branchwise.taper.predictor import LatencyModel
from branchwise.taper.utility import LINEAR, Utility


def plan_capped(a: ArrayBatch, cap: int | None, model: LatencyModel | None) -> StepPlan:
    """The static rule: min(ready, cap) rows per request (cap None: every ready row).
    `model`, if set, only fills predicted_s."""
    w = a.ready if cap is None else np.minimum(a.ready, cap)
    predicted = 0.0
    if model is not None and len(a.rids):
        starts = a.ready.cumsum() - a.ready
        pos = np.arange(len(a.ctx)) - starts.repeat(a.ready)
        keep = pos < w.repeat(a.ready)
        predicted = model.predict(int(w.sum()), int(a.ctx[keep].sum()), a.extra_tokens)
    return StepPlan(a.rids, w, predicted)


def plan_step(a: ArrayBatch, model: LatencyModel, budget_s: float, utility: Utility = LINEAR,
              *, pinned: bool = False, fill: bool = False, floor: np.ndarray | None = None,
              deferral: tuple[float, float] | None = None) -> StepPlan:
    """Widths per request for one decode step.

    pinned: honour the fixed widths (taper-no-replan): such a request runs exactly
    min(fixed_width, ready) rows, counted in the base cost even over budget, and is not widened.
    floor: int64[n], rows per request that run whatever the budget (>= 1; capped by the ready rows);
    taper's late phases (policies.py). Rows above the floor are admitted as usual.
    deferral: (per step that defers, per deferred row) seconds, the price of deferring (taper's
    deferral-cost term): a plan that defers d rows is predicted at T(its rows) + the first + d x
    the second, so admitting a row saves its cost less the second, and the plan that defers runs
    only when it is predicted shorter than running every ready row.
    """
    if budget_s != budget_s:  # NaN (a broken clock upstream) must not widen anything
        budget_s = -math.inf
    if deferral is not None and not any(deferral):
        deferral = None
    rids = a.rids
    n = len(rids)
    if n == 0:
        return StepPlan(rids, _ones(0), 0.0, budget_s)
    ready, ctx = a.ready, a.ctx
    starts = ready.cumsum()
    starts -= ready  # index of each request's first (protected) row
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
        t0 = model.predict(n, int(ctx[starts].sum()), a.extra_tokens)  # T(S0)
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
        forced = np.flatnonzero(pos < lo[seg])
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
        base = t0 + deferral[0] + deferral[1] * considered
        cost = np.maximum(cost - deferral[1], 0.0)
        cost[forced] = 0.0
        if float(cost.sum()) <= deferral[0]:  # no plan that defers beats running every row: no greedy pass
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
    key = price.view(np.int64) >> _Q_SHIFT
    # a request's row waits for its predecessors: running max of price along each request's rows,
    # in one 1-D pass by lifting every request above the previous one
    lift = seg << _Q_BITS
    key += lift
    np.maximum.accumulate(key, out=key)
    key -= lift
    key <<= _ROW_BITS
    key |= _arange(total)
    key.sort()
    order = key & _ROW_MASK
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


def floor_cost(a: ArrayBatch, model: LatencyModel, floor: np.ndarray | None) -> float:
    """Predicted latency of the composition that runs `floor` rows per request (None: one each)."""
    if floor is None:
        starts = a.ready.cumsum() - a.ready
        return model.predict(len(a.rids), int(a.ctx[starts].sum()), a.extra_tokens)
    lo = np.minimum(np.maximum(floor, 1), a.ready)
    seg = _arange(len(a.rids)).repeat(a.ready)
    starts = a.ready.cumsum() - a.ready
    keep = _arange(len(a.ctx)) - starts[seg] < lo[seg]
    return model.predict(int(lo.sum()), int(a.ctx[keep].sum()), a.extra_tokens)


def policy_plan(self: Policy, a: ArrayBatch) -> StepPlan:
    """Widths for one step: min(ready, cap) (static), or the greedy plan within the budget."""
    if self.rho is None:
        return plan_capped(a, self.cap, self.model)
    assert self.model is not None
    budget, floor, notes = budget_rule(self, a)
    deferral = held_price(self, a, budget, floor) if self.terms.defer_cost else None
    plan = plan_step(a, self.model, budget, self.utility, pinned=not self.replan, fill=self.fill,
                     floor=floor, deferral=deferral)
    plan.notes.update(notes)
    return plan


def held_price(self: Policy, a: ArrayBatch, budget: float, floor: np.ndarray | None) -> tuple[float, float] | None:
    """The deferral price over the steps a deferral is held (module docstring), or None (free)."""
    model = self.model
    price = model.deferral() if hasattr(model, "deferral") else (0.0, 0.0)
    if not any(price):
        return None
    room = budget - floor_cost(a, model, floor)
    starts = a.ready.cumsum() - a.ready
    waiting_s = float(model.row_costs(a.ctx).sum() - model.row_costs(a.ctx[starts]).sum())
    held = max(1.0, waiting_s / room) if room > 0 else _HELD_FOREVER
    return price[0] * held, price[1] * held


def budget_rule(self: Policy, a: ArrayBatch) -> tuple[float, np.ndarray | None, dict[str, float]]:
    """The budget rule: (budget, per-request row floor or None, notes on the terms that applied)."""
    assert self.rho is not None
    if not self.slack or not len(a.rids):
        return math.inf, None, {}
    if self.terms.any() and self.replan and a.slo_s is not None:
        return weighed_budget(self, a)
    return self.rho * float(a.slack_s.min()), None, {}


def weighed_budget(self: Policy, a: ArrayBatch) -> tuple[float, np.ndarray | None, dict[str, float]]:
    """taper's budget and per-request row floor (module docstring), from a.slack_s and a.slo_s,
    and notes saying which terms applied ("per_gap", "overload", "backlog": 1.0). The overload
    term makes the plan non-monotone in row cost: longer contexts can switch it on and widen."""
    rho, slack, slo, model, terms = self.rho, a.slack_s, a.slo_s, self.model, self.terms
    assert rho is not None and slo is not None and model is not None
    notes: dict[str, float] = {}
    if a.gap_slack_s is not None and (a.waiting > 0 or floor_cost(a, model, None) > rho * float(slo.min())):
        slack = a.gap_slack_s  # saturated (a queue, or protected rows over the pace): the bank stays a margin
        notes["per_gap"] = 1.0
    extra = a.ready - 1
    phase = a.phase if a.phase is not None else np.zeros(len(a.rids), bool)
    credit = np.where(phase, slo * extra, 0.0) if terms.mean else 0.0
    bound = rho * (slack + credit)  # each request's bound on T at full width

    def floor_at(budget: float) -> np.ndarray | None:
        """Rows a phase needs so that its own bound holds at `budget`: 1 + ceil((B/rho - slack) / slo)."""
        if not terms.mean or not phase.any() or not math.isfinite(budget):
            return None
        need = np.ceil((budget / rho - slack) / np.maximum(slo, 1e-9))
        need = np.where(phase, np.clip(need, 0, extra), 0).astype(np.int64)
        return need + 1 if need.any() else None

    # the SLO pace: a step this long keeps a request on target (a phase at full width gets
    # `ready` tokens from it)
    pace = rho * slo * (a.ready if terms.mean else 1)
    budget = float(bound.min())
    if terms.overload:
        forced_s = floor_cost(a, model, floor_at(budget))
        if forced_s > budget:
            late = bound < forced_s  # no deferral keeps these within their budget this step
            budget = min(float(bound[~late].min()) if not late.all() else math.inf,
                         float(pace[late].min()))
            notes["overload"] = 1.0
    if terms.backlog and a.waiting > 0 and float(pace.min()) > budget:
        budget = float(pace.min())
        notes["backlog"] = 1.0
    return budget, floor_at(budget), notes


class ReferenceController(StepController):
    """StepController planning with the reference policy and its old bookkeeping."""

    def _plan(self, rows: list[Row], groups: dict[str, list[int]], now: float, bubble: bool,
              waiting: int) -> list[int]:
        if len(self.trackers) > len(groups) or len(self.fixed) > len(groups):
            self.forget(set(groups))
        heads = [rows[idx[0]] for idx in groups.values()]
        batch = self._snapshot(rows, groups, heads, now, bubble, waiting)
        t0 = time.perf_counter()
        plan = policy_plan(self.policy, batch)
        width = plan.widths.tolist()
        if not self.policy.replan:  # the pin rule: a phase keeps the width of its first plan
            for key, w, head in zip(groups, width, heads, strict=True):
                if head.phase and key not in self.fixed:
                    self.fixed[key] = w
        self._account(plan, batch, time.perf_counter() - t0)
        active = [i for w, idx in zip(width, groups.values(), strict=True) for n, i in enumerate(idx)
                  if n < w or rows[i].forced]
        self.stats.rows_deferred += len(rows) - len(active)
        return sorted(active)

    def _account(self, plan: StepPlan, batch: ArrayBatch, planner_s: float) -> None:
        st = self.stats
        st.planned_steps += 1
        st.planner_s += planner_s
        n = len(batch.rids)
        st.candidates += len(batch.ctx) - n
        st.admitted += plan.rows - n
        st.last_budget_s, st.last_predicted_s = plan.budget_s, plan.predicted_s
        for term in _COUNTED:
            if term in plan.notes:
                st.terms[term] = st.terms.get(term, 0) + 1
