"""Policy parsing and the behaviour of off / cap:K / eager / taper and the ablations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.taper.policies import (
    CONST_REF,
    POLICY_NAMES,
    CapPolicy,
    TaperPolicy,
    parse_policy,
    parse_policy_name,
)
from branchwise.taper.predictor import ConstantLatencyModel, LinearLatencyModel, default_model
from branchwise.taper.state import BatchView, RequestView
from branchwise.taper.utility import CONCAVE

MODEL = LinearLatencyModel(c0=10e-3, c_seq=2e-4, c_ctx=1e-7)

request = st.builds(
    RequestView,
    rid=st.text("abcdef", min_size=1, max_size=4),
    context_lens=st.lists(st.integers(1, 8000), min_size=1, max_size=8).map(tuple),
    slack_s=st.floats(-0.05, 0.2),
)
batches = st.lists(request, min_size=0, max_size=10, unique_by=lambda r: r.rid).map(lambda rs: BatchView(tuple(rs)))


def widths(policy, batch):
    return policy.plan(batch).width


@pytest.mark.parametrize("name", ["off", "eager", "taper", "taper-no-slack", "taper-no-replan",
                                  "taper-const-predictor", "cap:1", "cap:3", " TAPER ", "cap:007"])
def test_parse_valid_names(name):
    policy = parse_policy(name)
    assert policy.name == parse_policy_name(name)
    assert parse_policy_name("cap:007") == "cap:7"


@pytest.mark.parametrize("name", ["", "cap:0", "cap:x", "cap:", "cap:-1", "cap:2.5", "capped:2", "greedy",
                                  "taper-no", "cap:K"])
def test_parse_invalid_names_say_what_is_valid(name):
    with pytest.raises(ValueError, match=r"valid: off, cap:K .*taper-const-predictor"):
        parse_policy(name)


def test_policy_names_cover_the_cli_values():
    assert POLICY_NAMES == ("off", "cap:K", "eager", "taper", "taper-no-mean", "taper-no-overload",
                            "taper-no-backlog", "taper-paper", "taper-no-slack", "taper-no-replan",
                            "taper-const-predictor")


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
def test_off_eager_and_caps(batch, k):
    off = widths(parse_policy("off"), batch)
    eager = widths(parse_policy("eager"), batch)
    cap = widths(parse_policy(f"cap:{k}"), batch)
    for r in batch.requests:
        assert off[r.rid] == 1
        assert eager[r.rid] == r.ready
        assert cap[r.rid] == min(r.ready, k)


@settings(max_examples=30, deadline=None)
@given(batches, st.floats(0.1, 1.0))
def test_taper_between_off_and_eager_and_protected_when_late(batch, rho):
    plan = TaperPolicy("taper", MODEL, rho).plan(batch)
    for r in batch.requests:
        assert 1 <= plan.width[r.rid] <= r.ready
    if batch.requests:
        assert plan.budget_s == pytest.approx(rho * min(r.slack_s for r in batch.requests))
        if min(r.slack_s for r in batch.requests) < 0:  # someone is already late: protected only
            assert plan.rows == len(batch.requests)


@settings(max_examples=30, deadline=None)
@given(batches)
def test_no_slack_admits_every_ready_row(batch):
    plan = parse_policy("taper-no-slack", model=MODEL).plan(batch)
    assert plan.width == {r.rid: r.ready for r in batch.requests}
    assert plan.budget_s == float("inf")


def test_cap_policy_reports_prediction_when_given_a_model():
    batch = BatchView((RequestView("a", (100, 200, 300), 0.1), RequestView("b", (50,), 0.1)))
    plan = CapPolicy("cap:2", 2, MODEL).plan(batch)
    assert plan.width == {"a": 2, "b": 1}
    assert plan.predicted_s == pytest.approx(MODEL.predict(3, 350))
    assert CapPolicy("eager", None).plan(batch).predicted_s == 0.0  # no model: no prediction


def test_taper_widens_with_slack_and_contracts_without():
    lens = (2000,) * 6
    mk = lambda slack: BatchView((RequestView("par", lens, 1.0, phase_id="p", phase_fanout=6),  # noqa: E731
                                  RequestView("ser", (3000,), slack)))
    policy = parse_policy("taper", model=MODEL, rho=0.8)
    loose = policy.plan(mk(0.05))  # budget 40 ms: all 7 rows cost ~12 ms
    tight = policy.plan(mk(0.0149))  # budget 11.92 ms: S0 10.9 ms + two 0.4 ms rows
    late = policy.plan(mk(-0.01))
    assert loose.width["par"] == 6
    assert tight.width == {"par": 3, "ser": 1} and tight.predicted_s <= tight.budget_s
    assert late.width == {"par": 1, "ser": 1}


def test_no_replan_pins_width_at_phase_start_and_holds_it():
    policy = parse_policy("taper-no-replan", model=MODEL, rho=1.0)
    lens = (2000,) * 6
    start = BatchView((RequestView("par", lens, 1.0, phase_id="p", phase_fanout=6),
                       RequestView("ser", (3000,), 0.05)))
    plan = policy.plan(start)
    pins = policy.pins(start, plan)
    assert pins == {"par": 6}  # only phase requests without a stored width; serial ones never
    # later, the budget collapses; the stored width is held (that is the ablation)...
    later = BatchView((RequestView("par", lens[:5], 1.0, phase_id="p", phase_fanout=6, fixed_width=pins["par"]),
                       RequestView("ser", (3000,), -0.01)))
    held = policy.plan(later)
    assert held.width == {"par": 5, "ser": 1}
    assert policy.pins(later, held) == {}
    # ...where replanning taper contracts at once
    assert parse_policy("taper", model=MODEL).plan(later).width == {"par": 1, "ser": 1}
    assert parse_policy("taper", model=MODEL).pins(start, plan) == {}


def test_const_predictor_ablation():
    policy = parse_policy("taper-const-predictor", model=MODEL)
    assert isinstance(policy.model, ConstantLatencyModel)
    assert policy.model.value_s == pytest.approx(MODEL.predict(*CONST_REF))
    assert parse_policy("taper-const-predictor", const_s=0.02).model.value_s == 0.02
    const = ConstantLatencyModel(0.01)
    assert parse_policy("taper-const-predictor", model=const).model is const
    batch = lambda slack: BatchView((RequestView("a", (100,) * 4, slack), RequestView("b", (100,), 1.0)))  # noqa: E731
    p = parse_policy("taper-const-predictor", const_s=0.02, rho=1.0)
    assert p.plan(batch(0.019)).width == {"a": 1, "b": 1}  # constant over budget: nothing extra
    assert p.plan(batch(0.021)).width == {"a": 4, "b": 1}  # under: everything


def test_default_model_is_used_without_one():
    assert parse_policy("taper").model == default_model()
    assert parse_policy("off").model is None
