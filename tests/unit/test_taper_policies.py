"""Policy parsing and the behaviour of serial / cap:K / eager / taper and the ablations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.planner import ArrayBatch
from branchwise.taper.policies import CONST_REF, POLICY_NAMES, Policy, parse_policy, parse_policy_name
from branchwise.taper.predictor import ConstantLatencyModel, LinearLatencyModel, default_model
from branchwise.taper.utility import CONCAVE


class AlwaysPlanned(Policy):
    """The policy whose budget decision (Policy.decide) leaves every step to the plan, but for the
    steps no deferral could pay even one step's price (held to the plan by PricedEachStep's test):
    the reference the budget's shortcuts ("fit", "price") are held to."""

    def decide(self, view):
        never = super().decide(view)
        return never if never is not None and never.runs_all == "never" else None


class PricedEachStep(Policy):
    """The policy without its cheapest shortcut (no deferral could pay even one step's price)."""

    def _never_defers(self, extra_rows, extra_ctx):
        return False


def _as(cls: type[Policy], policy: Policy) -> Policy:
    return cls(**{name: getattr(policy, name) for name in Policy.__dataclass_fields__})

MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)


def batch(*reqs: tuple) -> ArrayBatch:
    """reqs: (rid, context lens, slack_s[, in a phase[, pinned width]])."""
    full = [(*r, False, 0)[:5] for r in reqs]
    return ArrayBatch([r[0] for r in full], np.array([len(r[1]) for r in full], dtype=np.int64),
                      np.array([c for r in full for c in r[1]], dtype=np.int64),
                      np.array([r[2] for r in full], dtype=np.float64), None,
                      np.array([r[3] for r in full], dtype=bool),
                      np.array([r[4] for r in full], dtype=np.int64) if any(r[4] for r in full) else None)


request = st.tuples(st.text("abcdef", min_size=1, max_size=4),
                    st.lists(st.integers(1, 8000), min_size=1, max_size=8).map(tuple), st.floats(-0.05, 0.2))
batches = st.lists(request, min_size=0, max_size=10, unique_by=lambda r: r[0]).map(lambda rs: batch(*rs))


def widths(policy, a: ArrayBatch) -> dict[str, int]:
    plan = policy.plan(a)
    return dict(zip(plan.rids, plan.widths.tolist(), strict=True))


def ready(a: ArrayBatch) -> dict[str, int]:
    return dict(zip(a.rids, a.ready.tolist(), strict=True))


@pytest.mark.parametrize("name", ["stock", "serial", "eager", "taper", "taper-no-slack", "taper-no-replan",
                                  "taper-const-predictor", "cap:1", "cap:3", " TAPER ", "cap:007"])
def test_parse_valid_names(name):
    policy = parse_policy(name)
    assert policy.name == parse_policy_name(name)
    assert parse_policy_name("cap:007") == "cap:7"


@pytest.mark.parametrize("name", ["", "cap:0", "cap:x", "cap:", "cap:-1", "cap:2.5", "capped:2", "greedy",
                                  "taper-no", "cap:K"])
def test_parse_invalid_names_say_what_is_valid(name):
    with pytest.raises(ValueError, match=r"valid: serial, cap:K .*taper-const-predictor"):
        parse_policy(name)


def test_policy_names_cover_the_cli_values():
    assert POLICY_NAMES == ("serial", "cap:K", "eager", "taper", "taper-no-mean", "taper-no-overload",
                            "taper-no-backlog", "taper-no-defer-cost", "taper-paper", "taper-no-slack",
                            "taper-no-replan", "taper-const-predictor", "stock")


def test_bad_rho_and_utility_are_rejected():
    with pytest.raises(ValueError, match="rho"):
        parse_policy("taper", rho=0.0)
    with pytest.raises(ValueError, match="rho"):
        parse_policy("taper", rho=1.5)
    with pytest.raises(ValueError, match="valid: linear, concave, priority"):
        parse_policy("taper", utility="log")
    assert parse_policy("taper", utility="concave").utility is CONCAVE


@settings(max_examples=30, deadline=None)
@given(batches, st.integers(1, 9))
def test_serial_eager_and_caps(batch, k):
    serial = widths(parse_policy("serial"), batch)
    eager = widths(parse_policy("eager"), batch)
    stock = widths(parse_policy("stock"), batch)
    cap = widths(parse_policy(f"cap:{k}"), batch)
    for rid, n in ready(batch).items():
        assert serial[rid] == 1
        assert eager[rid] == stock[rid] == n
        assert cap[rid] == min(n, k)


@settings(max_examples=30, deadline=None)
@given(batches, st.floats(0.1, 1.0))
def test_taper_between_serial_and_eager_and_protected_when_late(batch, rho):
    plan = Policy("taper", MODEL, rho=rho).plan(batch)  # the budget rule without taper's terms
    assert ((1 <= plan.widths) & (plan.widths <= batch.ready)).all()
    if len(batch.rids):
        assert plan.budget_s == pytest.approx(rho * batch.slack_s.min())
        if batch.slack_s.min() < 0:  # someone is already late: protected only
            assert plan.rows == len(batch.rids)


@settings(max_examples=30, deadline=None)
@given(batches)
def test_no_slack_admits_every_ready_row(batch):
    plan = parse_policy("taper-no-slack", model=MODEL).plan(batch)
    assert widths(parse_policy("taper-no-slack", model=MODEL), batch) == ready(batch)
    assert plan.budget_s == float("inf")


def test_cap_policy_reports_prediction_when_given_a_model():
    a = batch(("a", (100, 200, 300), 0.1), ("b", (50,), 0.1))
    cap2 = Policy("cap:2", MODEL, cap=2)
    assert cap2.static and widths(cap2, a) == {"a": 2, "b": 1}
    assert cap2.plan(a).predicted_s == pytest.approx(MODEL.predict(3, 350))
    assert Policy("eager").plan(a).predicted_s == 0.0  # no model: no prediction
    assert not parse_policy("taper").static


def test_taper_widens_with_slack_and_contracts_without():
    lens = (2000,) * 6
    mk = lambda slack: batch(("par", lens, 1.0, True), ("ser", (3000,), slack))  # noqa: E731
    policy = parse_policy("taper", model=MODEL, rho=0.8)
    assert widths(policy, mk(0.05))["par"] == 6  # budget 40 ms: all 7 rows cost ~12 ms
    tight = policy.plan(mk(0.0149))  # budget 11.92 ms: S0 10.9 ms + two 0.4 ms rows
    assert widths(policy, mk(0.0149)) == {"par": 3, "ser": 1} and tight.predicted_s <= tight.budget_s
    assert widths(policy, mk(-0.01)) == {"par": 1, "ser": 1}


def test_no_replan_pins_width_at_phase_start_and_holds_it():
    lens = (2000,) * 6
    start = batch(("par", lens, 1.0, True), ("ser", (3000,), 0.05))
    # later, the budget collapses; a pinned width is held (that is the ablation)...
    later = batch(("par", lens[:5], 1.0, True, 6), ("ser", (3000,), -0.01))
    policy = parse_policy("taper-no-replan", model=MODEL, rho=1.0)
    assert widths(policy, start) == {"par": 6, "ser": 1}
    assert widths(policy, later) == {"par": 5, "ser": 1}
    # ...where replanning taper contracts at once
    assert widths(parse_policy("taper", model=MODEL), later) == {"par": 1, "ser": 1}


def test_pin_rule_pins_only_phases_and_only_once():
    """The controller keeps the pins: a phase's width at its first plan, never a serial request's;
    a pinned phase keeps its pin while its budget collapses. Replanning policies pin nothing."""
    rows = [Row(key="par", order=b, ctx=2000, slo_s=0.05, in_phase=True) for b in range(6)] + [Row(key="ser", ctx=3000, slo_s=0.05)]
    ctl = StepController(parse_policy("taper-no-replan", model=MODEL, rho=1.0))
    assert len(ctl.select(rows, 0.0)) == 7
    assert ctl.fixed == {"par": 6}
    ctl.on_step_done({"ser": Delivery(1, 0.05, False)}, 0.0, 1)
    assert len(ctl.select(rows[1:], 0.06)) == 6  # "ser" is 10 ms late: the pin holds all 5 rows
    assert ctl.fixed == {"par": 6}
    taper = StepController(parse_policy("taper", model=MODEL))
    taper.select(rows, 0.0)
    assert taper.fixed == {}


def test_const_predictor_ablation():
    policy = parse_policy("taper-const-predictor", model=MODEL)
    assert isinstance(policy.model, ConstantLatencyModel)
    assert policy.model.value_s == pytest.approx(MODEL.predict(*CONST_REF))
    assert parse_policy("taper-const-predictor", model=ConstantLatencyModel(0.02)).model.value_s == 0.02
    const = ConstantLatencyModel(0.01)
    assert parse_policy("taper-const-predictor", model=const).model is const
    mk = lambda slack: batch(("a", (100,) * 4, slack), ("b", (100,), 1.0))  # noqa: E731
    p = parse_policy("taper-const-predictor", model=ConstantLatencyModel(0.02), rho=1.0)
    assert widths(p, mk(0.019)) == {"a": 1, "b": 1}  # constant over budget: nothing extra
    assert widths(p, mk(0.021)) == {"a": 4, "b": 1}  # under: everything


def test_default_model_is_used_without_one():
    assert parse_policy("taper").model == default_model()
    assert parse_policy("serial").model is None


def test_a_policy_is_frozen_data():
    p = parse_policy("taper-no-backlog", model=MODEL, rho=0.5, utility="concave", fill=True)
    assert (p.rho, p.terms.mean, p.terms.overload, p.terms.backlog, p.replan, p.slack, p.fill) == \
        (0.5, True, True, False, True, True, True)
    assert p == Policy("taper-no-backlog", MODEL, rho=0.5, terms=p.terms, utility=CONCAVE, fill=True)
    assert not parse_policy("taper-paper").terms.any() and not parse_policy("taper-no-replan").replan
    assert parse_policy("cap:3").cap == 3 and parse_policy("eager").cap is None
    with pytest.raises(AttributeError):
        p.rho = 0.9  # type: ignore[misc]
    with pytest.raises(ValueError, match="needs a latency model"):
        Policy("taper", None, rho=0.8)


# ---------------------------------------------------------------- the price of deferral
def _phase_batch(rows: int, slack: float) -> ArrayBatch:
    """One serial request and one phase of `rows` ready branches, short contexts."""
    return ArrayBatch(["s", "p"], np.array([1, rows]), np.full(rows + 1, 100), np.full(2, slack),
                      in_phase=np.array([False, True]), slo_s=np.full(2, 0.05))


def test_a_priced_deferral_runs_only_where_it_shortens_the_step():
    """With a price, a deferring plan is predicted at T(its rows) + the price, and where that is no
    shorter than running every row, every row runs; without one the planner defers as before."""
    from branchwise.taper.planner import PlanOptions, plan_step

    m = LinearLatencyModel(0.010, 1e-3, 0.0)
    a = _phase_batch(8, slack=0.015)  # protected 12 ms, all 19 ms
    assert plan_step(a, m, 0.012).widths.tolist() == [1, 1]
    plan = plan_step(a, m, 0.012, PlanOptions(deferral=(2e-3, 0.5e-3)))  # 12 + 2 + 7 x 0.5 = 17.5 < 19: defers
    assert plan.widths.tolist() == [1, 1] and plan.predicted_s == pytest.approx(0.0175)
    plan = plan_step(a, m, 0.012, PlanOptions(deferral=(3e-3, 0.7e-3)))  # 12 + 3 + 4.9 > 19: all run
    assert plan.widths.tolist() == [1, 8] and plan.notes.get("defer_cost") == 1.0
    assert plan.predicted_s == pytest.approx(0.019)
    # admitting a row saves its cost less the per-row price: 1 ms rows cost the budget 0.5 ms
    plan = plan_step(a, m, 0.0175, PlanOptions(deferral=(1e-3, 0.5e-3)))  # room 1 ms: two rows at 0.5 ms
    deferred = 9 - plan.rows
    assert deferred == 5
    assert plan.predicted_s == pytest.approx(m.predict(plan.rows, 100 * plan.rows) + 1e-3 + 0.5e-3 * deferred)
    assert plan.predicted_s <= 0.0175 + 1e-12


def test_a_deferral_price_given_as_a_function_is_computed_only_when_rows_do_not_all_fit():
    from branchwise.taper.planner import PlanOptions, plan_step

    m = LinearLatencyModel(0.010, 1e-3, 0.0)
    a = _phase_batch(8, slack=0.015)  # protected 12 ms, all 19 ms
    assert plan_step(a, m, 0.020, PlanOptions(deferral=lambda: pytest.fail("priced"))).widths.tolist() == [1, 8]
    assert plan_step(a, m, 0.012, PlanOptions(deferral=lambda: (3e-3, 0.7e-3))).notes.get("defer_cost") == 1.0


def test_taper_prices_a_deferral_over_the_steps_it_is_held():
    """taper holds a deferral for (opportunistic rows' cost / room above the forced rows) steps, at
    least one, and prices it per step held: with no room above the protected rows any measured
    price makes it run every row; with room for all of them the price counts once.
    taper-no-defer-cost (no price term) and a free deferral plan as before."""
    priced = LinearLatencyModel(0.010, 1e-3, 0.0, c_defer=1e-3, c_deferred=0.1e-3)
    free = LinearLatencyModel(0.010, 1e-3, 0.0)
    tight = _phase_batch(8, slack=0.012 / 0.8)  # budget 12 ms = the protected rows: no room
    assert parse_policy("taper", model=free).plan(tight).widths.tolist() == [1, 1]
    assert parse_policy("taper-no-defer-cost", model=priced).plan(tight).widths.tolist() == [1, 1]
    assert parse_policy("taper", model=priced).plan(tight).widths.tolist() == [1, 8]
    roomy = _phase_batch(8, slack=0.0185 / 0.8)  # budget 18.5 ms: room 6.5 ms, opportunistic rows 7 ms
    pol = parse_policy("taper", model=priced)
    budget, floor, _ = pol.budget(roomy)
    assert pol.held_price(roomy, budget, floor) == pytest.approx((1e-3 * 7 / 6.5, 0.1e-3 * 7 / 6.5))


def test_refit_learns_the_price_of_deferral_apart_from_the_floor():
    """Steps that deferred d rows took 0.6 ms + 0.05 ms x d longer: the refit learns that price and
    keeps c0 at the floor of the steps that did not defer (a calibrated model: slopes fixed)."""
    from branchwise.taper.predictor import OnlineRefit

    true = LinearLatencyModel(2e-3, 0.1e-3, 0.0, c_defer=0.6e-3, c_deferred=0.05e-3)
    m = LinearLatencyModel(1e-3, 0.1e-3, 0.0)
    rf = OnlineRefit(m, window=64, every=16, slopes_fixed=True, deferral=True)
    rng = np.random.default_rng(0)
    for i in range(2000):
        rows, d = int(rng.integers(4, 20)), (int(rng.integers(1, 12)) if i % 2 else 0)
        rf.observe(rows, 0, true.predict(rows, 0) + true.deferral_s(d), deferred=d)
    assert m.c0 == pytest.approx(2e-3, rel=0.01)
    assert m.c_defer == pytest.approx(0.6e-3, rel=0.02) and m.c_deferred == pytest.approx(0.05e-3, rel=0.05)
    plain = OnlineRefit(LinearLatencyModel(1e-3, 0.1e-3, 0.0), window=64, every=16, slopes_fixed=True)
    for i in range(2000):
        rows, d = int(rng.integers(4, 20)), (int(rng.integers(1, 12)) if i % 2 else 0)
        plain.observe(rows, 0, true.predict(rows, 0) + true.deferral_s(d), deferred=d)
    assert plain.model.deferral() == (0.0, 0.0)  # without it the price leaks into c0
    assert plain.model.c0 - 2e-3 > 5 * abs(m.c0 - 2e-3)


def test_refit_sees_no_price_in_noise():
    """Where deferring steps cost no more than the others (2% noise on both) the learned price is 0."""
    from branchwise.taper.predictor import OnlineRefit

    m = LinearLatencyModel(2e-3, 0.1e-3, 0.0)
    rf = OnlineRefit(m, window=64, every=16, slopes_fixed=True, deferral=True)
    rng = np.random.default_rng(1)
    for i in range(2000):
        rows, d = int(rng.integers(4, 20)), (int(rng.integers(1, 12)) if i % 2 else 0)
        rf.observe(rows, 0, (2e-3 + 0.1e-3 * rows) * rng.lognormal(0.0, 0.02), deferred=d)
    assert m.deferral() == pytest.approx((0.0, 0.0), abs=2e-6)


def test_refit_finds_a_price_under_heavy_noise_by_accumulating_evidence():
    """Steps that vary by 30% hide a 0.8 ms price in any one 64-step window; over many windows the
    evidence stands out and the price is learned."""
    from branchwise.taper.predictor import OnlineRefit

    m = LinearLatencyModel(2e-3, 0.1e-3, 0.0)
    rf = OnlineRefit(m, window=64, every=16, slopes_fixed=True, deferral=True)
    rng = np.random.default_rng(2)
    for i in range(6000):
        rows, d = int(rng.integers(4, 20)), (int(rng.integers(1, 12)) if i % 2 else 0)
        t = 2e-3 + 0.1e-3 * rows + (0.8e-3 if d else 0.0)
        rf.observe(rows, 0, t * rng.lognormal(-0.045, 0.3), deferred=d)
    assert sum(m.deferral()) == pytest.approx(0.8e-3, rel=0.25)


def test_the_earlier_name_of_taper_still_parses():
    assert parse_policy("taper-defer-cost").name == "taper"
    assert parse_policy("taper-no-defer-cost").terms.defer_cost is False


def _clocked_rows(rng: np.random.Generator, slo: float) -> tuple[list[Row], dict[str, tuple[float, int]]]:
    """Random serial requests and phases, with each key's clock (age of its stage, tokens so far)."""
    rows, clock = [], {}
    for k in range(int(rng.integers(1, 7))):
        key, fan = f"k{k}", int(rng.integers(1, 9))
        rows += [Row(key=key, order=j, ctx=int(rng.integers(1, 4000)), slo_s=slo, in_phase=fan > 1)
                 for j in range(fan)]
        clock[key] = (float(rng.uniform(0.0, 0.4)), int(rng.integers(0, 40)))
    return rows, clock


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 3e-3), st.floats(0.0, 3e-4), st.integers(0, 3))
def test_an_unpriced_step_runs_what_the_plan_would(seed, per_step, per_row, waiting):
    """Where no deferral can pay (Policy.decide's `never`) the controller runs every row without a
    plan; the plan, made anyway, runs every row too, so both controllers choose alike every step."""
    rng = np.random.default_rng(seed)
    slo = 0.02
    model = LinearLatencyModel(4e-3, 2e-4, 1e-7, c_defer=per_step, c_deferred=per_row)
    rows, clock = _clocked_rows(rng, slo)
    fast = StepController(parse_policy("taper", model=model))
    full = StepController(_as(PricedEachStep, parse_policy("taper", model=model)))
    for ctl in (fast, full):
        for key, (age, tokens) in clock.items():
            in_phase = any(r.in_phase for r in rows if r.key == key)
            ctl.on_step_done({key: Delivery(0, slo, in_phase)}, 1.0 - age, 0)
            ctl.on_step_done({key: Delivery(tokens, slo, in_phase)}, 1.0 - age / 2, 0)
    assert fast.select(rows, 1.0, waiting=waiting) == full.select(rows, 1.0, waiting=waiting)
    assert fast.stats.candidates == full.stats.candidates and fast.stats.admitted == full.stats.admitted
    if fast.stats.unpriced_steps:
        assert full.stats.admitted == full.stats.candidates  # the plan ran every row


def test_a_step_no_deferral_can_pay_is_not_planned():
    """Seven opportunistic rows of 0.2 ms each save 1.4 ms at most. A price of 1.5 ms per deferring
    step skips the plan and runs every row; at 0.2 ms the step is planned, and it defers."""
    rows = [Row(key="p", order=j, ctx=0, slo_s=0.005, in_phase=True) for j in range(8)]
    rows.append(Row(key="s", ctx=0, slo_s=0.00625))  # a fresh serial clock: a 5 ms budget
    for per_step, planned, run in ((1.5e-3, 0, 9), (0.2e-3, 1, 3)):
        model = LinearLatencyModel(4e-3, 2e-4, 0.0, c_defer=per_step)
        ctl = StepController(parse_policy("taper", model=model))
        assert len(ctl.select(rows, 0.0)) == run and ctl.stats.planned_steps == planned
        assert ctl.stats.unpriced_steps == 1 - planned
    free = StepController(parse_policy("taper", model=LinearLatencyModel(4e-3, 2e-4, 0.0)))
    free.select(rows, 0.0)
    assert free.stats.planned_steps == 1 and free.stats.unpriced_steps == 0  # no price: always planned


BUDGET_RULES = ["taper", "taper-no-mean", "taper-no-overload", "taper-no-backlog", "taper-no-defer-cost",
                "taper-paper", "taper-no-slack", "taper-no-replan", "taper-const-predictor"]


def _clocked(ctl: StepController, rows: list[Row], clock: dict[str, tuple[float, int]], slo: float) -> None:
    for key, (age, tokens) in clock.items():
        in_phase = any(r.in_phase for r in rows if r.key == key)
        ctl.on_step_done({key: Delivery(0, slo, in_phase)}, 1.0 - age, 0)
        ctl.on_step_done({key: Delivery(tokens, slo, in_phase)}, 1.0 - age / 2, 0)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(BUDGET_RULES), st.floats(0.0, 2e-3), st.integers(0, 3),
       st.booleans())
def test_a_step_that_fits_runs_what_the_plan_would(seed, name, per_step, waiting, bubble):
    """Where the plan would run every ready row (Policy.decide: they all fit the budget, or no
    deferral pays its held price) the controller runs them all without the arrays or the plan; the
    plan, made anyway, runs every row within the same budget and counts the same terms, so both
    controllers choose and count alike every step."""
    rng = np.random.default_rng(seed)
    slo = 0.02
    model = LinearLatencyModel(4e-3, 2e-4, 1e-7, c_defer=per_step, c_deferred=0.1 * per_step)
    rows, clock = _clocked_rows(rng, slo)
    fast = StepController(parse_policy(name, model=model))
    full = StepController(_as(AlwaysPlanned, parse_policy(name, model=model)))
    for ctl in (fast, full):
        _clocked(ctl, rows, clock, slo)
    for step in range(2):  # the second step sees the first one's pins (taper-no-replan)
        now = 1.0 + 0.003 * step
        assert fast.select(rows, now, bubble, waiting=waiting) == full.select(rows, now, bubble, waiting=waiting)
    a, b = fast.stats, full.stats
    assert (a.candidates, a.admitted, a.rows_deferred, a.terms, a.bubble_steps, a.last_budget_s) == \
        (b.candidates, b.admitted, b.rows_deferred, b.terms, b.bubble_steps, b.last_budget_s)
    assert a.last_predicted_s == pytest.approx(b.last_predicted_s, rel=1e-12)
    assert a.planned_steps + a.fit_steps + a.unpriced_steps == b.planned_steps + b.unpriced_steps
    if name in ("taper-no-replan", "taper-const-predictor"):  # plans this does not mirror
        assert a.fit_steps == 0 and a.unpriced_steps == b.unpriced_steps


def test_a_step_whose_deferral_cannot_pay_its_held_price_is_not_planned():
    """A serial request 6 ms from its pace sets a 4.8 ms budget beside a phase of 8 rows (4.4 ms of
    protected rows, 5.8 ms in all). Deferring the 7 opportunistic rows would save 1.4 ms against a
    price of 1 ms for one step, so the step is not unpriced outright; but they would be held 3.5
    steps (their 1.4 ms over the 0.4 ms of room), at 3.5 ms, so the plan runs every row, and so
    does the controller, without planning."""
    model = LinearLatencyModel(4e-3, 2e-4, 0.0, c_defer=1e-3)
    rows = [Row(key="p", order=j, ctx=0, slo_s=0.05, in_phase=True) for j in range(8)]
    rows.append(Row(key="s", ctx=0, slo_s=0.02))
    for skip, planned in ((False, 0), (True, 1)):
        policy = parse_policy("taper", model=model)
        ctl = StepController(_as(AlwaysPlanned, policy) if skip else policy)
        ctl.on_step_done({"s": Delivery(1, 0.02, False)}, 0.0, 1)
        assert len(ctl.select(rows, 0.034)) == 9
        assert (ctl.stats.planned_steps, ctl.stats.unpriced_steps) == (planned, 1 - planned)


def test_a_step_that_fits_is_not_planned():
    """A phase of 8 short rows beside a fresh serial clock: 5.8 ms of rows fit a 16 ms budget and
    run unplanned; at a 5 ms SLO (a 4 ms budget) they do not fit, and the plan decides."""
    model = LinearLatencyModel(4e-3, 2e-4, 0.0)
    for slo, planned, fit in ((0.020, 0, 1), (0.005, 1, 0)):
        rows = [Row(key="p", order=j, ctx=0, slo_s=slo, in_phase=True) for j in range(8)]
        rows.append(Row(key="s", ctx=0, slo_s=slo))
        ctl = StepController(parse_policy("taper", model=model))
        active = ctl.select(rows, 0.0)
        assert (ctl.stats.planned_steps, ctl.stats.fit_steps) == (planned, fit)
        assert (len(active) == 9) == bool(fit) and ctl.stats.admitted == (7 if fit else len(active) - 2)


def test_a_broken_clock_is_never_read_as_room():
    """A NaN clock gives the plan a budget of -inf: only the protected rows run, shortcut or not."""
    model = LinearLatencyModel(4e-3, 2e-4, 0.0)
    rows = [Row(key="p", order=j, ctx=0, slo_s=0.02, in_phase=True) for j in range(4)] + [Row(key="s", ctx=0, slo_s=0.02)]
    for name in ("taper", "taper-paper"):
        ctl = StepController(parse_policy(name, model=model))
        ctl.on_step_done({"s": Delivery(1, 0.02, False)}, float("nan"), 1)
        assert ctl.select(rows, 0.001) == [0, 4] and ctl.stats.fit_steps == 0
