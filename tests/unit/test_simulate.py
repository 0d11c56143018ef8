"""The decode-loop simulator driving the real TAPER policy objects (bench/simulate.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from bench.engine import (
    EngineConfig,
    Simulator,
    build_controller,
    sglang_max_running,
    slo_sized_cap,
)
from bench.metrics import summarize
from bench.simulate import main
from bench.workload import RequestSpec, build_schedule, compose, load_trace, synthetic_trace, write_trace
from branchwise.taper import LinearLatencyModel, default_model

AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"
POLICIES = ("serial", "cap:2", "eager", "taper", "taper-no-slack", "taper-no-replan", "taper-const-predictor")


@pytest.fixture(scope="module")
def small():
    trace = load_trace(AZURE)
    sched = build_schedule(trace, "paper-3regime", compress=120)  # 5 simulated minutes, all regimes
    return sched, compose(trace, sched, "multiverse", seed=2)


def _run(specs, policy: str, t_end: float = 1e9, **cfg):
    model = default_model()
    sim = Simulator(specs, build_controller(policy, model), model, EngineConfig(**cfg), t_end)
    return sim, sim.run()


def test_eager_admits_every_branch_and_serial_none(small) -> None:
    _, specs = small
    for policy, want in (("eager", 1.0), ("serial", 0.0)):
        _, res = _run(specs, policy)
        steps = res.steps.arrays()
        assert steps["eligible"].sum() > 0
        assert steps["admitted"].sum() == want * steps["eligible"].sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_tokens_conserved_and_resources_released(small, policy: str) -> None:
    _, specs = small
    specs = specs[:80]
    sim, res = _run(specs, policy, kv_tokens=20_000, max_running=24)  # tight: forces retractions
    want = {s.rid: s.output_tokens for s in specs}
    assert len(res.records) == len(specs)
    assert all(r.finished and r.output_tokens == want[r.rid] for r in res.records)
    assert sim.slots == 0 and sim.kv == 0
    if policy == "eager":
        assert sim.retractions > 0


@pytest.mark.parametrize("noise", [0.0, 0.05])
@pytest.mark.parametrize("policy", ["serial", "eager", "taper", "taper-paper"])
def test_multi_step_windows_are_exact(small, policy: str, noise: float) -> None:
    """Running provably identical steps in one go gives the same deliveries as stepping one by one,
    with step noise too: the k-th step draws the k-th noise however the steps are grouped."""
    specs = small[1][:100]
    runs = [_run(specs, policy, noise=noise, macro_steps=m)[1] for m in (True, False)]
    assert runs[0].stats["iterations"] < runs[1].stats["iterations"]
    a, b = ([(s.parallel, s.tokens, s.start_s, s.end_s) for r in x.records for s in r.stages] for x in runs)
    assert [s[:2] for s in a] == [s[:2] for s in b]
    np.testing.assert_allclose([s[2:] for s in a], [s[2:] for s in b], rtol=0, atol=1e-9)
    gaps = [[r.max_gap_s for r in x.records] for x in runs]
    np.testing.assert_allclose(gaps[0], gaps[1], rtol=0, atol=1e-9)


def test_max_gap_is_the_longest_step_a_request_waited() -> None:
    """Stepping one by one, a request's per-gap TPOT is its largest interval between deliveries:
    no smaller than any serial stage's mean TPOT, and it sees the prefill-heavy step that admitted
    a newcomer while it was decoding."""
    specs = [RequestSpec("a", 0.0, 10, (40,)), RequestSpec("b", 0.2, 8000, (5,))]
    _, res = _run(specs, "serial", noise=0.0, macro_steps=False)
    a = res.records[0]
    m = default_model()
    assert a.max_gap_s == pytest.approx(m.predict(1, a.stages[0].tokens) + m.c_tok * 8000, rel=0.05)
    assert a.max_gap_s > a.max_tpot_s


def test_taper_keeps_attainment_under_overload() -> None:
    trace = load_trace(AZURE)
    sched = build_schedule(trace, "rate:1.5", compress=60)  # 1.5 req/s for ~6 min: overload
    specs = compose(trace, sched, "multiverse", seed=2)
    window = (0.0, sched.duration_s)
    got = {p: summarize(_run(specs, p, max_running=96)[1].records, 0.05, window) for p in ("serial", "eager", "taper")}
    assert got["taper"]["slo_attainment"] >= got["serial"]["slo_attainment"] - 0.02
    assert got["taper"]["slo_attainment"] > got["eager"]["slo_attainment"] + 0.2
    assert got["taper"]["goodput_tok_s"] >= got["serial"]["goodput_tok_s"] * 0.98


def test_sglang_default_running_limit() -> None:
    """SGLang 0.5.23 without --max-running-requests: pool / context_len * 512, clamped to
    [2048, 4096], at most half the pool."""
    assert sglang_max_running(1_500_000) == 4096  # the modelled 8xA100 pool: the KV pool binds first
    assert sglang_max_running(100_000) == 2048
    assert sglang_max_running(3000) == 1500
    assert EngineConfig().running_cap == 4096 and EngineConfig(max_running=30).running_cap == 30


def test_queued_requests_reach_the_controller() -> None:
    """The controller hears how many requests wait for admission (taper's backlog input)."""
    seen = []
    ctl = build_controller("eager", default_model())
    orig = ctl.select

    def select(rows, now, bubble=False, *, waiting=0):
        seen.append(waiting)
        return orig(rows, now, bubble, waiting=waiting)

    ctl.select = select
    specs = [RequestSpec(f"r{i}", 0.0, 20, (2, (20, 20), 2)) for i in range(4)]
    Simulator(specs, ctl, default_model(), EngineConfig(max_running=2, noise=0.0), 1e9).run()
    assert max(seen) == 2  # two requests queue behind the running limit


def test_slo_sized_cap(small) -> None:
    _, specs = small
    m = LinearLatencyModel(0.014, 2.5e-4, 1e-7)
    cap = slo_sized_cap(m, 0.05, specs)
    ctx = np.mean([s.prompt_tokens + s.output_tokens for s in specs])
    assert m.predict(cap, cap * ctx) <= 0.05 < m.predict(cap + 1, (cap + 1) * ctx)


def test_cli_writes_results_and_plots(tmp_path: Path, capsys) -> None:
    csv = tmp_path / "syn.csv"
    write_trace(csv, synthetic_trace(duration_s=900, rate=3.0, seed=5))  # a trace nothing was tuned on
    rc = main(["--trace", str(csv), "--schedule", "paper-3regime", "--compress", "240", "--policies",
               "serial,cap:2,eager,taper", "--seed", "1", "--out", str(tmp_path / "out"), "--jobs", "1"])
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(doc["policies"]) == ["serial", "cap:2", "eager", "taper"]
    for res in doc["policies"].values():
        for key in ("goodput_tok_s", "raw_throughput_tok_s", "slo_attainment", "p99_tpot_serial_ms",
                    "p99_tpot_parallel_ms", "admission_rate"):
            assert key in res
        assert set(res["per_regime"]) == {"low", "transition", "high", "moderate"}
        assert "goodput_tok_s" in res["per_regime"]["high"]
    assert (tmp_path / "out" / "figure2.png").stat().st_size > 10_000
    assert "taper" in capsys.readouterr().out


def test_cli_rejects_bad_input(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,tokens\n1,2\n")
    assert main(["--trace", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "missing column" in capsys.readouterr().err
    assert main(["--trace", str(AZURE), "--policies", "serial,wide", "--out", str(tmp_path / "o")]) == 2


def _hook_replay(trace, policy: str, slo_s: float) -> list[list[int]]:
    """Feed the simulator's step sequence to the scheduler hook's own code (Row construction,
    _decide, after_process_batch_result) over fake SGLang requests; the active rows of each step."""
    from types import SimpleNamespace

    from branchwise import request_meta, runtime
    from branchwise import scheduler_hook as sh
    from branchwise.config import BranchwiseConfig

    cfg = BranchwiseConfig(branch_policy=policy, branch_slo_tpot_ms=slo_s * 1e3)
    ctl = build_controller(policy, default_model())
    ctl.refit = None  # the hook learns a latency at the next launch, the simulator at the step's end
    st = sh.BranchwiseState(config=cfg, controller=ctl, phases_seen=True)
    sched = SimpleNamespace(branchwise=runtime.Branchwise(config=st.config, state=st), enable_overlap=False)
    decode = SimpleNamespace(is_decode=lambda: True, is_mixed=lambda: False)
    # a row that never runs again finished (a parent parked during its phase resumes later)
    last_seen: dict[tuple[str, int], int] = {}
    for i, (*_, rows, _a, _w) in enumerate(trace):
        for r in rows:
            last_seen[(r.key, r.order)] = i
    out = []
    for i, (now, t, rows, _, waiting) in enumerate(trace):
        sched.waiting_queue = [None] * waiting
        reqs = []
        for r in rows:
            meta = (request_meta.RequestMeta(phase=r.key.removeprefix("phase:"), branch=r.order) if r.in_phase
                    else request_meta.SERIAL)
            rid = r.key.removeprefix("rid:") if not r.in_phase else f"{r.key}/{r.order}"
            done = last_seen[(r.key, r.order)] == i
            reqs.append(SimpleNamespace(rid=rid, bw_meta=meta, kv=SimpleNamespace(kv_committed_len=r.ctx),
                                        to_finish=None, bw_fork=None, finished=lambda done=done: done))
        sched.running_batch = SimpleNamespace(reqs=reqs)  # deferred rows stay in it
        hook_rows = [sh._row(q, cfg) for q in reqs]
        assert hook_rows == rows  # the simulator builds the hook's rows
        keys = [r.key for r in hook_rows]
        active = None
        if sh._has_phase_rows(st, reqs) and len(set(keys)) < len(keys):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sh.time, "monotonic", lambda now=now: now)
                active = sh._decide(st, sched, hook_rows)
        ran = reqs if active is None else [reqs[i] for i in active]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sh.time, "monotonic", lambda t=t: t)
            sh.after_process_batch_result(None, sched, SimpleNamespace(reqs=ran, forward_mode=decode,
                                                                       forward_iter=None, launch_ts=None))
        out.append(active)
    return out


@pytest.mark.parametrize("max_running", [0, 5])
@pytest.mark.parametrize("policy", ["taper", "taper-paper", "taper-no-replan", "cap:2"])
def test_simulator_drives_the_controller_as_the_scheduler_hook_does(policy: str, max_running: int) -> None:
    """One step sequence through both paths: the simulator's HookDriver, and the hook's own code on
    the same rows, clocks and queue length (max_running 5: requests wait). Every step's active rows
    agree, so the widths do."""
    specs = [RequestSpec("a", 0.0, 50, (3, (30, 22, 41, 9), 5)), RequestSpec("b", 0.05, 400, (60,)),
             RequestSpec("c", 0.1, 80, (2, (25, 25, 25), 4, (12, 30), 3)), RequestSpec("d", 0.4, 3000, (70,)),
             RequestSpec("e", 0.45, 30, (4, (15, 20), 6))]
    cfg = EngineConfig(slo_s=0.02, noise=0.0, macro_steps=False, max_running=max_running)  # tight SLO
    ctl = build_controller(policy, default_model())
    ctl.refit = None
    sim = Simulator(specs, ctl, default_model(), cfg, 1e9)
    sim.trace = []
    sim.run()
    want = [x[3] for x in sim.trace]
    if max_running:
        assert max(x[4] for x in sim.trace if x[3] is not None) > 0  # a queue at some planned step
    planned = [a for a in want if a is not None]
    assert planned and any(len(a) < len(x[2]) for x, a in zip(sim.trace, want, strict=True) if a is not None) \
        or policy == "cap:2"
    assert _hook_replay(sim.trace, policy, cfg.slo_s) == want


# ------------------------------------------------------------------ the live regime's engine terms
def _live_specs(n: int = 60, seed: int = 3):
    from bench.regimes import LIVE_SCALING, regime_specs

    return regime_specs(load_trace(AZURE), 3.0, n / 3.0, seed, "multiverse", LIVE_SCALING)


@pytest.mark.parametrize("policy", ["serial", "eager", "taper"])
def test_client_programs_conserve_tokens_and_release_resources(policy: str) -> None:
    """Client-side fork/join with prefill forwards and host costs: every request finishes with its
    tokens, and slots and KV come back to zero (a tight pool forces retractions too)."""
    from bench.regimes import get_regime

    reg = get_regime("live-fast")
    specs = _live_specs()
    cfg = dataclasses.replace(reg.engine_for(), kv_tokens=6000, client_gap_s=1e-3)
    sim = Simulator(specs, build_controller(policy, reg.model, calibrated=True), reg.model, cfg, 1e9)
    res = sim.run()
    want = {s.rid: s.output_tokens for s in specs}
    assert all(r.finished and r.output_tokens == want[r.rid] for r in res.records)
    assert sim.slots == 0 and sim.kv == 0
    assert res.stats["prefill_steps"] > len(specs)  # arrivals, forks and joins prefill in forwards of their own
    assert sim.retractions > 0


@pytest.mark.parametrize("regime", ["live-fast", "device:a100-qwen3-32b-tp8"])
@pytest.mark.parametrize("policy", ["serial", "eager", "taper"])
def test_live_regime_windows_are_exact(policy: str, regime: str) -> None:
    """The live regime (host costs, a first step that pays for a changed subset, prefill forwards,
    client-side programs) and a device regime (graph padding) with step noise: windows give the
    deliveries of stepping one by one."""
    from bench.regimes import get_regime

    reg = get_regime(regime)
    specs = _live_specs()
    runs = []
    for macro in (True, False):
        cfg = dataclasses.replace(reg.engine_for(), noise=0.05, macro_steps=macro)
        ctl = build_controller(policy, reg.model, calibrated=True)
        runs.append(Simulator(specs, ctl, reg.model, cfg, 1e9).run())
    assert runs[0].stats["iterations"] < runs[1].stats["iterations"]
    a, b = ([(s.parallel, s.tokens, s.start_s, s.end_s) for r in x.records for s in r.stages] for x in runs)
    assert [s[:2] for s in a] == [s[:2] for s in b]
    np.testing.assert_allclose([s[2:] for s in a], [s[2:] for s in b], rtol=0, atol=1e-9)
    assert runs[0].stats["rows_deferred"] == runs[1].stats["rows_deferred"]


def test_client_phase_opens_at_the_delivery_before_it() -> None:
    """A client-side phase is measured from the serial stage's last token, though its branches reach
    the server a client gap later and get their first tokens from their prefill; the join's stage
    likewise from the phase's last branch token."""
    spec = RequestSpec("a", 0.0, 10, (3, (4, 4), 2))
    cfg = EngineConfig(noise=0.0, client_programs=True, prefill_steps=True, client_gap_s=0.01)
    rec = Simulator([spec], build_controller("eager", default_model()), default_model(), cfg, 1e9).run().records[0]
    serial, phase, join = rec.stages
    assert (phase.parallel, phase.tokens, join.tokens) == (True, 8, 2)
    assert phase.start_s == serial.end_s and join.start_s == phase.end_s
    m = default_model()
    # gap + the fork's prefill forward + three decode steps of two rows
    assert phase.end_s - phase.start_s == pytest.approx(0.01 + m.predict(0, 0, 4) + 3 * m.predict(2, 0), rel=0.01)


@pytest.mark.parametrize("macro", [True, False])
def test_host_costs_charge_the_steps_that_defer(macro: bool) -> None:
    """serial runs one of a phase's two branches at a time: each of the first branch's steps defers one
    row and pays same_subset, the first of them subset instead (its active set changed)."""
    from bench.engine import Cost, HostCosts

    spec = [RequestSpec("a", 0.0, 10, (1, (30, 30), 1))]
    host = HostCosts(subset=Cost(2e-3, 0.5e-3), same_subset=Cost(1e-3, 0.5e-3))
    runs = []
    for h in (HostCosts(), host):
        cfg = EngineConfig(noise=0.0, macro_steps=macro, host=h)
        runs.append(Simulator(spec, build_controller("serial", default_model()), default_model(), cfg, 1e9).run())
    wall = [r.records[0].stages[0].end_s - r.records[0].stages[0].start_s for r in runs]  # the phase
    assert wall[1] - wall[0] == pytest.approx(29 * 1.5e-3 + 2.5e-3, abs=1e-9)
    assert runs[1].stats["subset_steps"] == 30 and runs[1].stats["changed_subsets"] == 1
    assert runs[1].stats["rows_deferred"] == 30
