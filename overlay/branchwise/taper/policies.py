"""Branch admission policies: `parse_policy(name) -> Policy`, each with `plan(batch) -> StepPlan`.

The caller (scheduler hook or simulator) does, every decode step on TP rank 0:
    batch = BatchView(...)                   # RequestView.slack_s from slack.py, for `now`
    plan = policy.plan(batch)                # width[rid] in [1, ready] for every request
    for rid, w in policy.pins(batch, plan).items():
        remember fixed_width[rid] = w until that request's phase reduces   # taper-no-replan only
    run the first width[rid] ready rows of each request; broadcast the plan to the other ranks
    refit.observe(rows, ctx_tokens, realized_s)   # OnlineRefit(policy.model), pure decode steps

taper-no-replan: the caller sets RequestView.fixed_width to the stored width for every step of the
phase after its first; `pins` names the requests whose phase has no stored width yet (it returns
{} for every other policy), and the caller forgets the width at the reduce. A stored width is held
(capped by the ready rows) even when the budget later shrinks: that is the ablation.

taper-paper is the paper's rule (Algorithm 1): budget B = rho * min slack, per-gap serial slack,
protected rows always run, opportunistic rows greedily while T(S) <= B. taper-no-slack,
taper-no-replan and taper-const-predictor are its ablations.

taper weighs what a deferral costs later against the step time it saves now. With a step latency
T = c0 + c_seq * rows + c_ctx * ctx, a deferred row still runs later at the same cost, so deferral
only moves work: it lowers this step's T and pays for that with a longer phase (its slot held, its
protected row in more steps, each of which pays c0 again, queued requests waiting). Moving work is
worth it only when the steps it moves to are less tight. Three terms, each an ablation:

* SLO-matched budget (off: taper-no-mean). A serial stage is judged on its mean TPOT, so its slack
  is (tokens + 1) * slo - elapsed since the stage began (slack.py, mean=True), like a phase's: a
  request that ran ahead of its pace lends what it banked to the step (the paper's per-gap slack
  forgets it, and defers rows the SLO would allow). A phase's effective TPOT counts the tokens of
  all its branches: running w of its rows relaxes its own bound to T <= rho * (slack + (w - 1) * slo),
  so deferring a late phase's rows never helps that phase. The budget is rho * min over requests of
  that bound at full width, and every phase gets as many rows (a floor, run whatever the budget) as
  its own bound needs at that budget. The bank is lent only while the protected rows alone fit the
  SLO pace (rho * slo): beyond it the engine is overloaded, the banked time is the stages' only
  margin against the steps the planner does not see (an arrival's prefill), and serial slack is
  read per gap as in the paper (ArrayBatch.gap_slack_s). Lent then too, it goes to width until the
  steps run at the SLO and marginal stages tip over it.
* Overload rule (off: taper-no-overload). When the rows that must run already exceed the budget,
  deferral cannot save the tightest requests this step: their budget was lost before any
  opportunistic row was counted. Those requests stop setting the budget; each of them bounds the
  step at its SLO pace, rho * slo (a step within it lets a late request catch up by (1 - rho) * slo;
  a phase's pace counts its ready rows). The requests that can still be kept within their budget
  set it as before. Without this rule (and the phases' floors) the budget goes to protected rows,
  nothing is admitted, phases live on, their protected rows pile up in every step and the steps
  grow: the trap where eager beats taper-paper. With it, once the steps outgrow the SLO the phases
  fall behind their own targets and their floors widen them until they are back on pace: they
  finish and give back their slots and protected rows, which is how eager gets out of the trap.
* Backlog term (off: taper-no-backlog). While requests wait for admission (ArrayBatch.waiting > 0)
  the engine has no idle time ahead in which deferred work could be caught up: time saved now is
  spent on the same demand later, and every deferred row keeps a slot from the queue. So the budget
  never drops below the SLO pace, rho * min slo: requests behind their pace still catch up, by less
  (the term binds only while some request is behind its pace).
  Without a backlog narrower steps cost only the phases' own wall time, which their bound counts.

With plentiful slack every term is inert and taper admits everything that fits, as the paper does.
The extra inputs are per-request SLOs (ArrayBatch.slo_s) and the queue length (ArrayBatch.waiting);
without slo_s taper plans as taper-paper.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from branchwise.taper.planner import floor_cost, plan_step
from branchwise.taper.predictor import ConstantLatencyModel, LatencyModel, default_model
from branchwise.taper.state import ArrayBatch, BatchView, StepPlan, as_arrays
from branchwise.taper.utility import LINEAR, Utility, parse_utility

POLICY_NAMES = ("off", "cap:K", "eager", "taper", "taper-no-mean", "taper-no-overload", "taper-no-backlog",
                "taper-paper", "taper-no-slack", "taper-no-replan", "taper-const-predictor")
VALID_POLICIES = "off, cap:K (integer K >= 1), eager, taper, taper-no-mean, taper-no-overload, " \
                 "taper-no-backlog, taper-paper, taper-no-slack, taper-no-replan, taper-const-predictor"
# taper's three terms (module docstring); the paper's rule and its ablations use none of them
_TERMS = {"taper": (True, True, True), "taper-no-mean": (False, True, True),
          "taper-no-overload": (True, False, True), "taper-no-backlog": (True, True, False)}
# taper-const-predictor built from a linear model: its value at a mid-load step (64 rows x 2k ctx).
CONST_REF = (64, 64 * 2048)
_CAP = re.compile(r"cap:(\d+)")


class Policy(Protocol):
    name: str
    model: LatencyModel | None

    def plan(self, batch: BatchView | ArrayBatch) -> StepPlan: ...

    def pins(self, batch: BatchView | ArrayBatch, plan: StepPlan) -> dict[str, int]: ...


@dataclass(slots=True)
class CapPolicy:
    """off (cap 1), cap:K, eager (cap None). `model`, if set, only fills plan.predicted_s."""

    name: str
    cap: int | None
    model: LatencyModel | None = None

    def plan(self, batch: BatchView | ArrayBatch) -> StepPlan:
        if isinstance(batch, ArrayBatch):
            return self._plan_arrays(batch)
        reqs = batch.requests
        k = self.cap
        if k == 1:
            width = dict.fromkeys([r.rid for r in reqs], 1)
        else:
            width = {r.rid: len(r.context_lens) if k is None else min(len(r.context_lens), k) for r in reqs}
        predicted = 0.0
        if self.model is not None and reqs:
            ctx = sum([sum(r.context_lens[: width[r.rid]]) for r in reqs])
            predicted = self.model.predict(sum(width.values()), ctx, batch.extra_tokens)
        return StepPlan(width, predicted)

    def _plan_arrays(self, a: ArrayBatch) -> StepPlan:
        w = a.ready if self.cap is None else np.minimum(a.ready, self.cap)
        predicted = 0.0
        if self.model is not None and len(a.rids):
            starts = a.ready.cumsum() - a.ready
            pos = np.arange(len(a.ctx)) - starts.repeat(a.ready)
            keep = pos < w.repeat(a.ready)
            predicted = self.model.predict(int(w.sum()), int(a.ctx[keep].sum()), a.extra_tokens)
        return StepPlan(rids=a.rids, widths=w, predicted_s=predicted)

    def pins(self, batch: BatchView | ArrayBatch, plan: StepPlan) -> dict[str, int]:
        return {}


@dataclass(slots=True)
class TaperPolicy:
    """TAPER and its ablations. taper-paper: budget = rho * min slack (inf without slack); the
    flags add taper's terms (module docstring)."""

    name: str
    model: LatencyModel
    rho: float = 0.8
    utility: Utility = LINEAR
    use_slack: bool = True  # False: taper-no-slack
    replan: bool = True  # False: taper-no-replan
    fill: bool = False  # True: Algorithm 1's pruning rule exactly (see planner.py)
    mean: bool = False  # SLO-matched budget: stage-mean serial slack, phases credited for own rows
    overload: bool = False  # requests the forced rows already push past their budget bound at pace
    backlog: bool = False  # with a queue, the budget never drops below the SLO pace

    def __post_init__(self) -> None:
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")

    @property
    def stage_mean(self) -> bool:
        """Whether the caller should track serial slack on the stage's mean pace (slack.py)."""
        return self.mean

    def budget(self, batch: BatchView | ArrayBatch) -> float:
        if isinstance(batch, ArrayBatch):
            if not self.use_slack or not len(batch.rids):
                return float("inf")
            return self.rho * float(batch.slack_s.min())
        if not self.use_slack or not batch.requests:
            return float("inf")
        return self.rho * min([r.slack_s for r in batch.requests])

    def plan(self, batch: BatchView | ArrayBatch) -> StepPlan:
        if (self.mean or self.overload or self.backlog) and self.use_slack and self.replan:
            a = as_arrays(batch)
            if a.slo_s is not None and len(a.rids):
                budget, floor, notes = self.weighed_budget(a)
                plan = plan_step(a, self.model, budget, self.utility, fill=self.fill, floor=floor)
                plan.notes.update(notes)
                return plan
        return plan_step(batch, self.model, self.budget(batch), self.utility,
                         pinned=not self.replan, fill=self.fill)

    def weighed_budget(self, a: ArrayBatch) -> tuple[float, np.ndarray | None, dict[str, float]]:
        """taper's budget and per-request row floor (module docstring), from a.slack_s and a.slo_s,
        and notes saying which terms applied ("per_gap", "overload", "backlog": 1.0). The overload
        term makes the plan non-monotone in row cost: longer contexts can switch it on and widen."""
        rho, slack, slo = self.rho, a.slack_s, a.slo_s
        assert slo is not None
        notes: dict[str, float] = {}
        if a.gap_slack_s is not None and floor_cost(a, self.model, None) > rho * float(slo.min()):
            slack = a.gap_slack_s  # the protected rows alone exceed the pace: the bank stays a margin
            notes["per_gap"] = 1.0
        extra = a.ready - 1
        phase = a.phase if a.phase is not None else np.zeros(len(a.rids), bool)
        credit = np.where(phase, slo * extra, 0.0) if self.mean else 0.0
        bound = rho * (slack + credit)  # each request's bound on T at full width
        # the SLO pace: a step this long keeps a request on target (a phase at full width gets
        # `ready` tokens from it)
        pace = rho * slo * (a.ready if self.mean else 1)
        budget = float(bound.min())
        floor = self._floor(budget, slack, slo, phase, extra)
        if self.overload:
            forced_s = floor_cost(a, self.model, floor)
            if forced_s > budget:
                late = bound < forced_s  # no deferral keeps these within their budget this step
                budget = min(float(bound[~late].min()) if not late.all() else math.inf,
                             float(pace[late].min()))
                notes["overload"] = 1.0
        if self.backlog and a.waiting > 0 and float(pace.min()) > budget:
            budget = float(pace.min())
            notes["backlog"] = 1.0
        return budget, self._floor(budget, slack, slo, phase, extra), notes

    def _floor(self, budget: float, slack: np.ndarray, slo: np.ndarray, phase: np.ndarray,
               extra: np.ndarray) -> np.ndarray | None:
        """Rows a phase needs so that its own bound holds at `budget`: 1 + ceil((B/rho - slack) / slo)."""
        if not self.mean or not phase.any() or not math.isfinite(budget):
            return None
        need = np.ceil((budget / self.rho - slack) / np.maximum(slo, 1e-9))
        need = np.where(phase, np.clip(need, 0, extra), 0).astype(np.int64)
        return need + 1 if need.any() else None

    def pins(self, batch: BatchView | ArrayBatch, plan: StepPlan) -> dict[str, int]:
        if self.replan:
            return {}
        if isinstance(batch, ArrayBatch):
            phase = batch.phase if batch.phase is not None else np.zeros(len(batch.rids), bool)
            fixed = batch.fixed_width if batch.fixed_width is not None else np.zeros(len(batch.rids), np.int64)
            return {rid: plan.width[rid] for rid, p, f in zip(batch.rids, phase.tolist(), fixed.tolist(),
                                                             strict=True) if p and not f}
        return {r.rid: plan.width[r.rid] for r in batch.requests
                if r.phase_id is not None and r.fixed_width is None}


def parse_policy_name(name: str) -> str:
    """Canonical policy name; ValueError naming the valid values."""
    s = str(name).strip().lower()
    if s in POLICY_NAMES and s != "cap:K":
        return s
    m = _CAP.fullmatch(s)
    if m and int(m.group(1)) >= 1:
        return f"cap:{int(m.group(1))}"
    raise ValueError(f"invalid branch policy {name!r}; valid: {VALID_POLICIES}")


def parse_policy(name: str, *, model: LatencyModel | None = None, rho: float = 0.8,
                 utility: str | Utility = "linear", const_s: float | None = None,
                 fill: bool = False) -> Policy:
    """Build a policy. model defaults to default_model(); const_s fixes taper-const-predictor's value."""
    s = parse_policy_name(name)
    u = parse_utility(utility)
    if s == "off":
        return CapPolicy(s, 1, model)
    if s == "eager":
        return CapPolicy(s, None, model)
    if s.startswith("cap:"):
        return CapPolicy(s, int(s[4:]), model)
    m = model if model is not None else default_model()
    if s == "taper-const-predictor":
        if const_s is not None:
            m = ConstantLatencyModel(const_s)
        elif not isinstance(m, ConstantLatencyModel):
            m = ConstantLatencyModel.from_model(m, *CONST_REF)
    mean, overload, backlog = _TERMS.get(s, (False, False, False))
    return TaperPolicy(s, m, rho, u, use_slack=s != "taper-no-slack", replan=s != "taper-no-replan",
                       fill=fill, mean=mean, overload=overload, backlog=backlog)
