"""The planner's flat-array input: the step controller builds it from the hook's Rows exactly as
it would be written by hand, and every policy plans the same on either."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.planner import ArrayBatch, StepPlan
from branchwise.taper.policies import Policy, StepBudget, parse_policy
from branchwise.taper.predictor import LinearLatencyModel

MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)
POLICIES = ["serial", "cap:2", "eager", "taper", "taper-paper", "taper-no-slack", "taper-no-replan",
            "taper-const-predictor"]
SLO = 0.02

# (context lens, seconds since the key's clock started, tokens delivered since, weight)
request = st.tuples(st.lists(st.integers(1, 8000), min_size=1, max_size=6).map(tuple),
                    st.floats(0.0, 0.05), st.integers(0, 3), st.sampled_from([0.5, 1.0, 3.0]))


@dataclass
class Spy:
    """A policy that records the batches the controller hands it."""

    inner: Policy
    seen: list[ArrayBatch] = field(default_factory=list)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def plan(self, a: ArrayBatch, given: StepBudget | None = None) -> StepPlan:
        self.seen.append(a)
        return self.inner.plan(a, given)


def rows_of(reqs: list[tuple]) -> list[Row]:
    """Request i has key "k{i}"; several rows make a phase. Listed in reverse, as a batch may be."""
    rows = [Row(key=f"k{i}", order=b, ctx=c, slo_s=SLO, weight=w, in_phase=len(lens) > 1) for i, (lens, _, _, w) in enumerate(reqs)
            for b, c in enumerate(lens)]
    return rows[::-1]


def start_clocks(ctl: StepController, reqs: list[tuple], now: float) -> None:
    for i, (lens, age, tokens, _) in enumerate(reqs):
        ctl.on_step_done({f"k{i}": Delivery(0, SLO, len(lens) > 1)}, now - age, 0)
        if tokens:
            ctl.on_step_done({f"k{i}": Delivery(tokens, SLO, len(lens) > 1)}, now - age / 2, 0)


def by_hand(ctl: StepController, reqs: list[tuple], now: float, waiting: int) -> ArrayBatch:
    """The batch written out from the requests and the controller's clocks and pins before it plans."""
    order = sorted(range(len(reqs)), key=lambda i: f"k{i}")
    trackers = [ctl.trackers[f"k{i}"] for i in order]
    fixed = [ctl.fixed.get(f"k{i}", 0) for i in order]
    mean = ctl.policy.terms.mean
    return ArrayBatch(
        [f"k{i}" for i in order], np.array([len(reqs[i][0]) for i in order], dtype=np.int64),
        np.array([c for i in order for c in reqs[i][0]], dtype=np.int64),
        np.array([t.slack(now) for t in trackers]), np.array([reqs[i][3] for i in order]),
        np.array([len(reqs[i][0]) > 1 for i in order]), np.array(fixed, dtype=np.int64) if any(fixed) else None,
        0, np.full(len(reqs), SLO), waiting, np.array([t.gap_slack(now) for t in trackers]) if mean else None)


def assert_same_batch(a: ArrayBatch, b: ArrayBatch) -> None:
    assert list(a.rids) == list(b.rids) and (a.extra_tokens, a.waiting) == (b.extra_tokens, b.waiting)
    for f in ("ready", "ctx", "slack_s", "weight", "in_phase", "fixed_width", "slo_s", "gap_slack_s"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and np.array_equal(x, y))), f


@settings(max_examples=150, deadline=None)
@given(st.lists(request, min_size=1, max_size=10), st.sampled_from(POLICIES),
       st.sampled_from(["linear", "concave", "priority"]), st.sampled_from([0, 3]))
def test_controller_builds_the_batch_by_hand_and_runs_its_plan(reqs, name, utility, waiting):
    spy = Spy(parse_policy(name, model=MODEL, utility=utility, rho=0.8))
    ctl = StepController(spy)  # type: ignore[arg-type]
    now = 1.0
    start_clocks(ctl, reqs, now)
    rows = rows_of(reqs)
    for step in range(2):  # the second plan sees taper-no-replan's pins
        want = by_hand(ctl, reqs, now + step * 0.001, waiting)
        fit, seen = ctl.stats.fit_steps, len(spy.seen)
        active = ctl.select(rows, now + step * 0.001, waiting=waiting)
        if all(len(r[0]) == 1 for r in reqs):
            assert active == list(range(len(rows))) and not spy.seen  # nothing to defer: no plan
            return
        plan = spy.inner.plan(want)
        if ctl.stats.fit_steps > fit:  # decided before the arrays: the plan runs every row too
            assert len(spy.seen) == seen and plan.rows == len(rows) and active == list(range(len(rows)))
            assert ctl.stats.last_budget_s == plan.budget_s
            assert ctl.stats.last_predicted_s == pytest.approx(plan.predicted_s, rel=1e-12)
            continue
        assert_same_batch(spy.seen[-1], want)
        width = dict(zip(plan.rids, plan.widths.tolist(), strict=True))
        assert sorted(active) == active
        assert {i for i in active} == {i for i, r in enumerate(rows) if r.order < width[r.key]}
        assert (ctl.stats.last_budget_s, ctl.stats.last_predicted_s) == (plan.budget_s, plan.predicted_s)
        if name == "taper-no-replan":  # every phase pinned at its first plan's width
            assert set(ctl.fixed) == {f"k{i}" for i, r in enumerate(reqs) if len(r[0]) > 1}


def test_the_batch_carries_every_field():
    reqs = [((5, 6, 7), 0.01, 2, 2.0), ((9,), 0.005, 0, 1.0)]
    spy = Spy(parse_policy("taper-no-replan", model=MODEL))
    ctl = StepController(spy)  # type: ignore[arg-type]
    start_clocks(ctl, reqs, 1.0)
    ctl.select(rows_of(reqs), 1.0, waiting=4)
    ctl.select(rows_of(reqs), 1.001, waiting=4)
    a = spy.seen[-1]
    assert list(a.rids) == ["k0", "k1"] and a.ready.tolist() == [3, 1] and a.ctx.tolist() == [5, 6, 7, 9]
    assert a.slack_s.tolist() == pytest.approx([3 * SLO - 0.011, SLO - 0.006])  # phase: 2 tokens in; serial: per gap
    assert a.weight.tolist() == [2.0, 1.0] and a.in_phase.tolist() == [True, False]
    assert a.fixed_width.tolist() == [3, 0] and a.slo_s.tolist() == [SLO, SLO] and a.waiting == 4
    assert a.gap_slack_s is None and a.extra_tokens == 0


@pytest.mark.parametrize("kw, msg", [
    ({"ready": np.array([1], dtype=np.int64)}, "one entry per request"),
    ({"ready": np.array([0, 1], dtype=np.int64), "ctx": np.array([5], dtype=np.int64)}, "at least one ready row"),
    ({"ctx": np.array([5], dtype=np.int64)}, "one entry per ready row"),
    ({"weight": np.ones(3)}, "weight needs one entry per request"),
])
def test_bad_array_batch_is_rejected(kw, msg):
    base = {"rids": ["a", "b"], "ready": np.array([1, 2], dtype=np.int64),
            "ctx": np.array([5, 6, 7], dtype=np.int64), "slack_s": np.zeros(2)}
    with pytest.raises(ValueError, match=msg):
        ArrayBatch(**{**base, **kw})


def test_step_plan_counts_its_rows():
    p = StepPlan(["a", "b"], np.array([2, 1]), predicted_s=0.5)
    assert p.rows == 3 and p.budget_s == float("inf") and p.considered == 0 and p.notes == {}
