"""bench.replay and its parts without a server: schedule -> programs, the fork/join program, results,
failures, calibration, one live point."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time

import numpy as np
import pytest

from bench import client as live
from bench import point, probe, programs, replay, results
from bench.client import Outcome, Run, Target
from bench.programs import Scaling
from bench.workload import (
    DEFAULT_TRACE,
    Regime,
    RequestSpec,
    Schedule,
    synthetic_trace,
    workload_stats,
    write_trace,
)
from branchwise import client, request_meta
from branchwise.client import GenerateError, Generation
from branchwise.launch import free_port

SIM_KEYS = {"goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms",
            "p99_tpot_parallel_ms", "admission_rate", "per_regime"}


class FakeGenerate:
    """Stands in for client.generate: records each call and streams max_new_tokens tokens at once; the
    output ids name the call (1000 + its index). `hook(index)` may raise, or return an awaitable to block."""

    def __init__(self, hook=None) -> None:
        self.calls: list[tuple[list[int], dict, str]] = []
        self.hook = hook

    async def __call__(self, url, text, sp, rid, stream, *, input_ids=None, session=None) -> Generation:
        assert text is None and stream
        self.calls.append((input_ids, sp, rid))
        if self.hook is not None and (wait := self.hook(len(self.calls) - 1)) is not None:
            await wait
        n, now = sp["max_new_tokens"], time.perf_counter()
        times = [now + 1e-4 * i for i in range(n)]
        meta = {"completion_tokens": n, "finish_reason": {"type": "length"}, "id": rid}
        return Generation("", [999 + len(self.calls)] * n, meta, rid, now, times[-1], times, [1] * n)


def spec(rid: str, stages: tuple, arrival: float = 0.0) -> RequestSpec:
    return RequestSpec(rid, arrival, 5, stages)


DEAD = f"http://127.0.0.1:{free_port()}"  # nothing listens: the fake stands in for /generate only


def run_fake(specs: list[RequestSpec], fake: FakeGenerate, deadline_s: float = 30.0) -> Run:
    run = Run("taper", [Outcome(s) for s in specs])
    return live.execute(run, Target(DEAD, 40.0, generate=fake), deadline_s, poll_s=0, progress=False)


# ---- schedule -> programs -------------------------------------------------------------------------
def test_scale_spec_scales_caps_and_keeps_the_phase_structure():
    s = RequestSpec("r3", 1.5, 1000, (250, (40, 400, 3), 0, (10, 10)))
    out = programs.scale_spec(s, Scaling(output_scale=0.1, max_stage_tokens=32, prompt_scale=0.05, max_prompt_tokens=16))
    assert out == RequestSpec("r3", 1.5, 16, (25, (4, 32, 1), 1, (1, 1)))
    assert out.decomposable and [len(x) for x in out.stages if isinstance(x, tuple)] == [3, 2]
    big = RequestSpec("r4", 0.0, 10, (500, (900, 900, 900), 500))
    small = programs.scale_spec(big, Scaling(output_scale=1.0, max_stage_tokens=1000, max_program_tokens=400))
    assert small.output_tokens <= 400 and [len(x) for x in small.stages if isinstance(x, tuple)] == [3]
    assert small.stages[0] == small.stages[2] and len(set(small.stages[1])) == 1  # the shape is kept
    with pytest.raises(ValueError):
        Scaling(output_scale=0)


def test_fit_schedule_fills_the_duration_and_scales_rates():
    trace = synthetic_trace(duration_s=3600, rate=2.0, seed=3)
    base = programs.fit_schedule(trace, "paper-3regime", 60.0)
    fast = programs.fit_schedule(trace, "paper-3regime", 60.0, rate_scale=4.0)
    for s in (base, fast):
        assert s.duration_s == pytest.approx(60.0) and np.all(np.diff(s.arrival_s) >= 0)
        assert s.arrival_s[-1] <= 60.0
        assert [g.name for g in s.regimes] == ["low", "transition", "high", "moderate"]
        assert s.regimes[-1].end_s == pytest.approx(60.0)
    mean_rate = (240 * 0.23 + 10 * 0.615 + 150 * 1.27 + 200 * 0.6) / 600  # the paper's envelope, req/s
    assert len(fast) == pytest.approx(4 * mean_rate * 60, rel=0.2)
    hi = fast.regimes[2]
    assert fast.rate_in(hi.start_s, hi.end_s) == pytest.approx(4 * 1.27, rel=0.25)  # the surge, 4x
    with pytest.raises(ValueError, match="cannot fill"):
        programs.fit_schedule(trace, "rate:2", 10_000.0)


def test_build_programs_is_reproducible_and_scaled():
    trace = synthetic_trace(duration_s=600, rate=4.0, seed=1)
    sched = programs.fit_schedule(trace, "rate:4", 30.0)
    sc = Scaling(output_scale=0.05, max_stage_tokens=8)
    a = programs.build_programs(trace, sched, "multiverse", 0, sc)
    assert a == programs.build_programs(trace, sched, "multiverse", 0, sc) and len(a) == len(sched)
    assert all(1 <= n <= 8 for p in a for st in p.stages for n in (st if isinstance(st, tuple) else (st,)))
    assert 0.2 < workload_stats(a)["pdr"] < 0.8
    assert programs.prompt_ids("r1", 12, 0) == programs.prompt_ids("r1", 12, 0) != programs.prompt_ids("r2", 12, 0)
    assert len(programs.prompt_ids("r1", 12, 0)) == 12 and all(10 <= t < 400 for t in programs.prompt_ids("r1", 99, 0))


# ---- one program ----------------------------------------------------------------------------------
def test_program_is_serial_then_stamped_fork_then_join_in_branch_order():
    fake = FakeGenerate()
    run = run_fake([spec("r0", (3, (2, 4, 1), 2))], fake)
    (o,) = run.outcomes
    assert o.finished and o.error is None and run.error is None
    ids, sps, rids = zip(*fake.calls, strict=True)
    prompt = programs.prompt_ids("r0", 5, 0)
    assert ids[0] == prompt and len(prompt) == 5
    metas = [request_meta.parse(sp["custom_params"]) for sp in sps]
    assert [m.slo_tpot_ms for m in metas] == [40.0] * 5
    branches = metas[1:4]
    group = branches[0].phase
    assert group and all(m.phase == group and m.fanout == 3 for m in branches)
    assert [m.branch for m in branches] == [0, 1, 2] and metas[0].phase is None is metas[4].phase
    assert list(rids[1:4]) == [client.branch_rid(group, i) for i in range(3)]
    assert [sp["max_new_tokens"] for sp in sps] == [3, 2, 4, 1, 2]
    assert all(sp["temperature"] == 0 and sp["ignore_eos"] for sp in sps)
    shared = prompt + [1000] * 3  # the prompt and the first serial stage's output
    heads = [programs.branch_head(i) for i in range(3)]
    assert list(ids[1:4]) == [shared + h for h in heads] and len({tuple(h) for h in heads}) == 3
    # the next serial stage sees every branch after its header, in branch order, whatever finished first
    joined = shared + heads[0] + [1001] * 2 + heads[1] + [1002] * 4 + heads[2] + [1003] + [programs.SEP_ID]
    assert ids[4] == joined
    assert [(p, len(t)) for p, t in o.stages] == [(False, 3), (True, 7), (False, 2)]
    rec = o.record()
    assert rec.finished and rec.decomposable and rec.output_tokens == 12


def test_results_have_the_simulator_shape(tmp_path):
    specs = [spec("r0", (4,)), spec("r1", (2, (3, 3), 2)), spec("r2", (5,), arrival=0.01)]
    run = run_fake(specs, FakeGenerate())
    sched = Schedule(np.array([0.0, 0.0, 0.01]), np.arange(3), 1.0,
                            (Regime("low", 0.0, 0.5), Regime("high", 0.5, 1.0)), "test")
    res = results.summarize_run(run, 0.040, sched)
    assert SIM_KEYS <= set(res) and set(res["per_regime"]) == {"low", "high"}
    assert res["slo_attainment"] == 1.0 and res["raw_throughput_tok_s"] == pytest.approx(19.0)
    assert res["partial"] is False and res["run"]["finished"] == res["run"]["programs"] == 3
    path = results.write_results(tmp_path, {"eager": res, "taper": res}, {"x": 1}, False, 1.0)
    doc = json.loads(path.read_text())
    assert set(doc) == {"policies", "config", "partial", "wall_s"} and set(doc["policies"]) == {"eager", "taper"}
    assert SIM_KEYS <= set(doc["policies"]["taper"])
    table = results.comparison_table({"off": res, "eager": res, "taper": res})
    assert "x off" in table and "x eager" in table and table.count("1.00") >= 6


def test_a_rejected_request_fails_its_program_only():
    def hook(i):
        if i == 0:
            raise GenerateError("http://fake", 400, "Branchwise: nope")

    run = run_fake([spec("r0", (2,)), spec("r1", (2,))], FakeGenerate(hook))
    assert run.error is None
    assert [(o.finished, o.error is not None) for o in run.outcomes] == [(False, True), (True, False)]


# ---- failures keep partial results ----------------------------------------------------------------
def test_server_dying_mid_run_keeps_what_completed():
    def hook(i):
        if i >= 2:
            raise ConnectionError(f"SGLang server at {DEAD} unreachable")

    specs = [spec(f"r{i}", (3,), arrival=0.001 * i) for i in range(5)]
    run = run_fake(specs, FakeGenerate(hook))
    assert run.error and DEAD in run.error
    assert sum(o.finished for o in run.outcomes) == 2
    res = results.summarize_run(run, 0.04, Schedule(np.zeros(5), np.arange(5), 1.0,
                                                          (Regime("all", 0, 1.0),), "t"))
    assert res["partial"] is True and res["run"]["finished"] == 2 and res["raw_throughput_tok_s"] > 0


def test_a_dropped_connection_on_a_live_server_fails_one_program(monkeypatch):
    async def alive(url, session):
        return True

    def hook(i):
        if i == 1:
            raise ConnectionError("connection reset by peer")

    monkeypatch.setattr(live, "_alive", alive)
    run = run_fake([spec(f"r{i}", (2,)) for i in range(3)], FakeGenerate(hook))
    assert run.error is None and [o.finished for o in run.outcomes] == [True, False, True]
    assert "reset" in run.outcomes[1].error


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt while the test runs, whatever this process inherited: a background
    job of a non-interactive shell starts with SIGINT ignored, and then Python installs no handler."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_keeps_what_completed(sigint_raises):
    def hook(i):
        if i == 2:  # the third request: Ctrl-C while it is in flight
            signal.raise_signal(signal.SIGINT)
            return asyncio.Event().wait()  # never answered; the interrupt cancels it

    run = run_fake([spec(f"r{i}", (2,)) for i in range(4)], FakeGenerate(hook))
    assert run.interrupted and run.error == "interrupted (Ctrl-C)"
    assert [o.finished for o in run.outcomes][:2] == [True, True] and not run.outcomes[2].finished


def test_dead_server_is_a_clear_error_with_partial_results(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    write_trace(trace, synthetic_trace(duration_s=300, rate=4.0, seed=2))
    url = f"http://127.0.0.1:{free_port()}"
    rc = replay.main(["--url", url, "--trace", str(trace), "--schedule", "rate:4", "--duration-s", "5",
                      "--rate-scale", "1", "--slo-tpot-ms", "50", "--out", str(tmp_path / "out"),
                      "--no-plots", "--no-progress"])
    assert rc == 1 and url in capsys.readouterr().err
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    (res,) = doc["policies"].values()
    assert doc["partial"] is True and res["partial"] is True
    assert "ConnectionError" in res["run"]["error"] and url in res["run"]["error"]


def test_bad_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    rc = replay.main(["--url", "http://127.0.0.1:1", "--trace", str(bad), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and str(bad) in err and "GeneratedTokens" in err
    assert not (tmp_path / "o").exists()


# ---- server-side series ---------------------------------------------------------------------------
def test_step_series_and_server_deltas():
    page = ("# HELP x\nbranchwise:realized_step_seconds_count 10.0\nbranchwise:realized_step_seconds_sum 0.5\n"
            'branchwise:candidate_branches_total{pid="1"} 8.0\nbranchwise:admitted_branches_total 2.0\n'
            "sglang:other 3\n")
    assert live.parse_step_series(page) == {"count": 10.0, "sum": 0.5, "eligible": 8.0, "admitted": 2.0}
    assert live.parse_step_series("sglang:other 3\n") is None
    before = {"steps": 5, "candidates": 10, "admitted": 10, "rows_deferred": 0}
    after = {"steps": 25, "candidates": 30, "admitted": 15, "rows_deferred": 15, "policy": "taper"}
    d = results.server_delta(before, after)
    assert d["admission_rate"] == 0.25 and d["steps"] == 20 and d["policy"] == "taper"
    assert results.server_delta(None, None) is None


# ---- calibration ----------------------------------------------------------------------------------
def test_calibration_sets_slo_load_and_latency_model(tmp_path):
    from branchwise.taper.predictor import LinearLatencyModel

    trace = synthetic_trace(duration_s=3600, rate=2.0, seed=5)
    a = replay.parse_args(["--launch", "--out", str(tmp_path), "--duration-s", "60", "--load", "0.3"])
    sc = Scaling()
    steep = probe.Probe({}, LinearLatencyModel(0.005, 0.0006, 2e-7))
    pt = probe.calibrate(a.cal, trace, sc, steep, tmp_path)
    t_slo = 0.005 + 32 * 0.0006 + 32 * 256 * 2e-7  # 32 rows of 256 KV tokens
    assert pt.slo_tpot_ms == pytest.approx(1e3 * t_slo)
    specs = programs.build_programs(trace, programs.fit_schedule(trace, a.cal.schedule, 60.0, pt.rate_scale),
                                    a.cal.preset, a.cal.seed, sc)
    target = 0.3 * 32 / t_slo  # load x the decode tokens/s of that composition
    assert programs.mean_demand_tok_s(specs, 60.0) == pytest.approx(target, rel=0.03)
    assert pt.latency_model == str(tmp_path / "latency_model.json")
    assert LinearLatencyModel.load(pt.latency_model) == steep.model  # taper servers plan with the fit
    flat = probe.Probe({}, LinearLatencyModel(0.012, 0.0002, 0.0))
    assert probe.calibrate(a.cal, trace, sc, flat, tmp_path).slo_tpot_ms == pytest.approx(2.5 * 12.2)  # the floor
    given = replay.parse_args(["--url", "http://x", "--out", str(tmp_path), "--slo-tpot-ms", "40", "--rate-scale", "2"])
    pt = probe.calibrate(given.cal, trace, sc, steep, tmp_path)
    assert (pt.slo_tpot_ms, pt.rate_scale, pt.latency_model) == (40.0, 2.0, None)


def test_notes_flag_a_drifting_box_and_a_starved_client():
    def res(probe_ms, stall_ms):
        return {"run": {"probe": {"at_slo_rows_ms": probe_ms}, "client_stalls": {"max_ms": stall_ms, "over_100ms": 1}}}

    calm = {"off": res(20.0, 50.0), "taper": res(22.0, 80.0)}
    assert results.drift_note(calm) is None and results.stall_note(calm) is None
    rough = {"off": res(20.0, 50.0), "taper": res(30.0, 900.0)}
    assert "taper 30.0 ms" in results.drift_note(rough) and "taper" in results.stall_note(rough)
    lags = [(0.0, 0.01), (1.0, 0.3), (2.0, 0.15)]
    assert results.client_stalls(lags) == {"max_ms": pytest.approx(300.0), "over_100ms": 2,
                                          "stalled_s": pytest.approx(0.45)}


# ---- operating point flags ------------------------------------------------------------------------
def test_load_and_rate_scale_parse_and_reject_bad_input(capsys):
    a = replay.parse_args(["--launch", "--out", "x", "--load", "0.4"])
    assert a.cal.load == 0.4 and a.cal.rate_scale is None
    assert replay.parse_args(["--launch", "--out", "x"]).cal.load == 0.35
    r = replay.parse_args(["--launch", "--out", "x", "--rate-scale", "2", "--slo-tpot-ms", "19"])
    assert (r.cal.rate_scale, r.cal.slo_tpot_ms) == (2.0, 19.0)
    assert replay.parse_args(["--launch", "--out", "x", "--rate-scale", "auto"]).cal.rate_scale is None
    for bad in (["--load", "0.4,0.6"], ["--load", "-1"], ["--load", "auto"], ["--rate-scale", "2,3"]):
        with pytest.raises(SystemExit):
            replay.parse_args(["--launch", "--out", "x", *bad])
    assert "--load takes a number > 0" in capsys.readouterr().err


# ---- one live point, the load rule, the sweep's verdict ------------------------------------------
def test_run_point_counts_every_arrival_and_a_stuck_program_is_a_miss():
    trace = synthetic_trace(duration_s=600, rate=4.0, seed=6)

    def hook(i):
        if i == 0:  # the first program's first request never answers
            return asyncio.Event().wait()

    setup = point.PointSetup(trace, 40.0, Scaling(output_scale=0.01, max_stage_tokens=4), duration_s=1.0,
                              drain_s=0.5, poll_s=0, generate=FakeGenerate(hook))
    m, run = point.run_point(DEAD, "off", 6.0, 0, setup)
    n = len(run.outcomes)
    assert n >= 2 and m["requests"] == n and m["rate"] == 6.0 and m["cache_flushed"] is False
    assert m["finished_frac"] == pytest.approx((n - 1) / n) and m["attainment"] == pytest.approx((n - 1) / n)
    assert {"goodput_tok_s", "p99_ttft_s", "demand_tok_s"} <= set(m) and m["goodput_tok_s"] > 0
    assert m["p99_ttft_s"] >= 1.0  # the stuck one waited to the end of observation (1.5 s after its arrival)


def test_load_grid_follows_the_probe():
    from bench import sweep
    from branchwise.taper.predictor import LinearLatencyModel

    slow = probe.Probe({}, LinearLatencyModel(0.004, 0.0004, 0.0))
    g = sweep.load_grid(slow, 500.0)
    t32 = 0.004 + 32 * 0.0004
    assert g.slo_tpot_ms == pytest.approx(1e3 * t32) and g.rows_at_slo == pytest.approx(32)
    assert g.reference_rate == pytest.approx(32 / t32 / 500.0) and g.loads == sweep.LOADS
    assert g.rates[-1] == pytest.approx(g.reference_rate) and g.rates == sorted(g.rates)
    fast = probe.Probe({}, LinearLatencyModel(0.002, 0.0002, 0.0))
    assert sweep.load_grid(fast, 500.0).reference_rate == pytest.approx(2 * g.reference_rate)  # 2x box, 2x rates
    fixed = sweep.load_grid(slow, 500.0, slo_tpot_ms=20.0)
    assert fixed.slo_tpot_ms == 20.0 and fixed.rows_at_slo == pytest.approx(40)
    floor = sweep.load_grid(probe.Probe({}, LinearLatencyModel(0.010, 0.0001, 0.0)), 500.0)
    assert floor.slo_tpot_ms == pytest.approx(2.5 * 10.1)  # at least 2.5 x T(1 row)


def test_sweep_capacity_and_verdict():
    from bench import sweep

    def row(load, off, eager, taper, n=20):
        return {"load": load, "rate": 2 * load, "requests": n, "demand_tok_s": 100 * load,
                "policies": {k: {"attainment": v, "requests": n, "finished_frac": 1.0, "goodput_tok_s": 10.0,
                                 "p99_ttft_s": 0.1, "rate": 2 * load}
                             for k, v in (("off", off), ("eager", eager), ("taper", taper))}}

    rows = [row(0.1, 1.0, 1.0, 1.0), row(0.2, 0.96, 0.7, 0.96), row(0.4, 0.5, 0.97, 0.90), row(0.8, 0.1, 0.2, 0.2)]
    pts = {k: [{"load": r["load"], "rate": r["rate"]} | r["policies"][k] for r in rows] for k in ("off", "eager", "taper")}
    caps = {k: sweep.capacity(v) for k, v in pts.items()}
    assert caps["off"]["load"] == 0.2 and caps["taper"] == {"load": 0.2, "rate": 0.4}
    assert caps["eager"]["load"] == 0.1  # 0.4 holds again, but capacity needs every load below to hold
    v = sweep.verdict(rows, caps)
    assert v["capacity_highest"] and v["grid_spans_hold_to_fail"] and not v["passed"]
    assert [(b["load"], b["policy"]) for b in v["breaks"]] == [(0.4, "eager")]  # 0.90 < 0.97 - 1/20
    rows[2]["policies"]["taper"]["attainment"] = 0.925  # one request of 20 below eager: within tolerance
    assert sweep.verdict(rows, caps)["pointwise"]
    doc = sweep.capacity_doc(rows, caps, ["off", "eager", "taper"])
    assert doc["policies"]["taper"]["capacity_rps"] == 0.4
    assert set(doc["policies"]["off"]["points"][0]) == {"rate", "load", "goodput_tok_s", "attainment",
                                                       "finished_frac", "p99_ttft_s"}
    text = sweep.table(rows, ["off", "eager", "taper"])
    assert text.count("\n") == len(rows) + 1 and "96%" in text


def test_capacity_replay_engine_runs_live_points(monkeypatch, tmp_path):
    """bench.capacity --engine replay --url: the engine probes the server once, builds the grid on
    bench.capacity's fluid bound of that probe and runs each point with bench.point.run_point."""
    from bench import capacity, sweep
    from branchwise.taper.predictor import LinearLatencyModel

    probed, ran = [], []
    monkeypatch.setattr(sweep, "_probe", lambda url: probed.append(url) or probe.Probe(
        {}, LinearLatencyModel(0.003, 0.0002, 2e-7)))
    monkeypatch.setattr(sweep, "run_point", lambda url, pol, rate, seed, setup: ran.append(
        (url, pol, rate, seed, setup.slo_tpot_ms)) or ({"rate": rate, "attainment": 1.0}, Run(pol, [])))
    a = capacity.CapacityOptions(DEFAULT_TRACE, str(tmp_path), policies="taper", slo_tpot_ms=12.0,
                                 engine="replay", url="http://srv")
    eng = capacity.replay_engine(a)
    assert probed == ["http://srv"] and eng.workers == 1 and eng.base_rps > 0
    assert eng.point("taper", 1.5, 2) == {"rate": 1.5, "attainment": 1.0}
    assert ran == [("http://srv", "taper", 1.5, 2, 12.0)]
    eng.close()
    with pytest.raises(ValueError, match="one policy"):
        capacity.replay_engine(dataclasses.replace(a, policies="off,taper"))


def test_flush_cache_waits_while_the_server_is_busy():
    import http.server
    import threading

    answers = [400, 400, 200]
    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            self.send_response(answers.pop(0) if answers else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        assert live.flush_cache(url, wait_s=10) is True and seen == ["/flush_cache"] * 3
        assert live.flush_cache(url, wait_s=10) is False  # no such endpoint (404): no waiting
        live.abort_all(url)  # best effort: a 404 is not an error
        assert seen[-1] == "/abort_request"
    finally:
        srv.shutdown()
    assert live.flush_cache(DEAD, wait_s=1) is False
