"""taper's terms (policies.py): the SLO-matched budget, the overload rule and the backlog term,
against taper-paper on the situation where the paper's rule traps itself; the controller's key
lifetime and its planner-error path."""

from __future__ import annotations

import numpy as np
import pytest

from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.planner import ArrayBatch, StepPlan
from branchwise.taper.policies import Policy, parse_policy
from branchwise.taper.predictor import LinearLatencyModel

SLO = 0.016
# the 2-core CPU box of the rate-2.1 run: 4.5 ms before the first row, 0.35 ms per row
CPU = LinearLatencyModel(c0=4.5e-3, c_seq=3.5e-4, c_ctx=0.0)


def trapped(ctl: StepController, serial: int = 24, phases: int = 8, fanout: int = 4,
            step_s: float = 0.015, steps: int = 20) -> tuple[list[Row], float]:
    """`steps` steps at `step_s` each (just inside the 16 ms SLO): every serial request got a token
    per step, every phase ran one branch per step (what taper-paper does once protected rows fill
    its budget). Returns the live rows and the time of the next plan (one more step later)."""
    rows = [Row(key=f"s{i}", ctx=300, slo_s=SLO) for i in range(serial)]
    rows += [Row(key=f"p{p}", order=b, ctx=300, slo_s=SLO, in_phase=True) for p in range(phases) for b in range(fanout)]
    t = 0.0
    ctl.on_step_done({r.key: Delivery(0, SLO, r.in_phase) for r in rows}, t, 0)  # clocks start (first tokens)
    for _ in range(steps):
        t += step_s
        ctl.on_step_done({r.key: Delivery(1, SLO, r.in_phase) for r in rows if r.order == 0}, t, serial + phases)
    return rows, t + step_s


def width(plan: StepPlan) -> dict[str, int]:
    return dict(zip(plan.rids, plan.widths.tolist(), strict=True))


def widths(rows: list[Row], active: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in active:
        out[rows[i].key] = out.get(rows[i].key, 0) + 1
    return out


@pytest.mark.parametrize("step_s, serial", [(0.015, 14), (0.018, 24)])
def test_rate_2_1_trap_taper_paper_admits_nothing_taper_admits(step_s, serial):
    """Protected rows alone exceed taper-paper's budget (0.8 x the per-gap slack left one step after
    the last token), with requests queued: the paper's rule runs one row per request and the phases
    live on. 14 serial requests at 15 ms steps: every request ran a little ahead of its pace, but
    with a queue that bank stays its margin (per-gap slack, 1 ms); no deferral keeps the serial
    requests within it, so they bound the step at their pace (12.8 ms), where the protected rows
    (12.2 ms) leave room for a branch row. 24 serial requests at 18 ms steps (the trap's growing steps; protected rows 15.7 ms): every
    request is behind, no deferral saves any of them, and the late phases take the rows their own
    targets need."""
    paper = StepController(parse_policy("taper-paper", model=CPU))
    rows, now = trapped(paper, serial=serial, step_s=step_s)
    active = paper.select(rows, now, waiting=5)
    assert widths(rows, active) == {r.key: 1 for r in rows}
    assert paper.stats.candidates == 24 and paper.stats.admitted == 0

    taper = StepController(parse_policy("taper", model=CPU))
    rows, now = trapped(taper, serial=serial, step_s=step_s)
    active = taper.select(rows, now, waiting=5)
    w = widths(rows, active)
    assert all(w[f"s{i}"] == 1 for i in range(serial))
    assert 0 < taper.stats.admitted <= taper.stats.candidates == 24
    if step_s == 0.015:  # within the budget it computed
        assert CPU.predict(len(active), 300 * len(active)) <= taper.stats.last_budget_s
    else:  # every phase at full width: they finish in a quarter of the steps
        assert all(w[f"p{p}"] == 4 for p in range(8))


def test_bank_is_not_lent_once_protected_rows_exceed_the_pace():
    """24 serial requests at 15 ms steps: protected rows (15.7 ms) beyond the pace (12.8 ms). The
    requests are ahead of their pace, but that bank stays their margin: taper reads serial slack per
    gap (1 ms left) and, with the phases on pace, defers like the paper."""
    taper = StepController(parse_policy("taper", model=CPU))
    rows, now = trapped(taper, serial=24, step_s=0.015)
    assert taper.trackers["s0"].slack(now) == pytest.approx(21 * SLO - 0.315)  # the bank
    active = taper.select(rows, now, waiting=5)
    assert taper.stats.admitted == 0 and len(active) == 32
    assert taper.stats.terms == {"per_gap": 1, "overload": 1}  # overload: serial requests at pace


def test_bank_is_not_lent_while_requests_queue():
    """14 serial requests at 10 ms steps, well ahead of their 16 ms pace; protected rows (12.2 ms)
    fit the pace. Without a queue taper lends the bank (0.8 x 126 ms) and runs every branch row;
    with one, the engine has no lighter steps ahead to win the bank back: serial slack is read per
    gap and the budget is the SLO pace, 0.8 x 16 ms, room for one branch row."""
    for waiting, admitted in ((0, 24), (5, 1)):
        taper = StepController(parse_policy("taper", model=CPU))
        rows, now = trapped(taper, serial=14, step_s=0.010)
        taper.select(rows, now, waiting=waiting)
        assert taper.stats.admitted == admitted
        if waiting:
            assert taper.stats.last_budget_s == pytest.approx(0.8 * SLO)
            assert "per_gap" in taper.stats.terms
        else:
            assert taper.stats.last_budget_s == pytest.approx(0.8 * (21 * SLO - 0.210)) and not taper.stats.terms


def test_overload_rule_bounds_late_requests_at_their_pace():
    """One serial request is already late (its budget, 0.8 x 2 ms, is below the protected rows'
    10.4 ms): no deferral saves it this step. taper-no-overload keeps its budget and admits nothing;
    taper lets the others set the budget and bounds the late one at its pace, 0.8 x slo."""
    n_ser, fan = 10, 6
    a = ArrayBatch(
        [f"s{i}" for i in range(n_ser)] + ["p"],
        np.array([1] * n_ser + [fan], np.int64), np.full(n_ser + fan, 100, np.int64),
        np.array([0.002] + [0.030] * (n_ser - 1) + [0.030]), None,
        np.array([False] * n_ser + [True]), None, 0, np.full(n_ser + 1, 0.016), 0)
    model = LinearLatencyModel(c0=6e-3, c_seq=4e-4, c_ctx=0.0)
    no = parse_policy("taper-no-overload", model=model).plan(a)
    yes = parse_policy("taper", model=model).plan(a)
    assert width(no)["p"] == 1 and "overload" not in no.notes
    assert yes.notes.get("overload") == 1.0 and yes.budget_s == pytest.approx(0.8 * 0.016)
    assert width(yes)["p"] == fan and yes.predicted_s <= yes.budget_s  # 6 + 15 x 0.4 = 12 ms


def test_backlog_term_keeps_the_budget_at_the_slo_pace():
    """Serial requests with 6 ms of slack: budget 4.8 ms, room for two branch rows beyond the
    protected 3.5 ms. Without a queue taper defers the rest (the engine catches up later); with
    one, the budget is the SLO pace (0.8 x 16 ms) and every row runs."""
    n_ser, fan = 4, 8
    a = dict(rids=[f"s{i}" for i in range(n_ser)] + ["p"], ready=np.array([1] * n_ser + [fan], np.int64),
             ctx=np.full(n_ser + fan, 100, np.int64), slack_s=np.array([0.006] * n_ser + [0.1]),
             in_phase=np.array([False] * n_ser + [True]), slo_s=np.full(n_ser + 1, 0.016))
    model = LinearLatencyModel(c0=1e-3, c_seq=5e-4, c_ctx=0.0)  # protected: 3.5 ms
    idle = parse_policy("taper", model=model).plan(ArrayBatch(**a, waiting=0))
    assert width(idle)["p"] == 3 and not idle.notes.keys() & {"backlog", "overload"}
    queued = parse_policy("taper", model=model).plan(ArrayBatch(**a, waiting=3))
    unqueued = parse_policy("taper-no-backlog", model=model).plan(ArrayBatch(**a, waiting=3))
    assert queued.notes.get("backlog") == 1.0 and queued.budget_s == pytest.approx(0.8 * 0.016)
    assert width(queued)["p"] == fan and width(unqueued)["p"] == 3


def test_late_phase_is_widened_not_deferred():
    """A phase behind its effective-TPOT target gains slo of slack per own row: taper gives it the
    rows its own bound needs even when the serial requests' budget is small; taper-paper defers."""
    a = ArrayBatch(["s", "p"], np.array([1, 4], np.int64), np.full(5, 100, np.int64),
                   np.array([0.012, -0.010]), None, np.array([False, True]), None, 0,
                   np.full(2, 0.016), 0)
    model = LinearLatencyModel(c0=2e-3, c_seq=5e-4, c_ctx=0.0)
    assert width(parse_policy("taper-paper", model=model).plan(a))["p"] == 1
    plan = parse_policy("taper-no-overload", model=model).plan(a)
    # budget 0.8 x min(12 ms, -10 + 3 x 16 = 38 ms) = 9.6 ms; own bound at 9.6 ms needs 2 more rows
    assert plan.budget_s == pytest.approx(0.8 * 0.012) and width(plan)["p"] >= 3


def test_taper_is_the_paper_rule_with_plentiful_slack_or_without_slo():
    a = dict(rids=["s", "p"], ready=np.array([1, 4], np.int64), ctx=np.full(5, 100, np.int64),
             slack_s=np.array([0.05, 0.05]), in_phase=np.array([False, True]))
    model = LinearLatencyModel(c0=2e-3, c_seq=5e-4, c_ctx=0.0)
    for extra in ({}, {"slo_s": np.full(2, 0.05)}):
        got = parse_policy("taper", model=model).plan(ArrayBatch(**a, **extra))
        assert width(got) == width(parse_policy("taper-paper", model=model).plan(ArrayBatch(**a, **extra)))
        assert width(got)["p"] == 4


def test_stage_mean_slack_banks_a_fast_stage():
    ctl = StepController(parse_policy("taper", model=CPU))
    ctl.on_step_done({"s": Delivery(0, SLO, False)}, 0.0, 0)
    for i in range(1, 11):
        ctl.on_step_done({"s": Delivery(1, SLO, False)}, i * 0.010, 1)  # 10 ms per token against 16
    assert ctl.trackers["s"].slack(0.100) == pytest.approx(11 * SLO - 0.100)
    paper = StepController(parse_policy("taper-paper", model=CPU))
    paper.on_step_done({"s": Delivery(0, SLO, False)}, 0.0, 0)
    paper.on_step_done({"s": Delivery(1, SLO, False)}, 0.1, 1)
    assert paper.trackers["s"].slack(0.1) == pytest.approx(SLO)


@pytest.mark.parametrize("policy", ["eager", "taper", "taper-no-replan", "serial"])
def test_keys_leave_with_their_last_row(policy):
    """10,000 short phases (two branches, two steps each) beside a serial request: the hook reports
    each key whose last row finished, and the controller's dicts return to empty."""
    ctl = StepController(parse_policy(policy, model=CPU))
    t = 0.0
    for p in range(10_000):
        key = f"ph{p % 97}"  # phase ids are reused: a reused id must start a fresh clock
        rows = [Row(key=key, ctx=50, slo_s=SLO, in_phase=True), Row(key=key, order=1, ctx=50, slo_s=SLO, in_phase=True),
                Row(key=f"r{p}", ctx=50, slo_s=SLO)]
        for _ in range(2):
            active = ctl.select(rows, t)
            t += 0.005
            ctl.on_step_done({rows[i].key: Delivery(1, SLO, rows[i].in_phase) for i in active}, t, len(active))
        if p == 0:
            assert set(ctl.trackers) == {key, "r0"}
        ctl.on_finished([key, f"r{p}"])
        assert not ctl.trackers and not ctl.fixed
    assert ctl.stats.planned_steps + ctl.stats.fit_steps == 20_000  # every step had a candidate


class BrokenModel:
    def predict(self, n_seqs: int, ctx_tokens: int, extra_tokens: int = 0) -> float:
        raise RuntimeError("planner bug")

    def row_costs(self, ctx_lens):
        raise RuntimeError("planner bug")


def test_planner_error_runs_every_row_and_logs_once(caplog):
    ctl = StepController(Policy("broken", BrokenModel(), rho=0.8))  # type: ignore[arg-type]
    rows = [Row(key="p", order=b, ctx=10, slo_s=SLO, in_phase=True) for b in range(3)] + [Row(key="s", ctx=10, slo_s=SLO)]
    with caplog.at_level("ERROR", logger="branchwise"):
        for i in range(3):
            assert ctl.select(rows, 0.01 * i) == [0, 1, 2, 3]
    assert ctl.stats.planner_errors == 3
    assert sum("TAPER planning failed" in r.getMessage() for r in caplog.records) == 1
