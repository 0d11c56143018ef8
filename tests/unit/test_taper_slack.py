"""Slack formulas (serial and parallel-phase TPOT) and the batch budget."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from branchwise.taper.slack import SlackTracker, phase_slack, serial_slack, slack_budget
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, UTILITY_NAMES, parse_utility

SLO = 0.05


def test_serial_slack_is_time_left_before_the_next_token_is_late():
    assert serial_slack(SLO, now_s=10.0, last_token_s=10.0) == pytest.approx(0.05)
    assert serial_slack(SLO, now_s=10.03, last_token_s=10.0) == pytest.approx(0.02)
    assert serial_slack(SLO, now_s=10.07, last_token_s=10.0) == pytest.approx(-0.02)


def test_phase_slack_keeps_effective_tpot_within_slo():
    # 4 branches delivered 40 tokens in 1.0 s: effective TPOT 25 ms; one more token may take until
    # 41 * 50 ms = 2.05 s after the phase start, i.e. 1.05 s from now.
    s = phase_slack(SLO, now_s=101.0, phase_start_s=100.0, tokens_in_phase=40)
    assert s == pytest.approx(1.05)
    assert (1.0 + s) / 41 == pytest.approx(SLO)
    assert phase_slack(SLO, now_s=100.0, phase_start_s=100.0, tokens_in_phase=0) == pytest.approx(SLO)


@given(st.floats(0.001, 1.0), st.floats(0, 100), st.integers(0, 10_000), st.floats(0, 50))
def test_phase_slack_is_the_largest_step_that_meets_the_slo(slo, elapsed, tokens, frac):
    s = phase_slack(slo, now_s=1000.0 + elapsed, phase_start_s=1000.0, tokens_in_phase=tokens)
    assert (elapsed + s) / (tokens + 1) == pytest.approx(slo, rel=1e-6, abs=1e-9)


def test_budget_is_rho_times_the_tightest_slack():
    assert slack_budget([0.05, 0.01, 2.0], rho=0.8) == pytest.approx(0.008)
    assert slack_budget([0.05, -0.01], rho=0.5) == pytest.approx(-0.005)
    assert slack_budget([], rho=0.8) == float("inf")
    for rho in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="rho"):
            slack_budget([0.1], rho=rho)


def test_tracker_serial_phase_serial():
    t = SlackTracker(SLO, last_token_s=0.0)
    assert t.slack(0.02) == pytest.approx(0.03) and not t.in_phase
    t.on_tokens(0.03)
    assert t.slack(0.04) == pytest.approx(0.04)
    t.start_phase(0.05)
    assert t.in_phase and t.effective_tpot(0.06) is None
    t.on_tokens(0.07, n=3)  # three branches delivered a token each
    assert t.phase_tokens == 3
    assert t.slack(0.08) == pytest.approx(4 * SLO - 0.03)
    assert t.effective_tpot(0.08) == pytest.approx(0.01)
    t.end_phase(0.10)
    assert not t.in_phase and t.slack(0.12) == pytest.approx(0.03)


def test_utilities():
    assert parse_utility("linear") is LINEAR and parse_utility(" Concave ") is CONCAVE
    assert parse_utility(PRIORITY) is PRIORITY
    assert UTILITY_NAMES == ("linear", "concave", "priority")
    with pytest.raises(ValueError, match="valid: linear, concave, priority"):
        parse_utility("sqrt")
    gains = CONCAVE.table(12)[1:13]
    assert all(a > b > 0 for a, b in zip(gains, gains[1:], strict=False))
    assert sum(gains[:3]) == pytest.approx(__import__("math").log1p(3))
    assert set(LINEAR.table(5)[1:6]) == {1.0} and PRIORITY.weighted and not LINEAR.weighted
