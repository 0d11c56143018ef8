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
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from branchwise.taper.planner import plan_step
from branchwise.taper.predictor import ConstantLatencyModel, LatencyModel, default_model
from branchwise.taper.state import ArrayBatch, BatchView, StepPlan
from branchwise.taper.utility import LINEAR, Utility, parse_utility

POLICY_NAMES = ("off", "cap:K", "eager", "taper", "taper-no-slack", "taper-no-replan",
                "taper-const-predictor")
VALID_POLICIES = "off, cap:K (integer K >= 1), eager, taper, taper-no-slack, taper-no-replan, " \
                 "taper-const-predictor"
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
    """TAPER and its ablations. Budget = rho * min RequestView.slack_s (inf without slack)."""

    name: str
    model: LatencyModel
    rho: float = 0.8
    utility: Utility = LINEAR
    use_slack: bool = True  # False: taper-no-slack
    replan: bool = True  # False: taper-no-replan
    fill: bool = False  # True: Algorithm 1's pruning rule exactly (see planner.py)

    def __post_init__(self) -> None:
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")

    def budget(self, batch: BatchView | ArrayBatch) -> float:
        if isinstance(batch, ArrayBatch):
            if not self.use_slack or not len(batch.rids):
                return float("inf")
            return self.rho * float(batch.slack_s.min())
        if not self.use_slack or not batch.requests:
            return float("inf")
        return self.rho * min([r.slack_s for r in batch.requests])

    def plan(self, batch: BatchView | ArrayBatch) -> StepPlan:
        return plan_step(batch, self.model, self.budget(batch), self.utility,
                         pinned=not self.replan, fill=self.fill)

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
    return TaperPolicy(s, m, rho, u, use_slack=s != "taper-no-slack", replan=s != "taper-no-replan",
                       fill=fill)
