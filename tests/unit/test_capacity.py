"""bench.capacity: the grid rule, bisection, capacity.json's schema, the acceptance verdict."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import bench.capacity as cap
from bench.bound import fluid_bound_rps, request_work_s
from bench.capacity import Engine, bracket, grid, holds, measure, verdict
from bench.engine import EngineConfig, Simulator, build_controller
from bench.metrics import POINT_KEYS
from bench.workload import RequestSpec, compose, load_trace, stationary_schedule
from branchwise.taper import LinearLatencyModel, default_model

AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"


def _fake(capacity: dict[str, float], calls: list | None = None, latency: dict[str, float] | None = None) -> Engine:
    """Attainment 1.0 below a policy's capacity (seed 1 a little lower), 0.5 above; decomposable P50
    end to end latency[policy] x (1 + rate)."""

    def point(policy: str, rate: float, seed: int) -> dict:
        if calls is not None:
            calls.append((policy, rate, seed))
        ok = rate <= capacity[policy] - 0.05 * seed
        e2e = (latency or {}).get(policy, 10.0) * (1 + rate)
        return {"rate": rate, "goodput_tok_s": 1000 * rate if ok else 100.0, "attainment": 1.0 if ok else 0.5,
                "finished_frac": 1.0, "p99_ttft_s": 0.2, "decomp_e2e_p50_s": e2e, "decomp_e2e_p99_s": 2 * e2e,
                "serial_e2e_p50_s": 1.0}

    return Engine("fake", point, 1.0)


def test_bracket_needs_every_rate_below_to_hold() -> None:
    assert bracket([1, 2, 3], [True, True, False]) == (2, 3)
    assert bracket([1, 2, 3], [True, False, True]) == (1, 2)  # a later recovery does not count
    assert bracket([1, 2, 3], [False, True, True]) == (0.0, 1)
    assert bracket([1, 2, 3], [True, True, True]) == (3, None)


def test_a_point_holds_on_attainment_at_a_load_it_sustained() -> None:
    assert holds({"attainment": 0.95}) and not holds({"attainment": 0.94})
    assert not holds({"attainment": None})  # no arrivals measured: not held
    assert holds({"attainment": 1.0, "queue_growth": 0.05})
    assert not holds({"attainment": 1.0, "queue_growth": 0.06})  # the queue outgrew the window
    assert holds({"attainment": 1.0, "queue_growth": None})  # a live point: no steady-state figure


def test_a_growing_queue_ends_a_capacity_that_attainment_alone_would_not() -> None:
    """Every point meets its SLO, but above 0.6 req/s the admission queue grows by a tenth of the
    window's arrivals: the capacity is the last rate the point sustained."""

    def point(policy: str, rate: float, seed: int) -> dict:
        return {"rate": rate, "attainment": 1.0, "queue_growth": 0.1 if rate > 0.6 else 0.0}

    res = measure(Engine("fake", point, 1.0), ["taper"], [0], log=lambda _: None)
    step = (cap.GRID[1] - cap.GRID[0]) / 2 ** cap.BISECT_STEPS
    assert 0.6 - step - 1e-9 <= res["capacity"]["policies"]["taper"]["capacity_rps"] <= 0.6


def test_a_simulated_point_reports_its_queue_growth() -> None:
    opts = cap.parse_args(["--trace", str(AZURE), "--policies", "serial", "--slo-tpot-ms", "50",
                           "--max-running", "4", "--out", "unused"])
    engine = cap.sim_engine(opts)
    low, high = (engine.point("serial", rate, 0) for rate in (0.02, 2.0))
    assert low["queue_growth"] == 0.0 and holds(low)
    assert high["queue_growth"] > 0.5 and not holds(high)  # four running, the rest queue


def test_capacity_by_bisection_per_seed_and_the_exact_schema() -> None:
    calls: list = []
    res = measure(_fake({"serial": 0.62, "taper": 0.81}, calls), ["serial", "taper"], [0, 1], log=lambda _: None)
    doc = res["capacity"]
    assert set(doc) == {"fluid_bound_rps", "policies"} and set(doc["policies"]) == {"serial", "taper"}
    step = (cap.GRID[1] - cap.GRID[0]) / 2 ** cap.BISECT_STEPS  # bisection resolution at base 1.0
    for pol, c in (("serial", 0.62), ("taper", 0.81)):
        v = doc["policies"][pol]
        assert set(v) == {"capacity_rps", "capacity_spread", "capacity_of_bound", "points"}
        assert [p["rate"] for p in v["points"]] == grid(1.0)
        assert all(set(p) == {*POINT_KEYS, "queue_growth"} for p in v["points"])
        assert {"decomp_e2e_p50_s", "decomp_e2e_p99_s", "serial_e2e_p50_s"} <= set(v["points"][0])
        per_seed = res["detail"][pol]["capacity_per_seed"]
        for seed, got in per_seed.items():
            true = c - 0.05 * int(seed)
            assert true - step - 1e-9 <= got <= true  # within one bisection step below the truth
            assert res["per_seed"][int(seed)]["policies"][pol]["capacity_rps"] == got
        assert v["capacity_spread"] == pytest.approx(max(per_seed.values()) - min(per_seed.values()))
    assert len(calls) == 2 * 2 * len(cap.GRID) + 2 * 2 * cap.BISECT_STEPS
    grid_calls = calls[:2 * 2 * len(cap.GRID)]  # per seed, ascending rates, the policies' order rotated
    assert [c[2] for c in grid_calls] == sorted(c[2] for c in grid_calls)
    assert [c[0] for c in grid_calls[:4]] == ["serial", "taper", "taper", "serial"]


def test_given_rates_replace_the_grid_without_bisection() -> None:
    calls: list = []
    res = measure(_fake({"serial": 0.62}, calls), ["serial"], [0], log=lambda _: None, rates=[0.3, 0.6, 0.9], bisect_steps=0)
    assert [c[1] for c in calls] == [0.3, 0.6, 0.9] and res["capacity"]["policies"]["serial"]["capacity_rps"] == 0.6


def test_two_axis_verdict() -> None:
    """(a) taper's capacity >= every other; (b) wherever a fixed policy holds, taper holds and its
    decomposable P50 end to end is within 1.05x the lowest among the policies that hold."""
    caps = {"serial": 0.62, "eager": 0.5, "taper": 0.81}

    def judge(latency: dict[str, float], capacity: dict[str, float] = caps) -> cap.Verdict:
        doc = measure(_fake(capacity, latency=latency), list(capacity), [0], log=lambda _: None)["capacity"]
        v = verdict(doc)
        assert v is not None
        return v

    v = judge({"serial": 50.0, "eager": 35.0, "taper": 36.0})  # 1.03x eager's where eager holds
    assert v.passed and not v.above and [c.applies for c in v.latency] == [True] * 3 + [False] * 4
    assert [c.frontier for c in v.latency[:3]] == ["eager", "eager", "taper"]  # eager fails at 0.55
    assert "verdict" in v.lines(1.0)[-1] and "PASS" in v.lines(1.0)[-1]
    v = judge({"serial": 50.0, "eager": 35.0, "taper": 37.0})  # 1.06x: fails where eager holds, not above
    assert not v.passed and [c.ok for c in v.latency] == [False] * 2 + [True] * 5
    v = judge({"serial": 50.0, "eager": 35.0, "taper": 36.0}, caps | {"serial": 0.9})
    assert not v.passed and v.above == ("serial",)  # (a), and (b) at 0.85 where serial holds and taper not
    assert not v.latency[4].ok and v.latency[4].mine_attainment == 0.5
    assert v.over_bound == () and v.spans
    v = judge({"serial": 50.0, "eager": 35.0, "taper": 36.0}, caps | {"serial": 1.2})
    assert v.over_bound == ("serial",) and not v.spans  # holds at every rate: the bound cannot be right


@pytest.mark.parametrize("policy", ["serial", "eager"])
def test_fluid_bound_is_the_simulators_own_step_work_summed(policy: str) -> None:
    """Brute force: run a composed workload through the simulator (no noise, nothing retracted) and
    sum what its steps cost beyond c0; the bound's per-request work must add up to exactly that, at
    any width (eager runs the same tokens at other widths than serial)."""
    m = default_model()
    trace = load_trace(AZURE)
    specs = compose(trace, stationary_schedule(trace, 0.05, 1500.0, 3), "multiverse", 3)
    res = Simulator(specs, build_controller(policy, m), m, EngineConfig(noise=0.0), 1e6, 0).run()
    assert all(r.finished for r in res.records) and res.stats["retractions"] == 0
    steps = res.steps.arrays()
    brute = steps["latency_s"].sum() - m.c0 * steps["count"].sum()
    assert sum(request_work_s(s, m) for s in specs) == pytest.approx(brute, rel=1e-9)
    lam = fluid_bound_rps(m, 0.05, specs)
    assert lam == pytest.approx((1 - m.c0 / 0.05) / (brute / len(specs)), rel=1e-9)


def test_fluid_bound_prices_each_token_at_its_own_context() -> None:
    """A branch decodes on the shared prefix plus its own tokens, the parent resumes with all of them:
    prompt 10, serial 3 (the first token from the prefill), branches 2 and 4, serial 2."""
    m = LinearLatencyModel(c0=0.01, c_seq=1.0, c_ctx=0.001, c_tok=0.1)
    spec = RequestSpec("r", 0.0, 10, (3, (2, 4), 2))
    contexts = [11, 12] + [13, 14] + [13, 14, 15, 16] + [19, 20]
    assert request_work_s(spec, m) == pytest.approx(10 * 0.1 + len(contexts) + 0.001 * sum(contexts))
    assert fluid_bound_rps(m, 0.05, [spec]) == pytest.approx(0.8 / request_work_s(spec, m))
    assert fluid_bound_rps(m, 0.01, [spec]) == 0.0  # no step fits the SLO


def test_cli_rejects_what_no_engine_can_run(tmp_path: Path, capsys) -> None:
    assert cap.main(["--trace", str(AZURE), "--engine", "replay", "--url", "http://x", "--out", str(tmp_path)]) == 2
    assert "one policy" in capsys.readouterr().err  # a running server has one policy
    assert cap.main(["--trace", str(AZURE), "--engine", "replay", "--out", str(tmp_path)]) == 2
    assert "needs --launch or --url" in capsys.readouterr().err
    assert cap.main(["--trace", str(AZURE), "--policies", "serial,wide", "--out", str(tmp_path)]) == 2


def test_cli_on_the_simulator(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cap, "GRID", (0.3, 1.3))
    monkeypatch.setattr(cap, "BISECT_STEPS", 1)
    monkeypatch.setattr(cap, "WARMUP_S", 30.0)
    monkeypatch.setattr(cap, "WINDOW_S", 60.0)
    monkeypatch.setattr(cap, "DRAIN_S", 60.0)
    rc = cap.main(["--trace", str(AZURE), "--policies", "serial,eager,taper", "--seeds", "0", "--jobs", "1",
                   "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "capacity.json").read_text())
    assert list(doc) == ["fluid_bound_rps", "policies"] and list(doc["policies"]) == ["serial", "eager", "taper"]
    for v in doc["policies"].values():
        lo, hi = (p["attainment"] for p in v["points"])
        assert lo > hi and hi < 0.95  # 1.3x the fluid bound overloads every policy
        assert 0 <= v["capacity_rps"] < v["points"][1]["rate"]
    detail = json.loads((tmp_path / "capacity_detail.json").read_text())
    assert detail["config"]["fluid_bound_rps"] == doc["fluid_bound_rps"] > 0
    assert detail["config"]["running_cap"] == 4096 and detail["verdict"]["means"]["latency"]
    assert (tmp_path / "capacity.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "(a) capacity: taper" in out and "latency axis" in out and "verdict" in out


def test_each_seed_is_judged_against_the_bound_of_its_own_window() -> None:
    """A seed's window is its own place in the trace: its requests' fluid bound differs from the
    grid's (built on the whole workload) and from another seed's."""
    opts = cap.parse_args(["--trace", str(AZURE), "--policies", "serial", "--slo-tpot-ms", "50",
                           "--seeds", "0,1", "--out", "unused"])
    engine = cap.sim_engine(opts)
    bounds = engine.config["window_bounds_rps"]
    assert set(bounds) == {0, 1} and all(value > 0 for value in bounds.values())
    assert bounds[0] != bounds[1] and engine.fluid_bound_rps not in bounds.values()
    setup = engine.point.setup
    longer = cap.window_bound_rps(replace(setup, warmup_s=0.0), LinearLatencyModel(*setup.model),
                                  engine.fluid_bound_rps, 1)
    assert longer != bounds[1]  # the warm-up's arrivals are not the window's
