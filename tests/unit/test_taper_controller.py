"""The scheduler-facing controller: rows in, active rows out (pure; the scheduler hook wraps it)."""

from __future__ import annotations

from branchwise.taper.controller import Delivery, Row, StepController
from branchwise.taper.policies import parse_policy
from branchwise.taper.predictor import LinearLatencyModel, OnlineRefit

MODEL = LinearLatencyModel(c0=2e-3, c_seq=1e-3, c_ctx=0.0)


def rows(phases: int = 2, fanout: int = 4, serial: int = 2, slo_s: float = 0.05) -> list[Row]:
    out = [Row(key=f"ph{p}", order=b, ctx=100, slo_s=slo_s, in_phase=True) for p in range(phases) for b in range(fanout)]
    return out + [Row(key=f"r{i}", ctx=100, slo_s=slo_s) for i in range(serial)]


def keys(rs: list[Row], active: list[int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in active:
        out[rs[i].key] = out.get(rs[i].key, 0) + 1
    return out


def test_serial_runs_one_row_per_request_and_eager_runs_all():
    rs = rows()
    serial = StepController(parse_policy("serial", model=MODEL)).select(rs, 0.0)
    assert keys(rs, serial) == {"ph0": 1, "ph1": 1, "r0": 1, "r1": 1}
    assert [rs[i].order for i in serial if rs[i].in_phase] == [0, 0]  # lowest branch index first
    assert StepController(parse_policy("eager", model=MODEL)).select(rs, 0.0) == list(range(len(rs)))


def test_forced_rows_always_run():
    rs = rows(phases=1, serial=0)
    rs[3] = Row(key="ph0", order=3, ctx=100, slo_s=0.05, in_phase=True, forced=True)  # abort pending
    active = StepController(parse_policy("serial", model=MODEL)).select(rs, 0.0)
    assert active == [0, 3]


def test_taper_paper_width_follows_slack():
    rs = rows()
    ctl = StepController(parse_policy("taper-paper", model=MODEL, rho=0.8))
    wide = keys(rs, ctl.select(rs, 0.0))  # fresh requests: full SLO of slack (40 ms budget)
    assert wide == {"ph0": 4, "ph1": 4, "r0": 1, "r1": 1}
    ctl.on_step_done({"r0": Delivery(1, 0.05, False)}, 0.0, 1)
    tight = keys(rs, ctl.select(rs, 0.046))  # r0 last delivered 46 ms ago: 4 ms slack, 3.2 ms budget
    assert tight == {"ph0": 1, "ph1": 1, "r0": 1, "r1": 1}
    assert ctl.stats.candidates == 12 and ctl.stats.admitted == 6 and ctl.stats.rows_deferred == 6


def test_pipeline_bubble_reserves_the_next_protected_step():
    """After a prefill under overlap, the next delivery also waits for the following step: the
    planner gets each slack minus T(S0) (here 4 requests: 2 ms + 4 x 1 ms = 6 ms)."""
    rs = rows()
    plain, bubbled = (StepController(parse_policy("taper-paper", model=MODEL, rho=0.8)) for _ in range(2))
    for ctl in (plain, bubbled):
        ctl.on_step_done({"r0": Delivery(1, 0.05, False)}, 0.0, 1)
    # r0: 14 ms of slack -> budget 11.2 ms -> 9 rows; with the reserve: 8 ms -> 6.4 ms -> 4 rows
    assert len(plain.select(rs, 0.036)) == 9 and plain.stats.bubble_steps == 0
    assert keys(rs, bubbled.select(rs, 0.036, bubble=True)) == {"ph0": 1, "ph1": 1, "r0": 1, "r1": 1}
    assert bubbled.stats.bubble_steps == 1


def test_no_planning_when_every_request_has_one_row():
    ctl = StepController(parse_policy("serial", model=MODEL))
    rs = rows(phases=0, serial=5)
    assert ctl.select(rs, 0.0) == list(range(5)) and ctl.stats.planned_steps == 0


def test_no_replan_holds_width_fixed_at_phase_start():
    rs = rows(phases=1, serial=1)
    ctl = StepController(parse_policy("taper-no-replan", model=MODEL))
    assert keys(rs, ctl.select(rs, 0.0))["ph0"] == 4
    ctl.on_step_done({"r0": Delivery(1, 0.05, False)}, 0.0, 1)
    assert keys(rs, ctl.select(rs, 0.046))["ph0"] == 4  # a replanning taper would contract here


def test_latency_feeds_online_refit_and_forget_drops_state():
    model = LinearLatencyModel(c0=1e-3, c_seq=1e-3, c_ctx=0.0)
    ctl = StepController(parse_policy("taper", model=model), OnlineRefit(model, every=10, min_samples=10))
    for i in range(40):
        ctl.on_latency(1 + i % 8, 100 * (1 + i % 8) + 37 * (i % 3), 5e-3 + 2e-3 * (1 + i % 8))
    assert model.c_seq > 1e-3  # moved toward the realized 2 ms/row
    ctl.on_step_done({"a": Delivery(1, 0.05, False), "b": Delivery(2, 0.05, True)}, 0.0, 3)
    ctl.forget({"a"})
    assert set(ctl.trackers) == {"a"}


def test_on_latency_hands_the_deferred_rows_to_the_refit():
    """The scheduler hook reports each step's deferred rows; the refit must receive them (else a
    live server never learns the price of deferring)."""
    seen: list[int] = []

    class Refit:
        def observe(self, n_rows: int, ctx: int, latency_s: float, *, deferred: int = 0) -> bool:
            seen.append(deferred)
            return False

    ctl = StepController(parse_policy("taper", model=LinearLatencyModel(1e-3, 1e-4, 1e-7)), Refit())
    ctl.on_latency(4, 400, 2e-3, 3)
    ctl.on_latency(4, 400, 2e-3)
    assert seen == [3, 0]
