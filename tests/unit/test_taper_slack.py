"""Slack clocks (serial and parallel-phase TPOT), the batch budget, and the utility curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from branchwise.taper.controller import Delivery, SlackTracker, StepController
from branchwise.taper.planner import ArrayBatch
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel
from branchwise.taper.utility import CONCAVE, LINEAR, PRIORITY, UTILITY_NAMES, parse_utility

SLO = 0.05
MODEL = LinearLatencyModel(c0=1e-3, c_seq=1e-4, c_ctx=0.0)


def phase_clock(slo: float, start: float, tokens: int) -> SlackTracker:
    t = SlackTracker(slo, last_token_s=start)
    t.start_phase(start)
    if tokens:
        t.on_tokens(start, tokens)
    return t


def test_serial_slack_is_time_left_before_the_next_token_is_late():
    t = SlackTracker(SLO, last_token_s=10.0)
    assert t.slack(10.0) == pytest.approx(0.05)
    assert t.slack(10.03) == pytest.approx(0.02)
    assert t.slack(10.07) == pytest.approx(-0.02)
    assert t.gap_slack(10.03) == t.slack(10.03)


def test_phase_slack_keeps_effective_tpot_within_slo():
    # 4 branches delivered 40 tokens in 1.0 s: effective TPOT 25 ms; one more token may take until
    # 41 * 50 ms = 2.05 s after the phase start, i.e. 1.05 s from now.
    s = phase_clock(SLO, 100.0, 40).slack(101.0)
    assert s == pytest.approx(1.05)
    assert (1.0 + s) / 41 == pytest.approx(SLO)
    assert phase_clock(SLO, 100.0, 0).slack(100.0) == pytest.approx(SLO)
    assert phase_clock(SLO, 100.0, 40).gap_slack(101.0) == s  # a phase reads the same either way


@given(st.floats(0.001, 1.0), st.floats(0, 100), st.integers(0, 10_000), st.floats(0, 50))
def test_phase_slack_is_the_largest_step_that_meets_the_slo(slo, elapsed, tokens, frac):
    s = phase_clock(slo, 1000.0, tokens).slack(1000.0 + elapsed)
    assert (elapsed + s) / (tokens + 1) == pytest.approx(slo, rel=1e-6, abs=1e-9)


def test_mean_paced_serial_slack_banks_what_ran_ahead():
    t = SlackTracker(SLO, last_token_s=0.0, mean=True)
    for i in range(1, 5):
        t.on_tokens(i * 0.01)  # 10 ms per token against 50
    assert t.slack(0.05) == pytest.approx(5 * SLO - 0.05)  # the phase form from the stage start
    assert t.gap_slack(0.05) == pytest.approx(SLO - 0.01)  # the paper's per-gap reading


def test_budget_is_rho_times_the_tightest_slack():
    def budget(slacks: list[float], rho: float) -> float:
        n = len(slacks)
        a = ArrayBatch([f"r{i}" for i in range(n)], np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64),
                       np.array(slacks, dtype=np.float64))
        return parse_policy("taper-paper", model=MODEL, rho=rho).budget(a)[0]

    assert budget([0.05, 0.01, 2.0], rho=0.8) == pytest.approx(0.008)
    assert budget([0.05, -0.01], rho=0.5) == pytest.approx(-0.005)
    assert budget([], rho=0.8) == float("inf")
    for rho in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="rho"):
            parse_policy("taper-paper", rho=rho)


def test_tracker_serial_phase_serial():
    t = SlackTracker(SLO, last_token_s=0.0)
    assert t.slack(0.02) == pytest.approx(0.03) and not t.in_phase
    t.on_tokens(0.03)
    assert t.slack(0.04) == pytest.approx(0.04)
    t.start_phase(0.05)
    assert t.in_phase and t.phase_tokens == 0  # no effective TPOT before the phase's first token
    t.on_tokens(0.07, tokens=3)  # three branches delivered a token each
    assert t.phase_tokens == 3
    assert t.slack(0.08) == pytest.approx(4 * SLO - 0.03)
    assert (0.08 - t.phase_start_s) / t.phase_tokens == pytest.approx(0.01)  # effective TPOT so far
    # after the reduce the request's serial rows carry their own key: a fresh clock from the reduce
    ctl = StepController(parse_policy("taper-paper", model=MODEL))
    ctl.on_step_done({"rid:a": Delivery(0, SLO, False)}, 0.10, 0)
    assert not ctl.trackers["rid:a"].in_phase and ctl.trackers["rid:a"].slack(0.12) == pytest.approx(0.03)


def test_utilities():
    assert parse_utility("linear") is LINEAR and parse_utility(" Concave ") is CONCAVE
    assert parse_utility(PRIORITY) is PRIORITY
    assert UTILITY_NAMES == ("linear", "concave", "priority")
    with pytest.raises(ValueError, match="valid: linear, concave, priority"):
        parse_utility("sqrt")
    gains = CONCAVE.table(12)[1:13]
    assert all(a > b > 0 for a, b in zip(gains, gains[1:], strict=False))
    assert sum(gains[:3]) == pytest.approx(math.log1p(3))
    assert set(LINEAR.table(5)[1:6]) == {1.0} and PRIORITY.weighted and not LINEAR.weighted


def test_utility_tables_are_read_only_and_any_width_is_served():
    table = CONCAVE.table(8)
    with pytest.raises(ValueError):
        table[1] = 5.0
    wide = CONCAVE.table(1000)
    assert len(wide) == 1001 and wide[1000] == pytest.approx(math.log1p(1000) - math.log1p(999))
    assert np.array_equal(CONCAVE.table(8), table) and wide[:len(table)].tolist() == table.tolist()
