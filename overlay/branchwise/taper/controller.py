"""The per-step admission controller: rows of a decode batch in, active row indices out.

Pure (no SGLang): the scheduler hook turns its ScheduleBatch into `Row`s, asks `select`, and runs
the chosen sub-batch; after the step it reports deliveries and the realized latency. Rows of one
parallel phase share a `key` (the phase id); a serial request's key is its rid.

Per-key state (slack trackers, taper-no-replan pins) lives while the key has rows: the caller
reports keys whose last row finished or was aborted (`on_finished`), and their entries go; a
select whose batch lacks keys the controller still holds drops those too (requests retracted to
the queue start a fresh clock when they return).

A failure inside planning (a policy or predictor bug, a bad number) must not stop the step: under
TP the other ranks wait in a broadcast for rank 0's decision. `select` logs the first failure,
counts them in stats.planner_errors, and runs every row (nothing deferred).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from branchwise.taper.policies import Policy
from branchwise.taper.predictor import OnlineRefit
from branchwise.taper.slack import SlackTracker
from branchwise.taper.state import ArrayBatch, StepPlan

logger = logging.getLogger("branchwise")


@dataclass(frozen=True, slots=True)
class Row:
    key: str  # phase id for branch rows, rid for serial requests
    order: int  # admission order inside the phase (branch index)
    ctx: int  # KV length of the row
    slo_s: float
    weight: float = 1.0
    phase: bool = False
    fanout: int = 1
    forced: bool = False  # must run this step (abort pending)


@dataclass(slots=True)
class StepStats:
    steps: int = 0
    planned_steps: int = 0  # steps where some row was a candidate for deferral
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

    def select(self, rows: list[Row], now: float, bubble: bool = False, *, waiting: int = 0) -> list[int]:
        """Indices of the rows to run this step (every key gets at least one).

        bubble: the batch in flight delivers no token to these rows (overlap scheduling after a
        prefill), so their next delivery comes only after this step AND the next one; the next
        step's protected composition is reserved out of every slack before planning.
        waiting: requests queued for admission (SGLang: len(waiting_queue)); taper's backlog term.
        `rows` must be every live row of the running batch (deferred ones included)."""
        groups: dict[str, list[int]] = {}
        for i in sorted(range(len(rows)), key=lambda i: (rows[i].key, rows[i].order)):
            groups.setdefault(rows[i].key, []).append(i)
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
        batch = self._snapshot(rows, groups, now, bubble, waiting)
        t0 = time.perf_counter()
        plan = self.policy.plan(batch)
        self.fixed.update(self.policy.pins(batch, plan))
        self._account(plan, batch, time.perf_counter() - t0)
        width = plan.widths(batch.rids)
        active = [i for w, idx in zip(width, groups.values(), strict=True) for n, i in enumerate(idx)
                  if n < w or rows[i].forced]
        self.stats.rows_deferred += len(rows) - len(active)
        return sorted(active)

    def _snapshot(self, rows: list[Row], groups: dict[str, list[int]], now: float,
                  bubble: bool = False, waiting: int = 0) -> ArrayBatch:
        """The planner's input as flat arrays, straight from the rows (no per-request objects)."""
        n = len(groups)
        heads = [rows[idx[0]] for idx in groups.values()]
        trackers = [self._tracker(h, now) for h in heads]
        slack = [t.slack(now) for t in trackers]
        gap = [t.gap_slack(now) for t in trackers] if self._mean else None
        model = self.policy.model
        if bubble and model is not None:
            reserve = model.predict(n, sum(h.ctx for h in heads))
            slack = [s - reserve for s in slack]
            if gap is not None:
                gap = [s - reserve for s in gap]
            self.stats.bubble_steps += 1
        fixed = None
        if self.fixed:
            f = [self.fixed.get(k, 0) for k in groups]
            fixed = np.array(f, dtype=np.int64) if any(f) else None
        return ArrayBatch(
            list(groups), np.fromiter(map(len, groups.values()), np.int64, n),
            np.fromiter([rows[i].ctx for idx in groups.values() for i in idx], np.int64, len(rows)),
            np.array(slack, dtype=np.float64), np.array([h.weight for h in heads], dtype=np.float64),
            np.array([h.phase for h in heads], dtype=bool), fixed, 0,
            np.array([h.slo_s for h in heads], dtype=np.float64), max(int(waiting), 0),
            np.array(gap, dtype=np.float64) if gap is not None else None)

    @property
    def _mean(self) -> bool:
        return bool(getattr(self.policy, "stage_mean", False))

    def _tracker(self, head: Row, now: float) -> SlackTracker:
        tr = self.trackers.get(head.key)
        if tr is None:
            tr = self.trackers[head.key] = SlackTracker(head.slo_s, now, mean=self._mean)
            if head.phase:
                tr.start_phase(now)
        return tr

    def _account(self, plan: StepPlan, batch: ArrayBatch, planner_s: float) -> None:
        st = self.stats
        st.planned_steps += 1
        st.planner_s += planner_s
        n = len(batch.rids)
        st.candidates += len(batch.ctx) - n
        st.admitted += plan.rows - n
        st.last_budget_s, st.last_predicted_s = plan.budget_s, plan.predicted_s
        for term in ("per_gap", "overload", "backlog"):
            if term in plan.notes:
                st.terms[term] = st.terms.get(term, 0) + 1

    def on_step_done(self, delivered: dict[str, tuple[int, float, bool]], now: float, n_rows: int) -> None:
        """Record token deliveries of the rows that ran: key -> (tokens, slo_s, in a phase)."""
        self.stats.rows_run += n_rows
        for key, (n, slo_s, phase) in delivered.items():
            tr = self.trackers.get(key)
            if tr is None:
                tr = self.trackers[key] = SlackTracker(slo_s, now, mean=self._mean)
                if phase:
                    tr.start_phase(now)
            tr.on_tokens(now, n)

    def on_latency(self, n_rows: int, ctx_tokens: int, latency_s: float) -> None:
        """A realized pure-decode step latency; feeds the predictor's rolling refit."""
        if self.refit is not None:
            self.refit.observe(n_rows, ctx_tokens, latency_s)  # refits policy.model in place

    def on_finished(self, keys: Iterable[str]) -> None:
        """These keys' last rows left for good (finished or aborted): drop their state, so a reused
        phase id or rid starts a fresh clock. The caller decides that no row of a key is left."""
        for key in keys:
            self.trackers.pop(key, None)
            self.fixed.pop(key, None)

    def forget(self, live_keys: set[str]) -> None:
        """Drop state of requests and phases that left the batch."""
        for d in (self.trackers, self.fixed):
            for key in [k for k in d if k not in live_keys]:
                del d[key]
