"""The decode-loop simulator driving the real TAPER policy objects (bench/simulate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.metrics import summarize
from bench.simulate import EngineConfig, Simulator, _steps_until, main, slo_sized_cap
from bench.workload import RequestSpec, build_schedule, compose, load_trace, synthetic_trace, write_trace
from branchwise.taper import LinearLatencyModel, default_model, parse_policy, phase_slack

AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"
POLICIES = ("off", "cap:2", "eager", "taper", "taper-no-slack", "taper-no-replan", "taper-const-predictor")


@pytest.fixture(scope="module")
def small():
    trace = load_trace(AZURE)
    sched = build_schedule(trace, "paper-3regime", compress=120)  # 5 simulated minutes, all regimes
    return sched, compose(trace, sched, "multiverse", seed=2)


def _run(specs, policy: str, t_end: float = 1e9, **cfg):
    model = default_model()
    pol = parse_policy(policy, model=LinearLatencyModel(*model.coefs()) if policy.startswith("taper") else None)
    sim = Simulator(specs, pol, model, EngineConfig(**cfg), t_end)
    return sim, sim.run()


def test_eager_admits_every_branch_and_off_none(small) -> None:
    _, specs = small
    for policy, want in (("eager", 1.0), ("off", 0.0)):
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


@pytest.mark.parametrize("policy", ["off", "eager", "taper"])
def test_multi_step_windows_are_exact(small, policy: str) -> None:
    """Running provably identical steps in one go gives the same deliveries as stepping one by one."""
    specs = small[1][:100]
    runs = [_run(specs, policy, noise=0.0, refit_every_s=0.0, macro_steps=m)[1] for m in (True, False)]
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
    _, res = _run(specs, "off", noise=0.0, refit_every_s=0.0, macro_steps=False)
    a = res.records[0]
    m = default_model()
    assert a.max_gap_s == pytest.approx(m.predict(1, a.stages[0].tokens) + m.c_tok * 8000, rel=0.05)
    assert a.max_gap_s > a.max_tpot_s


def test_batch_layout_matches_request_state() -> None:
    """The planner's ArrayBatch: decode order, rows of a phase's ready branches, serial contexts,
    and slack from slack.py, both right after a rebuild and after an in-place step."""
    seen = []

    class Recorder:
        name, model = "eager", None

        def plan(self, batch):
            seen.append((list(batch.rids), batch.ready.tolist(), batch.ctx.tolist(), batch.slack_s.tolist(),
                         batch.phase.tolist()))
            return parse_policy("eager").plan(batch)

        def pins(self, batch, plan):
            return {}

    specs = [RequestSpec("b", 0.0, 3, (6,)), RequestSpec("a", 0.0, 4, (2, (3, 2), 1))]
    m = default_model()
    cfg = EngineConfig(noise=0.0, refit_every_s=0.0, macro_steps=False)
    Simulator(specs, Recorder(), m, cfg, 1e9).run()
    slo = cfg.slo_s
    # step 1 prefills both (b: ctx 3 + 1, a: 4 + 1), step 2 closes a's serial stage (ctx 6) and forks it
    assert seen[0] == (["b", "a"], [1, 2], [5, 6, 6], [slo, slo], [False, True])
    # step 3 ran 3 rows over 17 context tokens; a's phase now has 2 tokens in it
    t3 = m.predict(3, 17)
    assert seen[1][:3] == (["b", "a"], [1, 2], [6, 7, 7]) and seen[1][4] == [False, True]
    assert seen[1][3] == [slo, pytest.approx(phase_slack(slo, t3, 0.0, 2))]
    assert len(seen) == 2  # a's second branch then ends: one ready row each, nothing to plan


def test_taper_keeps_attainment_under_overload() -> None:
    trace = load_trace(AZURE)
    sched = build_schedule(trace, "rate:1.5", compress=60)  # 1.5 req/s for ~6 min: overload
    specs = compose(trace, sched, "multiverse", seed=2)
    window = (0.0, sched.duration_s)
    got = {p: summarize(_run(specs, p, max_running=96)[1].records, 0.05, window) for p in ("off", "eager", "taper")}
    assert got["taper"]["slo_attainment"] >= got["off"]["slo_attainment"] - 0.02
    assert got["taper"]["slo_attainment"] > got["eager"]["slo_attainment"] + 0.2
    assert got["taper"]["goodput_tok_s"] >= got["off"]["goodput_tok_s"] * 0.98


def test_steps_until() -> None:
    assert _steps_until(0.01, 0.0, 0.005) == 1
    assert _steps_until(0.01, 0.0, 0.1) == 10
    k = _steps_until(0.01, 0.001, 0.2)  # 10, 11, 12, ... ms
    assert sum(0.01 + 0.001 * j for j in range(k)) >= 0.2 > sum(0.01 + 0.001 * j for j in range(k - 1))


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
               "off,cap:2,eager,taper", "--seed", "1", "--out", str(tmp_path / "out"), "--jobs", "1"])
    assert rc == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(doc["policies"]) == ["off", "cap:2", "eager", "taper"]
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
    assert main(["--trace", str(AZURE), "--policies", "off,wide", "--out", str(tmp_path / "o")]) == 2
