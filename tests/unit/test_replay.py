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
    load_trace,
    stationary_schedule,
    synthetic_trace,
    workload_stats,
    write_trace,
)
from branchwise import client, request_meta
from branchwise.client import GenerateError, Generation
from branchwise.tools.launch import free_port

SIM_KEYS = {"goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms",
            "p99_tpot_parallel_ms", "admission_rate", "per_regime"}


class FakeGenerate:
    """Stands in for client.generate: records each call and streams max_new_tokens tokens at once; the
    output ids name the call (1000 + its index). `hook(index)` may raise, or return an awaitable to block."""

    def __init__(self, hook=None) -> None:
        self.calls: list[tuple[list[int], dict, str]] = []
        self.routes: list[str | None] = []  # each call's routing_key
        self.hook = hook

    async def __call__(self, url, text, sp, rid, stream, *, input_ids=None, session=None,
                       routing_key=None) -> Generation:
        assert text is None and stream
        self.calls.append((input_ids, sp, rid))
        self.routes.append(routing_key)
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


def test_every_request_of_a_program_carries_its_programs_router_key():
    """Behind a router a program's serial stages and branches reach one worker, where its prefix is."""
    fake = FakeGenerate()
    run_fake([spec("r0", (3, (2, 4), 2)), spec("r1", (2, (1, 1)))], fake)
    by_program: dict[str, set] = {}
    for (_, _, rid), route in zip(fake.calls, fake.routes, strict=True):
        by_program.setdefault("r0" if "r0" in rid else "r1", set()).add(route)
    assert all(len(routes) == 1 and None not in routes for routes in by_program.values()), by_program
    assert by_program["r0"] != by_program["r1"]


def test_a_best_of_n_program_is_one_request_of_n_samples():
    sent = []

    async def samples(url, text, sp, rid, *, input_ids=None, session=None) -> list[Generation]:
        sent.append((input_ids, sp, rid))
        m, now = sp["max_new_tokens"], time.perf_counter()
        times = [now + 1e-4 * i for i in range(m)]
        return [Generation("", [7] * m, {"completion_tokens": m, "finish_reason": {"type": "length"}}, rid, now,
                           times[-1], times, [1] * m) for _ in range(sp["n"])]

    run = Run("taper", [Outcome(RequestSpec("b0", 0.0, 5, (1, (4, 4, 4)), samples=True))])
    live.execute(run, Target(DEAD, 40.0, generate=FakeGenerate(), samples=samples), 30.0, poll_s=0, progress=False)
    (o,) = run.outcomes
    assert o.finished and o.error is None
    ((ids, sp, rid),) = sent
    assert ids == programs.prompt_ids("b0", 5, 0) and sp["n"] == 3 and sp["max_new_tokens"] == 5
    assert request_meta.parse(sp["custom_params"]).slo_tpot_ms == 40.0  # the server stamps the phase
    assert [(p, len(t)) for p, t in o.stages] == [(True, 15)]
    rec = o.record()
    assert rec.finished and rec.decomposable and rec.output_tokens == 15
    scaled = programs.scale_spec(RequestSpec("b1", 0.0, 100, (1, (40, 40)), samples=True), programs.Scaling())
    assert scaled.samples and scaled.stages == (1, (12, 12))


def test_live_fluid_bound_prices_the_contexts_the_client_sends():
    """Brute force over what the client really sends: each /generate of m tokens on n input ids is
    one prefill token and m - 1 decode rows at contexts n + 1 .. n + m - 1."""
    from bench.bound import LIVE_CLIENT, fluid_bound_rps, request_work_s
    from branchwise.taper.predictor import LinearLatencyModel

    trace = synthetic_trace(duration_s=600, rate=4.0, seed=2)
    specs = programs.build_programs(trace, stationary_schedule(trace, 4.0, 2.0, 1), "multiverse", 1,
                                    Scaling(output_scale=0.05, max_stage_tokens=9))
    assert any(s.decomposable for s in specs)
    fake = FakeGenerate()
    assert all(o.finished for o in run_fake(specs, fake).outcomes)
    m = LinearLatencyModel(c0=0.003, c_seq=2e-4, c_ctx=1e-6)
    brute = sum(m.c_seq * (n - 1) + m.c_ctx * sum(range(len(ids) + 1, len(ids) + n))
                for ids, sp, _ in fake.calls for n in [sp["max_new_tokens"]])
    assert sum(request_work_s(s, m, LIVE_CLIENT) for s in specs) == pytest.approx(brute, rel=1e-12)
    assert fluid_bound_rps(m, 0.01, specs, LIVE_CLIENT) == pytest.approx(0.7 * len(specs) / brute)


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
    table = results.comparison_table({"serial": res, "eager": res, "taper": res})
    assert "x serial" in table and "x eager" in table and table.count("1.00") >= 6


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

    calm = {"serial": res(20.0, 50.0), "taper": res(22.0, 80.0)}
    assert results.drift_note(calm) is None and results.stall_note(calm) is None
    rough = {"serial": res(20.0, 50.0), "taper": res(30.0, 900.0)}
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


# ---- one live point, the operating point, the sweep ------------------------------------------
def test_run_point_counts_every_arrival_and_a_stuck_program_is_a_miss():
    trace = synthetic_trace(duration_s=600, rate=4.0, seed=6)

    def hook(i):
        if i == 0:  # the first program's first request never answers
            return asyncio.Event().wait()

    setup = point.PointSetup(trace, 40.0, Scaling(output_scale=0.01, max_stage_tokens=4), duration_s=1.0,
                              drain_s=0.5, poll_s=0, generate=FakeGenerate(hook))
    m, run = point.run_point(DEAD, "serial", 6.0, 0, setup)
    n = len(run.outcomes)
    assert n >= 2 and m["requests"] == n and m["rate"] == 6.0 and m["cache_flushed"] is False
    assert m["finished_frac"] == pytest.approx((n - 1) / n) and m["attainment"] == pytest.approx((n - 1) / n)
    assert {"goodput_tok_s", "p99_ttft_s", "demand_tok_s"} <= set(m) and m["goodput_tok_s"] > 0
    assert m["p99_ttft_s"] >= 1.0  # the stuck one waited to the end of observation (1.5 s after its arrival)


def _fake_live(monkeypatch, model, ran: list, attainment=lambda pol, rate: 1.0):
    """bench.live without servers: a probe that reads `model`, points that record what they ran."""
    from bench import live

    monkeypatch.setattr(live, "probe_server", lambda url: probe.Probe({}, model))

    def run_point(url, pol, rate, seed, setup, progress=False):
        ran.append((url, pol, rate, seed, setup.slo_tpot_ms))
        att = attainment(pol, rate)
        return {"rate": rate, "attainment": att, "finished_frac": 1.0, "decomp_e2e_p50_s": 10.0 + rate,
                "goodput_tok_s": 100.0 * att}, Run(pol, [])

    monkeypatch.setattr(live, "run_point", run_point)


def test_operating_point_follows_the_probe(monkeypatch, tmp_path):
    """The SLO is the probe's auto SLO (times --slo-scale) and the fluid bound follows the machine:
    a box twice as fast gets twice the rates."""
    from bench import live
    from branchwise.taper.predictor import LinearLatencyModel

    slow, fast = LinearLatencyModel(0.004, 0.0004, 2e-6), LinearLatencyModel(0.002, 0.0002, 1e-6)
    base = point.PointSetup(load_trace(DEFAULT_TRACE), 1.0)
    got = {}
    for name, model, kw in (("slow", slow, {}), ("fast", fast, {}), ("scaled", slow, {"slo_scale": 0.7}),
                            ("given", slow, {"slo_ms": 20.0})):
        _fake_live(monkeypatch, model, [])
        got[name] = live.calibrate(live.Servers(urls={"taper": "http://t", "serial": "http://o"}), ["taper", "serial"],
                                   base, tmp_path, **kw)
    t32 = slow.predict(32, 32 * 256)
    assert got["slow"].setup.slo_tpot_ms == pytest.approx(1e3 * t32) == got["slow"].probed_slo_ms
    assert got["fast"].fluid_bound_rps == pytest.approx(2 * got["slow"].fluid_bound_rps)
    assert got["scaled"].setup.slo_tpot_ms == pytest.approx(0.7e3 * t32)
    assert got["scaled"].fluid_bound_rps < got["slow"].fluid_bound_rps
    assert got["given"].setup.slo_tpot_ms == 20.0
    assert json.loads((tmp_path / "latency_model.json").read_text())["c_seq"] == pytest.approx(0.0004)


def test_sweep_runs_every_seed_at_every_load_and_judges_each(monkeypatch, tmp_path, capsys):
    from bench import sweep
    from branchwise.taper.predictor import LinearLatencyModel

    ran: list = []
    holds_below = {"serial": 0.3, "eager": 0.2, "taper": 0.6}  # x the bound; the first point runs at 0.1 x it
    _fake_live(monkeypatch, LinearLatencyModel(0.003, 0.0002, 1e-6), ran,
               attainment=lambda pol, rate: 1.0 if rate < holds_below[pol] * 10 * ran[0][2] else 0.5)
    rc = sweep.main(["--url", "serial=http://a,eager=http://b,taper=http://c", "--seeds", "0,1",
                     "--loads", "0.1,0.25,0.5,1.0", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "capacity.json").read_text())
    bound = doc["fluid_bound_rps"]
    rates = [x * bound for x in (0.1, 0.25, 0.5, 1.0)]
    assert [r[2] for r in ran] == pytest.approx([r for _ in range(2) for r in rates for _ in range(3)])
    assert [r[1] for r in ran[:6]] == ["serial", "eager", "taper", "eager", "taper", "serial"]  # rotated per load
    assert [r[3] for r in ran] == [0] * 12 + [1] * 12
    assert doc["policies"]["taper"]["capacity_rps"] == pytest.approx(rates[2])
    assert doc["policies"]["serial"]["capacity_of_bound"] == pytest.approx(0.25)
    sw = json.loads((tmp_path / "sweep.json").read_text())
    assert sw["grid"]["rates"] == pytest.approx(rates) and len(sw["points"]) == 24 and set(sw["per_seed"]) == {"0", "1"}
    out = capsys.readouterr().out
    assert "verdict" in out and "PASS" in out and "seed 0:" in out and "seed 1:" in out
    assert (tmp_path / "capacity.png").exists() and (tmp_path / "capacity_detail.json").exists()


def test_capacity_replay_engine_runs_live_points(monkeypatch, tmp_path):
    """bench.capacity --engine replay --url: the engine probes the server once, builds the grid on
    the live fluid bound of that probe and runs each point with bench.point.run_point."""
    from bench import capacity
    from branchwise.taper.predictor import LinearLatencyModel

    ran: list = []
    _fake_live(monkeypatch, LinearLatencyModel(0.003, 0.0002, 2e-7), ran)
    a = capacity.CapacityOptions(DEFAULT_TRACE, str(tmp_path), policies="taper", slo_tpot_ms=12.0,
                                 engine="replay", url="http://srv")
    eng = capacity.replay_engine(a)
    assert eng.workers == 1 and eng.fluid_bound_rps > 0
    assert eng.point("taper", 1.5, 2)["attainment"] == 1.0
    assert ran == [("http://srv", "taper", 1.5, 2, 12.0)]
    eng.close()
    with pytest.raises(ValueError, match="one policy"):
        capacity.replay_engine(dataclasses.replace(a, policies="serial,taper"))


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
