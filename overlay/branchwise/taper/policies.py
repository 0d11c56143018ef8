"""Branch admission policies as data: `parse_policy(name) -> Policy`, and the rules a Policy names.

Static (cap), budget (the taper family) and pin rules: docs/design/taper-rule.md, code-notes.md.
Hot path: decide and weighed_budget run per step on plain lists and unfrozen KeyClocks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import numpy as np

from branchwise.taper.planner import ArrayBatch, PlanOptions, StepPlan, floor_cost, plan_capped, plan_step
from branchwise.taper.predictor import ConstantLatencyModel, LatencyModel, LinearLatencyModel, default_model
from branchwise.taper.utility import LINEAR, Utility, parse_utility

POLICY_NAMES = ("serial", "cap:K", "eager", "taper", "taper-no-mean", "taper-no-overload", "taper-no-backlog",
                "taper-no-defer-cost", "taper-paper", "taper-no-slack", "taper-no-replan",
                "taper-const-predictor", "stock")
VALID_POLICIES = "serial, cap:K (integer K >= 1), eager, taper, taper-no-mean, taper-no-overload, " \
                 "taper-no-backlog, taper-no-defer-cost, taper-paper, taper-no-slack, taper-no-replan, " \
                 "taper-const-predictor, stock"
# taper-const-predictor built from a linear model: its value at a mid-load step (64 rows x 2k ctx).
CONST_REF = (64, 64 * 2048)
_CAP = re.compile(r"cap:(\d+)")
_HELD_FOREVER = 1e9  # steps a deferral is held when no step has room for its rows
_FIT_TOL = 1e-9  # relative margin: sums of the same row costs in another order agree far closer


@dataclass(frozen=True, slots=True)
class Terms:
    """taper's terms over the paper's rule (module docstring); all off: the paper's rule."""

    mean: bool = False  # SLO-matched budget: stage-mean serial slack, phases credited for own rows
    overload: bool = False  # requests the forced rows already push past their bound: bounded at pace
    backlog: bool = False  # with a queue, the budget never drops below the SLO pace
    defer_cost: bool = False  # a plan is priced with the model's deferral price; it defers only if shorter

    def any(self) -> bool:
        return self.mean or self.overload or self.backlog


PAPER = Terms()


@dataclass(slots=True)
class KeyClock:
    """One request's (one key's) inputs to the budget rule this step."""

    slack_s: float  # slack against its TPOT SLO (SlackTracker.slack)
    gap_s: float | None  # its per-gap slack (terms.mean only)
    slo_s: float
    extra: int  # ready rows beyond its first
    in_phase: bool


@dataclass(frozen=True, slots=True)
class StepView:
    """What the budget rule reads of one step: T of its compositions, one KeyClock per request."""

    t_all: float  # T of every ready row
    t_protected: float  # T of each request's first row
    extra_ctx: int  # context tokens of the rows beyond each request's first
    keys: list[KeyClock]
    waiting: int
    floor_cost: Callable[[list[int] | None], float]


@dataclass(frozen=True, slots=True)
class StepBudget:
    """The budget rule's one answer for a step (Policy.decide): budget, row floors, runs-all reason."""

    budget_s: float
    floor: list[int] | None  # rows per request that run whatever the budget; None: one each
    notes: dict[str, float]  # the terms that applied
    # every row runs unplanned: "fit", "price" (no deferral pays), "never" (no budget worked out)
    runs_all: str | None = None
_TERMS = MappingProxyType({"taper": Terms(True, True, True, True),
                          "taper-no-mean": Terms(False, True, True, True),
                          "taper-no-overload": Terms(True, False, True, True),
                          "taper-no-backlog": Terms(True, True, False, True),
                          "taper-no-defer-cost": Terms(True, True, True)})
# earlier names that commands and results files still use
_ALIASES = MappingProxyType({"taper-defer-cost": "taper"})
# earlier names that no longer parse, with what to write instead
_RETIRED = MappingProxyType({
    "off": "branch policy 'off' is ambiguous and no longer accepted: use 'stock' for SGLang's own schedule "
           "(Branchwise's step controller off) or 'serial' for one branch per phase per step"})


@dataclass(frozen=True, slots=True)
class Policy:
    """One admission policy: which rules apply, with what parameters; `model` is the shared, refit T(S)."""

    name: str
    model: LatencyModel | None = None
    cap: int | None = None  # static rule: rows per request (None: every ready row)
    rho: float | None = None  # budget rule: slack fraction in (0, 1]; None: static rule
    terms: Terms = PAPER
    slack: bool = True  # False: taper-no-slack (infinite budget)
    replan: bool = True  # False: taper-no-replan (a phase's first width is pinned)
    utility: Utility = LINEAR
    fill: bool = False  # True: Algorithm 1's pruning rule exactly (planner.py)

    def __post_init__(self) -> None:
        if self.rho is None:
            return
        if not 0.0 < self.rho <= 1.0:
            raise ValueError(f"rho must be in (0, 1], got {self.rho}")
        if self.model is None:
            raise ValueError(f"policy {self.name} needs a latency model")

    @property
    def static(self) -> bool:
        """The plan is a function of the ready-row counts alone (serial, cap:K, eager, stock)."""
        return self.rho is None

    def plan(self, batch: ArrayBatch, given: StepBudget | None = None) -> StepPlan:
        """Widths for one step: min(ready, cap), or the greedy plan within the budget (`given`: decide's)."""
        if self.rho is None:
            return plan_capped(batch, self.cap, self.model)
        assert self.model is not None
        if given is None:
            budget, floor, notes = self.budget(batch)
        else:
            budget, notes = given.budget_s, given.notes
            floor = None if given.floor is None else np.array(given.floor, dtype=np.int64)
        deferral = None
        if self.prices_deferral:  # plan_step prices it if rows do not all fit
            deferral = partial(self._held_price, batch, budget, floor)
        options = PlanOptions(self.utility, pinned=not self.replan, fill=self.fill, floor=floor,
                              deferral=deferral)
        plan = plan_step(batch, self.model, budget, options)
        plan.notes.update(notes)
        return plan

    def deferral_price(self) -> tuple[float, float]:
        """The model's (per deferring step, per deferred row) seconds; (0, 0): deferring is free."""
        model = self.model
        return model.deferral() if hasattr(model, "deferral") else (0.0, 0.0)

    @property
    def prices_deferral(self) -> bool:
        """The rule prices deferral and the model holds a price (a plan may then run every row)."""
        return self.terms.defer_cost and any(self.deferral_price())

    def decide(self, view: StepView) -> StepBudget | None:
        """The budget rule's answer for this step; None where the plan must work it out (static, pin, NaN)."""
        if self.rho is None:
            return None
        if self._never_defers(sum(key.extra for key in view.keys), view.extra_ctx):
            return StepBudget(math.nan, None, {}, "never")
        if (not self.replan or not isinstance(self.model, LinearLatencyModel) or not view.keys
                or any(math.isnan(key.slack_s) or (key.gap_s is not None and math.isnan(key.gap_s))
                       for key in view.keys)):
            return None
        if not self.slack:
            return StepBudget(math.inf, None, {}, "fit")
        if self.terms.any():
            budget, floor, notes = self.weighed_budget(view)
        else:  # the paper's rule
            budget, floor, notes = self.rho * min(key.slack_s for key in view.keys), None, {}
        if view.t_all * (1 + _FIT_TOL) <= budget:
            return StepBudget(budget, floor, notes, "fit")
        if self.prices_deferral and self._price_beats_saving(view, budget, floor):
            return StepBudget(budget, floor, notes, "price")
        return StepBudget(budget, floor, notes)

    def _never_defers(self, extra_rows: int, extra_ctx: int) -> bool:
        """Deferring every opportunistic row saves at most one step's price: plan_step would run all."""
        model = self.model
        if not self.prices_deferral or not isinstance(model, LinearLatencyModel) or model.graph_batch_sizes:
            return False  # padded T: a row crossing a graph size saves more than its slope (plan it)
        per_step, per_row = self.deferral_price()
        if model.c_seq < per_row:
            return False
        return (model.c_seq - per_row) * extra_rows + model.c_ctx * extra_ctx <= per_step

    def _price_beats_saving(self, view: StepView, budget: float, floor: list[int] | None) -> bool:
        """The held deferral price beats what deferring could save (docs/design/taper-rule.md)."""
        model = self.model
        if model.graph_batch_sizes:  # padded T: the saving below is the linear one (plan it)
            return False
        t_floor = view.floor_cost(floor)
        room = budget - t_floor
        held = max(1.0, (view.t_all - view.t_protected) / room) if room > 0 else _HELD_FOREVER
        per_step, per_row = (price * held for price in self.deferral_price())
        extra = sum(key.extra for key in view.keys)
        above = extra + len(view.keys) - (sum(floor) if floor is not None else len(view.keys))
        cost_s = view.t_all - t_floor  # their T; deferring row i saves max(c_seq + c_ctx * ctx_i - per_row, 0)
        if model.c_seq >= per_row:
            saving = cost_s - per_row * above
        else:  # with x_i = c_ctx * ctx_i >= 0 and k > 0: sum(max(x_i - k, 0)) <= max(sum(x_i) - k, 0)
            saving = max(cost_s - model.c_seq * (above - 1) - per_row, 0.0) if above else 0.0
        return saving + _FIT_TOL * (cost_s + per_step) <= per_step

    def held_price(self, batch: ArrayBatch, budget: float,
                   floor: np.ndarray | None) -> tuple[float, float] | None:
        """The deferral price over the steps a deferral is held (taper-rule.md), or None (free)."""
        return self._held_price(batch, budget, floor) if any(self.deferral_price()) else None

    def _held_price(self, batch: ArrayBatch, budget: float, floor: np.ndarray | None) -> tuple[float, float]:
        model = self.model
        price = self.deferral_price()
        room = budget - floor_cost(batch, model, floor)
        waiting_s = float(model.row_costs(batch.ctx).sum() - model.row_costs(batch.ctx[batch.starts]).sum())
        held = max(1.0, waiting_s / room) if room > 0 else _HELD_FOREVER
        return price[0] * held, price[1] * held

    def budget(self, batch: ArrayBatch) -> tuple[float, np.ndarray | None, dict[str, float]]:
        """The budget rule on a snapshot: (budget, per-request row floor or None, the terms' notes)."""
        assert self.rho is not None
        if not self.slack or not len(batch.rids):
            return math.inf, None, {}
        if not (self.terms.any() and self.replan and batch.slo_s is not None):
            return self.rho * float(batch.slack_s.min()), None, {}
        model = self.model
        in_phase = batch.in_phase.tolist() if batch.in_phase is not None else [False] * len(batch.rids)
        gap = [None] * len(batch.rids) if batch.gap_slack_s is None else batch.gap_slack_s.tolist()
        columns = (batch.slack_s.tolist(), gap, batch.slo_s.tolist(), (batch.ready - 1).tolist(), in_phase)
        keys = [KeyClock(*clock) for clock in zip(*columns, strict=True)]
        view = StepView(t_all=model.predict(len(batch.ctx), int(batch.ctx.sum()), batch.extra_tokens),
                        t_protected=floor_cost(batch, model, None), extra_ctx=0, keys=keys,
                        waiting=batch.waiting, floor_cost=partial(_snapshot_floor, batch, model))
        budget, floor, notes = self.weighed_budget(view)
        return budget, None if floor is None else np.array(floor, dtype=np.int64), notes

    def weighed_budget(self, view: StepView) -> tuple[float, list[int] | None, dict]:
        """taper's budget, row floor and the terms that applied (taper-rule.md); NaN clock: NaN budget."""
        rho, terms, keys = self.rho, self.terms, view.keys
        assert rho is not None
        notes: dict[str, float] = {}
        slack = [key.slack_s for key in keys]
        if keys[0].gap_s is not None and (view.waiting > 0 or view.t_protected > rho * min(key.slo_s for key in keys)):
            # saturated (a queue, or protected rows over the pace): a margin
            slack, notes["per_gap"] = [key.gap_s for key in keys], 1.0
        if any(map(math.isnan, slack)):
            return math.nan, None, notes
        mean = terms.mean
        # each request's bound on T at full width (a phase credited with its own rows)
        bound = [rho * (own + (key.slo_s * key.extra if mean and key.in_phase else 0.0))
                 for own, key in zip(slack, keys, strict=True)]
        floors = mean and any(key.in_phase for key in keys)

        def floor_at(budget: float) -> list[int] | None:
            """Rows each phase needs for its own bound to hold at `budget`, at most its ready rows."""
            if not floors or not math.isfinite(budget):
                return None
            need = []
            for own, key in zip(slack, keys, strict=True):
                rows = (budget / rho - own) / max(key.slo_s, 1e-9)
                need.append(0 if not (key.in_phase and rows > 0) else key.extra if rows >= key.extra
                            else math.ceil(rows))
            return [extra + 1 for extra in need] if any(need) else None

        def pace() -> list[float]:
            """Each request's SLO pace: the step length that keeps it on target."""
            return [rho * key.slo_s * (key.extra + 1 if mean else 1) for key in keys]

        budget = first = min(bound)
        fits = view.t_all * (1 + _FIT_TOL) <= first
        floor = None if fits else floor_at(budget)
        if terms.overload and not fits:
            forced_s = view.floor_cost(floor)
            if forced_s > budget:  # a request bound below forced_s: no deferral keeps it in budget this step
                on_time = [own for own in bound if not own < forced_s]
                budget = min(min(on_time, default=math.inf),
                             min(step_s for step_s, own in zip(pace(), bound, strict=True) if own < forced_s))
                notes["overload"] = 1.0
        if terms.backlog and view.waiting > 0 and (pace_s := min(pace())) > budget:
            budget, notes["backlog"] = pace_s, 1.0
        if fits or budget == first:
            return budget, floor, notes
        return budget, floor_at(budget), notes  # a term moved it: floor again


def parse_policy_name(name: str) -> str:
    """Canonical policy name; ValueError naming the valid values."""
    canonical = str(name).strip().lower()
    canonical = _ALIASES.get(canonical, canonical)
    if canonical in _RETIRED:
        raise ValueError(_RETIRED[canonical])
    if canonical in POLICY_NAMES and canonical != "cap:K":
        return canonical
    cap = _CAP.fullmatch(canonical)
    if cap and int(cap.group(1)) >= 1:
        return f"cap:{int(cap.group(1))}"
    raise ValueError(f"invalid branch policy {name!r}; valid: {VALID_POLICIES}")


def parse_policy(name: str, *, model: LatencyModel | None = None, rho: float = 0.8,
                 utility: str | Utility = "linear", fill: bool = False) -> Policy:
    """Build a policy; model defaults to default_model() for the budget rule (taper-const: a constant)."""
    canonical = parse_policy_name(name)
    curve = parse_utility(utility)
    if canonical == "serial":  # one branch per phase per step (the TAPER paper's IRP-Off)
        return Policy(canonical, model, cap=1)
    if canonical in ("eager", "stock"):  # stock: as eager (the server runs no controller for it)
        return Policy(canonical, model)
    if canonical.startswith("cap:"):
        return Policy(canonical, model, cap=int(canonical[4:]))
    shared = model if model is not None else default_model()
    if canonical == "taper-const-predictor" and not isinstance(shared, ConstantLatencyModel):
        shared = ConstantLatencyModel.from_model(shared, *CONST_REF)
    return Policy(canonical, shared, rho=rho, terms=_TERMS.get(canonical, PAPER),
                  slack=canonical != "taper-no-slack", replan=canonical != "taper-no-replan",
                  utility=curve, fill=fill)


def _snapshot_floor(batch: ArrayBatch, model: LatencyModel, rows: list[int] | None) -> float:
    """StepView.floor_cost on a snapshot."""
    return floor_cost(batch, model, None if rows is None else np.array(rows))
