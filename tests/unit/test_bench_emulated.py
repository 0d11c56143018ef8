"""Live benches on an emulated device (bench.emulated): the load rule, the validity rule, the
device counters of a point, server variants and the simulator's device regime."""

from __future__ import annotations

import argparse

import pytest

from bench import capacity, confidence, emulated, sweep
from bench.engine import Cost, EngineConfig, HostCosts, Simulator, build_controller
from bench.live import ServerSettings, device_point, live_bound_rps
from bench.point import PointSetup
from bench.probe import Probe
from bench.regimes import REGIMES, get_regime
from bench.workload import DEFAULT_TRACE, RequestSpec, load_trace
from branchwise.device_model import parse_spec

A100 = "a100-qwen3-32b-tp8"


# ---------------------------------------------------------------------------------- the load rule
def test_the_grid_comes_from_the_presets_t_of_s_not_a_probe():
    model = emulated.spec_model(A100)
    preset = parse_spec(A100)
    assert model.coefs() == pytest.approx((preset.floor_s, preset.row_s, preset.context_token_s,
                                           preset.prefill_token_s))
    base = PointSetup(load_trace(DEFAULT_TRACE), 1.0)
    auto_ms, setup, bound = device_point(model, base)
    t_32 = model.predict(32, 32 * 256)
    t_1 = model.predict(1, 256)
    assert auto_ms == pytest.approx(1e3 * max(t_32, 2.5 * t_1))  # bench.probe's auto rule
    assert auto_ms == pytest.approx(35.69, abs=0.01)  # the A100 preset: 2.5 x T(1 row) decides
    assert setup.slo_tpot_ms == pytest.approx(auto_ms)
    assert bound == pytest.approx(live_bound_rps(Probe({}, model), setup)) and bound > 0
    _, scaled, scaled_bound = device_point(model, base, slo_scale=0.8)
    assert scaled.slo_tpot_ms == pytest.approx(0.8 * auto_ms) and scaled_bound < bound  # a tighter SLO
    _, given, _ = device_point(model, base, slo_ms=50.0)
    assert given.slo_tpot_ms == 50.0


def test_a_time_scale_stretches_the_model_and_the_slo_alike():
    one, two = emulated.spec_model(A100), emulated.spec_model(A100 + "@x2")
    assert two.coefs() == pytest.approx(tuple(2 * coef for coef in one.coefs()))
    assert emulated.device_slo_s(two) == pytest.approx(2 * emulated.device_slo_s(one))


def test_a_scaled_device_stretches_a_points_window_and_drain():
    assert emulated.point_window_s(None, 40.0, 20.0) == (40.0, 20.0)
    assert emulated.point_window_s(A100, 40.0, 20.0) == (40.0, 20.0)
    assert emulated.point_window_s(A100 + "@x2", 40.0, 20.0) == pytest.approx((80.0, 40.0))


# ------------------------------------------------------------------------------ the validity rule
@pytest.mark.parametrize(("forwards", "overruns", "valid"),
                         [(100, 0, True), (100, 1, True), (100, 2, False), (1000, 11, False), (0, 0, True),
                          (3, 1, False)])
def test_a_point_over_one_percent_overruns_is_invalid(forwards, overruns, valid):
    assert emulated.validity(forwards, overruns).valid is valid


def test_the_exposed_time_per_step_and_the_overrun_share():
    got = emulated.validity(200, 1, idle_ms=30.0, idle_steps=150)
    assert (got.overrun_frac, got.exposed_ms_per_step) == (pytest.approx(0.005), pytest.approx(0.2))
    assert emulated.validity(0, 0).overrun_frac is None and emulated.validity(0, 0).exposed_ms_per_step is None


def test_a_points_counters_are_the_difference_of_two_reports():
    before = {"preset": A100, "forwards": 10, "overruns": 3, "idle_ms": 5.0, "idle_steps": 8, "modeled_ms": 100.0,
              "compute_ms": 20.0}
    after = {"preset": A100, "forwards": 510, "overruns": 9, "idle_ms": 105.0, "idle_steps": 408,
             "modeled_ms": 9100.0, "compute_ms": 1020.0}
    delta = emulated.device_delta(before, after)
    assert (delta["device_forwards"], delta["device_overruns"], delta["device_idle_steps"]) == (500, 6, 400)
    marked = emulated.mark({"attainment": 1.0} | delta)
    assert marked["invalid"] and marked["device_overrun_frac"] == pytest.approx(0.012)
    assert marked["device_exposed_ms_per_step"] == pytest.approx(0.25)
    assert emulated.device_delta(None, after) == {} and emulated.mark({"attainment": 1.0}) == {"attainment": 1.0}


def test_pooled_repeats_are_judged_on_their_sums():
    runs = [{"attainment": 1.0, "device_forwards": 100, "device_overruns": 2, "device_idle_ms": 0.0,
             "device_idle_steps": 90},
            {"attainment": 1.0, "device_forwards": 300, "device_overruns": 0, "device_idle_ms": 0.0,
             "device_idle_steps": 290}]
    assert emulated.mark(runs[0])["invalid"]
    assert not emulated.mark(confidence.pool(runs))["invalid"]  # 2 of 400 forwards


def test_an_invalid_point_neither_holds_nor_fails():
    point = {"attainment": 1.0, "attainment_ci": [0.99, 1.0], "invalid": True}
    assert not capacity.holds(point)
    assert capacity.hold_outcome(point) == confidence.UNDECIDED
    assert capacity.hold_outcome(point | {"invalid": False}) == confidence.PASS


def test_a_capacity_document_marks_a_rate_invalid_if_any_seeds_point_is():
    got = {("stock", 1.0, seed): {"rate": 1.0, "attainment": 1.0, "device_forwards": 100,
                                  "device_overruns": overruns, "device_idle_ms": 10.0, "device_idle_steps": 100,
                                  "invalid": overruns > 1, "raw_throughput_tok_s": 50.0}
           for seed, overruns in ((0, 0), (1, 5))}
    doc = capacity._document(2.0, ["stock"], [1.0], {"stock": [1.0]}, got, [0, 1])
    point = doc["policies"]["stock"]["points"][0]
    assert point["invalid"] and point["device_overrun_frac"] == pytest.approx(0.025)
    assert point["device_exposed_ms_per_step"] == pytest.approx(0.1)
    assert "!" in emulated.device_table(doc)


# ----------------------------------------------------------------------------------- server variants
def test_a_variant_is_one_more_policy_served_with_its_flags():
    args = sweep.parse_args(["--launch", "--policies", "stock", "--variant", "async-output=stock:--async-output",
                             "--emulate-device", A100, "--out", "unused"])
    assert args.variant == [("async-output", ("stock", "--async-output"))]
    settings = ServerSettings(extra_args=f"--emulate-device {A100}", variants=dict(args.variant))
    flags = settings.args("async-output", 35.0, None)
    assert flags[:2] == ["--branch-policy", "stock"]
    assert flags[-3:] == ["--emulate-device", A100, "--async-output"]
    assert "--async-output" not in settings.args("stock", 35.0, None)


@pytest.mark.parametrize("bad", ["noequals", "=stock", "a b=stock", "x=nosuchpolicy"])
def test_a_bad_variant_fails_at_parsing(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        sweep.parse_variant(bad)


def test_a_bad_device_or_a_variant_without_launch_fails_at_parsing():
    with pytest.raises(SystemExit):
        sweep.parse_args(["--launch", "--emulate-device", "no-such-preset", "--out", "unused"])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--url", "stock=http://x", "--variant", "a=stock", "--out", "unused"])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--launch", "--policies", "stock", "--variant", "stock=stock:--async-output",
                          "--out", "unused"])


# --------------------------------------------------------------------------- the simulator's regime
def test_the_device_regime_runs_the_emulated_servers_t_of_s_and_slo():
    reg = get_regime("device:" + A100)
    model = emulated.spec_model(A100)
    assert reg.coefs == pytest.approx(model.coefs())
    assert reg.slo_s == pytest.approx(emulated.device_slo_s(model))
    # no host costs but the device's per-row cost of a prefill forward's requests
    assert reg.engine.host == HostCosts(prefill=Cost(0.0, model.c_seq))
    assert reg.engine.client_programs and reg.engine.prefill_steps
    sizes = parse_spec(A100).graph_batch_sizes
    assert reg.graph_batch_sizes == sizes and reg.model.graph_batch_sizes == sizes
    # taper plans with the padded T(S), as an emulated server's controller does
    assert build_controller("taper", reg.model, calibrated=True).policy.model.graph_batch_sizes == sizes
    assert reg.calibrated and not reg.drain_arrivals and reg.window_s == 40.0
    with pytest.raises(ValueError, match="neither a preset"):
        get_regime("device:no-such-preset")
    assert capacity.parse_args(["--trace", DEFAULT_TRACE, "--out", "unused", "--device", A100]).regime == \
        "device:" + A100


def test_a_padded_decode_step_costs_the_next_graph_size_in_the_simulator():
    """Five branches decode together 30 times: on the device each step replays the 8-row graph."""
    reg = get_regime("device:" + A100)
    spec = [RequestSpec("a", 0.0, 10, (1, (30,) * 5, 1))]
    walls = []
    for model in (reg.model, emulated.spec_model(A100)):  # padded, linear
        rec = Simulator(spec, build_controller("eager", model), model, EngineConfig(noise=0.0), 1e9).run().records[0]
        phase = next(stage for stage in rec.stages if stage.parallel)
        walls.append(phase.end_s - phase.start_s)
    assert reg.model.predict(5, 100) == pytest.approx(reg.model.predict(8, 100))
    assert walls[0] - walls[1] == pytest.approx(30 * 3 * reg.model.c_seq, abs=1e-9)


@pytest.mark.parametrize("name", sorted(REGIMES))
def test_the_other_regimes_keep_a_linear_t_of_s(name):
    reg = get_regime(name)
    assert reg.graph_batch_sizes == () and reg.model.graph_batch_sizes == ()
    assert build_controller("taper", reg.model, calibrated=reg.calibrated).policy.model.graph_batch_sizes == ()
    c0, c_seq, c_ctx, _ = reg.coefs
    assert reg.model.predict(5, 1000) == pytest.approx(c0 + 5 * c_seq + 1000 * c_ctx)
