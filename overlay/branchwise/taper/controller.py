"""The per-step admission controller: rows of a decode batch in, active row indices out (no SGLang).

Slack formulas, per-key state and failure rule: docs/design/taper-controller.md.
Hot path: select runs every decode step: per-row records are not frozen, lists until the snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from branchwise.taper.planner import ArrayBatch, StepPlan
from branchwise.taper.policies import KeyClock, Policy, StepBudget, StepView
from branchwise.taper.predictor import OnlineRefit

logger = logging.getLogger("branchwise")
_COUNTED = ("per_gap", "overload", "backlog")  # StepPlan.notes counted in StepStats.terms


@dataclass(slots=True, kw_only=True)
class Row:
    """One live row of the decode batch, as the scheduler hook (and bench.engine) hands it in."""

    key: str  # phase id for branch rows, rid for serial requests
    order: int = 0  # admission order inside the phase (branch index)
    ctx: int  # KV length of the row
    slo_s: float
    weight: float = 1.0
    in_phase: bool = False
    forced: bool = False  # must run this step (abort pending)


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one key's rows delivered in a step, with the SLO and stage a new clock starts from."""

    tokens: int
    slo_s: float
    in_phase: bool


@dataclass(slots=True)
class SlackTracker:
    """One key's delivery clock (taper-controller.md); `mean`: a serial stage read on its mean pace."""

    slo_s: float
    last_token_s: float  # time of the last token delivery (the clock's start initially)
    phase_start_s: float | None = None
    phase_tokens: int = 0
    mean: bool = False
    stage_start_s: float = float("nan")  # serial stage start; NaN: last_token_s at creation
    stage_tokens: int = 0

    def __post_init__(self) -> None:
        if self.stage_start_s != self.stage_start_s:
            self.stage_start_s = self.last_token_s

    def on_tokens(self, now_s: float, tokens: int = 1) -> None:
        """The tokens all of the key's rows delivered in one step."""
        self.last_token_s = now_s
        if self.phase_start_s is not None:
            self.phase_tokens += tokens
        else:
            self.stage_tokens += tokens

    def start_phase(self, now_s: float) -> None:
        self.phase_start_s, self.phase_tokens = now_s, 0

    @property
    def in_phase(self) -> bool:
        return self.phase_start_s is not None

    def slack(self, now_s: float) -> float:
        if self.phase_start_s is not None:
            return (self.phase_tokens + 1) * self.slo_s - (now_s - self.phase_start_s)
        if self.mean:
            return (self.stage_tokens + 1) * self.slo_s - (now_s - self.stage_start_s)
        return self.slo_s - (now_s - self.last_token_s)

    def gap_slack(self, now_s: float) -> float:
        """The paper's reading: per gap in a serial stage (the phase slack in a phase)."""
        if self.phase_start_s is not None:
            return (self.phase_tokens + 1) * self.slo_s - (now_s - self.phase_start_s)
        return self.slo_s - (now_s - self.last_token_s)


@dataclass(slots=True)
class _Step:
    """One step's rows grouped by key, and each key's clock: what the rule and the planner read."""

    rows: list[Row]
    groups: dict[str, list[int]]  # key -> its row indices in admission order
    heads: list[Row]  # each key's first (protected) row
    waiting: int
    clocks: list[KeyClock] = field(default_factory=list)


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    planned_steps: int = 0  # steps with candidates for deferral that the planner decided
    unpriced_steps: int = 0  # steps with candidates that ran every row unplanned: no deferral could pay
    fit_steps: int = 0  # steps with candidates that ran every row unplanned: every row fit the budget
    rows_run: int = 0
    rows_deferred: int = 0
    candidates: int = 0  # opportunistic rows (beyond one per request) that were ready
    admitted: int = 0  # opportunistic rows admitted
    planner_s: float = 0.0
    last_budget_s: float = float("inf")
    last_predicted_s: float = 0.0
    bubble_steps: int = 0  # planned with the next step's protected composition reserved
    planner_errors: int = 0  # steps whose planning raised (every row ran)
    terms: dict[str, int] = field(default_factory=dict)  # planned steps per taper term that applied

    @property
    def admission_rate(self) -> float:
        return self.admitted / self.candidates if self.candidates else 1.0


@dataclass
class StepController:
    policy: Policy
    refit: OnlineRefit | None = None
    trackers: dict[str, SlackTracker] = field(default_factory=dict)
    fixed: dict[str, int] = field(default_factory=dict)  # taper-no-replan widths per phase
    stats: StepStats = field(default_factory=StepStats)
    # end of the last step without phase rows while such steps run (docs/design: quiet steps)
    quiet_ts: float | None = None

    def select(self, rows: list[Row], now: float, bubble: bool = False, *, waiting: int = 0) -> list[int]:
        """Indices of the rows to run this step, at least one per key (bubble, waiting: code-notes.md)."""
        groups: dict[str, list[int]] = {}
        for key, _, index in sorted([(row.key, row.order, index) for index, row in enumerate(rows)]):
            groups.setdefault(key, []).append(index)
        self.stats.steps += 1
        if len(groups) == len(rows):
            return list(range(len(rows)))  # nothing to defer: skip the planner
        try:
            return self._plan(rows, groups, now, bubble, waiting)
        except Exception:  # noqa: BLE001 - a planner bug must not stall the step or the TP broadcast
            self.stats.planner_errors += 1
            if self.stats.planner_errors == 1:
                logger.exception("Branchwise: TAPER planning failed; running every row this step "
                                 "(logged once, counted in planner_errors)")
            return list(range(len(rows)))

    def _plan(self, rows: list[Row], groups: dict[str, list[int]], now: float, bubble: bool,
              waiting: int) -> list[int]:
        if len(self.trackers) > len(groups) or len(self.fixed) > len(groups):
            self.forget(set(groups))
        heads = [rows[indices[0]] for indices in groups.values()]
        step = _Step(rows, groups, heads, max(int(waiting), 0))
        self._clocks(step, now, bubble)
        rule = None
        if not self.policy.static:  # a static width reads the ready counts alone: no context sums
            view = self._view(step)
            rule = self.policy.decide(view)
            if rule is not None and rule.runs_all:
                self._unplanned(rule, len(rows) - len(heads), view.t_all)
                return list(range(len(rows)))
        batch = self._snapshot(step)
        started = time.perf_counter()
        plan = self.policy.plan(batch, rule)
        widths = plan.widths.tolist()
        if not self.policy.replan:  # the pin rule: a phase keeps the width of its first plan
            for key, width, head in zip(groups, widths, heads, strict=True):
                if head.in_phase and key not in self.fixed:
                    self.fixed[key] = width
        admitted = sum(widths)
        self._account(plan, batch, admitted, time.perf_counter() - started)
        if admitted == len(rows):  # every row runs (the common plan): no per-row pass
            return list(range(len(rows)))
        active = [index for width, indices in zip(widths, groups.values(), strict=True)
                  for rank, index in enumerate(indices) if rank < width or rows[index].forced]
        self.stats.rows_deferred += len(rows) - len(active)
        return sorted(active)

    def _clocks(self, step: _Step, now: float, bubble: bool) -> None:
        """Each key's KeyClock (per-gap slack only where terms.mean reads it); a new key starts one now."""
        mean = self.policy.terms.mean
        model = self.policy.model
        reserve = None
        if bubble and model is not None:
            reserve = model.predict(len(step.heads), sum(head.ctx for head in step.heads))
            self.stats.bubble_steps += 1
        for head, indices in zip(step.heads, step.groups.values(), strict=True):
            tracker = self._tracker(head.key, head.slo_s, head.in_phase, now)
            own = tracker.slack(now)
            gap = tracker.gap_slack(now) if mean else None
            if reserve is not None:
                own -= reserve
                gap = None if gap is None else gap - reserve
            step.clocks.append(KeyClock(own, gap, head.slo_s, len(indices) - 1, head.in_phase))

    def _view(self, step: _Step) -> StepView:
        """The budget rule's input straight from the rows and clocks, without the snapshot's arrays."""
        model = self.policy.model
        rows, groups = step.rows, step.groups
        head_ctx = sum(head.ctx for head in step.heads)
        extra_ctx = sum(row.ctx for row in rows) - head_ctx
        t_protected = model.predict(len(step.heads), head_ctx)

        def floor_cost(floor: list[int] | None) -> float:
            if floor is None:
                return t_protected
            kept = sum(rows[index].ctx for least, indices in zip(floor, groups.values(), strict=True)
                       for index in indices[:least])
            return model.predict(sum(floor), kept)

        t_all = model.predict(len(rows), head_ctx + extra_ctx)
        return StepView(t_all, t_protected, extra_ctx, step.clocks, step.waiting, floor_cost)

    def _unplanned(self, rule: StepBudget, extra: int, t_all: float) -> None:
        """A step run whole without a plan, counted in fit_steps or unpriced_steps as decide said."""
        stats = self.stats
        if rule.runs_all == "fit":
            stats.fit_steps += 1
        else:
            stats.unpriced_steps += 1
        self._all_admitted(extra)
        if rule.runs_all != "never":  # "never": no budget was worked out
            stats.last_budget_s, stats.last_predicted_s = rule.budget_s, t_all
            self._count_terms(rule.notes)

    def _all_admitted(self, extra: int) -> None:
        """A step that ran all `extra` opportunistic rows without a plan."""
        self.stats.candidates += extra
        self.stats.admitted += extra

    def _count_terms(self, notes: dict[str, float]) -> None:
        """The taper terms that applied to this step's budget (StepStats.terms)."""
        terms = self.stats.terms
        for term in _COUNTED:
            if term in notes:
                terms[term] = terms.get(term, 0) + 1

    def _snapshot(self, step: _Step) -> ArrayBatch:
        """The planner's input as flat arrays, straight from the rows and clocks."""
        rows, groups, heads = step.rows, step.groups, step.heads
        fixed = None
        if self.fixed:
            pinned = [self.fixed.get(key, 0) for key in groups]
            fixed = np.array(pinned, dtype=np.int64) if any(pinned) else None
        gap = None
        if self.policy.terms.mean:
            gap = np.array([clock.gap_s for clock in step.clocks], dtype=np.float64)
        return ArrayBatch(
            rids=list(groups), ready=np.fromiter(map(len, groups.values()), np.int64, len(groups)),
            ctx=np.fromiter([rows[index].ctx for indices in groups.values() for index in indices],
                            np.int64, len(rows)),
            slack_s=np.array([clock.slack_s for clock in step.clocks], dtype=np.float64),
            weight=np.array([head.weight for head in heads], dtype=np.float64),
            in_phase=np.array([head.in_phase for head in heads], dtype=bool), fixed_width=fixed,
            slo_s=np.array([head.slo_s for head in heads], dtype=np.float64), waiting=step.waiting,
            gap_slack_s=gap)

    def _tracker(self, key: str, slo_s: float, in_phase: bool, now: float) -> SlackTracker:
        """The key's clock; a key seen for the first time starts one now (in a phase for phases)."""
        tracker = self.trackers.get(key)
        if tracker is None:
            tracker = self.trackers[key] = SlackTracker(slo_s, now, mean=self.policy.terms.mean)
            if in_phase:
                tracker.start_phase(now)
        return tracker

    def _account(self, plan: StepPlan, batch: ArrayBatch, rows: int, planner_s: float) -> None:
        stats = self.stats
        stats.planned_steps += 1
        stats.planner_s += planner_s
        protected = len(batch.rids)
        stats.candidates += len(batch.ctx) - protected
        stats.admitted += rows - protected
        stats.last_budget_s, stats.last_predicted_s = plan.budget_s, plan.predicted_s
        self._count_terms(plan.notes)

    def on_step_done(self, delivered: dict[str, Delivery], now: float, n_rows: int) -> None:
        """Record token deliveries of the rows that ran, per key."""
        self.stats.rows_run += n_rows
        for key, delivery in delivered.items():
            self._tracker(key, delivery.slo_s, delivery.in_phase, now).on_tokens(now, delivery.tokens)

    def on_phase_step(self, delivered: dict[str, Delivery], now: float, n_rows: int) -> None:
        """A step with phase rows: every key's deliveries are booked (serial clocks kept current)."""
        self.on_step_done(delivered, now, n_rows)
        self.quiet_ts = None

    def on_quiet_step(self, now: float, n_rows: int) -> None:
        """A step without phase rows: no per-key bookkeeping; the in-phase clocks go."""
        self.on_step_done({}, now, n_rows)
        if self.quiet_ts is None:
            self.forget({key for key, tracker in self.trackers.items() if tracker.in_phase})
        self.quiet_ts = now

    def resume_serial_clocks(self, rows: list[Row]) -> None:
        """Before the first plan after quiet steps: every serial row delivered at `quiet_ts`."""
        if self.quiet_ts is None:
            return
        fresh = {row.key: Delivery(0, row.slo_s, False) for row in rows
                 if not row.in_phase and row.key not in self.trackers}
        self.on_step_done(fresh, self.quiet_ts, 0)
        self.quiet_ts = None

    def on_latency(self, n_rows: int, ctx_tokens: int, latency_s: float, deferred: int = 0) -> None:
        """A realized pure-decode step latency (and the rows it deferred); feeds the rolling refit."""
        if self.refit is not None:  # refits policy.model in place
            self.refit.observe(n_rows, ctx_tokens, latency_s, deferred=deferred)

    def on_finished(self, keys: Iterable[str]) -> None:
        """These keys' last rows left for good: drop their state, so a reused id starts a fresh clock."""
        for key in keys:
            self.trackers.pop(key, None)
            self.fixed.pop(key, None)

    def forget(self, live_keys: set[str]) -> None:
        """Drop state of requests and phases that left the batch."""
        for state in (self.trackers, self.fixed):
            for key in [key for key in state if key not in live_keys]:
                del state[key]
