"""Trace parsing, arrival schedules and the request composer (bench/workload.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.workload import (
    PRESETS,
    Trace,
    TraceError,
    build_schedule,
    compose,
    load_trace,
    paper_rate,
    synthetic_trace,
    workload_stats,
    write_trace,
)

AZURE = Path(__file__).resolve().parents[2] / "bench" / "data" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def azure() -> Trace:
    return load_trace(AZURE)


def _csv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "t.csv"
    p.write_text(text)
    return p


def test_azure_trace_parses(azure: Trace) -> None:
    assert len(azure) == 19366
    assert azure.arrival_s[0] == 0.0 and np.all(np.diff(azure.arrival_s) >= 0)
    assert 3400 < azure.duration_s < 3600  # about one hour
    assert azure.prompt_tokens.dtype == np.int64 and azure.output_tokens.min() >= 0


def test_numeric_timestamps_and_unsorted_rows(tmp_path: Path) -> None:
    t = load_trace(_csv(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n5.5,10,3\n1.5,20,4\n"))
    assert t.arrival_s.tolist() == [0.0, 4.0]
    assert t.prompt_tokens.tolist() == [20, 10]  # rows follow their timestamps


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("TIMESTAMP,ContextTokens\n1,2\n", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no data rows"),
        ("", "missing column"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,abc,3\n", "row 2"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\nnot-a-time,2,3\n", "row 3"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,-2,3\n", "negative"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n1,2\n", "row 2"),
    ],
)
def test_bad_trace_errors_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(TraceError, match=needle) as e:
        load_trace(_csv(tmp_path, text))
    assert "t.csv" in str(e.value)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_synthetic_trace_roundtrips_through_csv(tmp_path: Path) -> None:
    syn = synthetic_trace(duration_s=600, rate=2.0, seed=3)
    assert 0.7 * 1200 < len(syn) < 1.3 * 1200
    write_trace(tmp_path / "s.csv", syn)
    back = load_trace(tmp_path / "s.csv")
    np.testing.assert_allclose(back.arrival_s, syn.arrival_s, atol=1e-6)
    assert back.output_tokens.tolist() == syn.output_tokens.tolist()


def test_paper_envelope_matches_appendix_d() -> None:
    t = np.linspace(0, 600, 600001)
    r = paper_rate(t)
    assert r[t < 240].mean() == pytest.approx(0.23)
    hi = r[(t >= 250) & (t < 400)]
    assert hi.mean() == pytest.approx(1.27, abs=0.005) and hi.max() == pytest.approx(1.54, abs=1e-3)
    mod = r[t >= 400]
    assert mod.mean() == pytest.approx(0.60, abs=0.005) and mod.max() == pytest.approx(0.9, abs=1e-3)


@pytest.mark.parametrize("compress", [1.0, 10.0])
def test_paper_schedule_regime_means(azure: Trace, compress: float) -> None:
    s = build_schedule(azure, "paper-3regime", compress)
    assert s.duration_s == pytest.approx(36000 / compress)
    want = {"low": 0.23, "high": 1.27, "moderate": 0.60}
    got = {g.name: s.rate_in(g.start_s, g.end_s) for g in s.regimes}
    for name, rate in want.items():
        assert got[name] == pytest.approx(rate, rel=0.08), (name, got)
    assert np.all(np.diff(s.arrival_s) >= 0) and s.row.max() < len(azure)


def test_rate_and_unscaled_schedules(azure: Trace) -> None:
    s = build_schedule(azure, "rate:1.5")
    assert len(s) == len(azure)
    assert s.rate_in(0, s.duration_s + 1e-9) == pytest.approx(1.5, rel=0.01)
    u = build_schedule(azure, "unscaled")
    np.testing.assert_array_equal(u.arrival_s, azure.arrival_s)
    half = build_schedule(azure, "unscaled", compress=2)
    assert half.duration_s == pytest.approx(azure.duration_s / 2)
    np.testing.assert_array_equal(half.arrival_s, azure.arrival_s[azure.arrival_s <= half.duration_s])
    for bad in ("rate:x", "rate:0", "poisson"):
        with pytest.raises(ValueError, match="schedule"):
            build_schedule(azure, bad)


@pytest.mark.parametrize("preset", ["multiverse", "sprint"])
def test_composer_statistics(azure: Trace, preset: str) -> None:
    p = PRESETS[preset]
    reqs = compose(azure, build_schedule(azure, "rate:2", compress=6), preset, seed=1)
    st = workload_stats(reqs)
    assert st["pdr"] == pytest.approx(p.pdr, abs=0.03)
    assert st["abf"] == pytest.approx(p.abf, abs=0.1)
    assert st["pts"] == pytest.approx(p.pts, abs=0.03)
    for r in reqs:  # serial first and last; every branch and stage decodes at least one token
        assert isinstance(r.stages[0], int) and isinstance(r.stages[-1], int)
        assert all((min(s) if isinstance(s, tuple) else s) >= 1 for s in r.stages)
        assert not r.decomposable or any(isinstance(s, tuple) and len(s) >= 2 for s in r.stages)


def test_sprint_has_more_shorter_phases_than_multiverse(azure: Trace) -> None:
    sched = build_schedule(azure, "rate:2", compress=10)
    mv, sp = (workload_stats(compose(azure, sched, p, 0)) for p in ("multiverse", "sprint"))
    assert sp["phases_per_decomposable"] > 2 * mv["phases_per_decomposable"]


def test_composer_is_seeded(azure: Trace) -> None:
    sched = build_schedule(azure, "paper-3regime", compress=60)
    assert compose(azure, sched, seed=4) == compose(azure, sched, seed=4)
    assert compose(azure, sched, seed=4) != compose(azure, sched, seed=5)


def test_trace_outputs_flag_uses_generated_tokens(azure: Trace) -> None:
    sched = build_schedule(azure, "unscaled", compress=20)
    reqs = compose(azure, sched, trace_outputs=True)
    want = np.maximum(azure.output_tokens[sched.row], 2)
    got = np.array([r.output_tokens for r in reqs])
    # branch rounding may move a decomposable request by a few tokens
    assert np.abs(got - want).max() <= 8 and np.mean(got == want) > 0.4
    assert [r.prompt_tokens for r in reqs] == np.maximum(azure.prompt_tokens[sched.row], 1).tolist()


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf", "NaN"])
def test_non_finite_timestamps_are_rejected(tmp_path: Path, stamp: str) -> None:
    text = f"TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n{stamp},2,3\n5,2,3\n"
    with pytest.raises(TraceError, match="row 3.*not a finite time"):
        load_trace(_csv(tmp_path, text))


@pytest.mark.parametrize("spec", ["unscaled", "rate:2", "paper-3regime"])
def test_a_trace_too_short_for_any_schedule(tmp_path: Path, spec: str) -> None:
    one = load_trace(_csv(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n"))
    with pytest.raises(TraceError, match="two distinct arrival times"):
        build_schedule(one, spec)
    same = load_trace(_csv(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n1,4,5\n"))
    with pytest.raises(TraceError, match="two distinct arrival times"):
        build_schedule(same, spec)


def test_a_trace_too_short_for_the_asked_duration(azure: Trace) -> None:
    s = build_schedule(azure, "rate:2", duration_s=600.0)
    assert s.duration_s == 600.0 and s.arrival_s.max() <= 600.0
    assert s.rate_in(0, 600.0) == pytest.approx(2.0, rel=0.25)
    span = azure.duration_s * azure.mean_rate / 2
    with pytest.raises(TraceError, match="too short"):
        build_schedule(azure, "rate:2", duration_s=span * 1.01)


def test_simulate_refuses_a_short_trace_instead_of_writing_nan(tmp_path: Path, capsys) -> None:
    from bench.simulate import main

    csv = _csv(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n")
    assert main(["--trace", str(csv), "--schedule", "rate:1", "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert "two distinct arrival times" in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.json").exists()


def test_stationary_schedule_holds_its_rate_from_any_place(azure: Trace) -> None:
    from bench.workload import stationary_schedule

    runs = [stationary_schedule(azure, 0.8, 1200.0, seed) for seed in range(3)]
    for s in runs:
        assert s.rate_in(0, 1200.0) == pytest.approx(0.8, rel=0.15)
        assert s.arrival_s.max() < 1200.0 and len(set(s.row.tolist())) == len(s)
    assert len({int(s.row[0]) for s in runs}) == 3  # each seed reads another part of the trace
    np.testing.assert_array_equal(stationary_schedule(azure, 0.8, 1200.0, 1).arrival_s, runs[1].arrival_s)


def test_best_of_n_requests_are_n_samples_of_the_traces_output(azure: Trace) -> None:
    sched = build_schedule(azure, "rate:2", compress=6)
    reqs = compose(azure, sched, "best-of-n", seed=1)
    want = np.maximum(azure.output_tokens[sched.row], 2)
    samples = [r for r in reqs if r.samples]
    assert len(samples) / len(reqs) == pytest.approx(PRESETS["best-of-n"].pdr, abs=0.03)
    assert {len(r.stages[1]) for r in samples} == set(range(2, 9))  # n drawn from 2..8
    for r, length in zip(reqs, want, strict=True):
        if r.samples:  # the prefill's first token, then n samples of the rest: each as long as the trace's
            assert r.stages[0] == 1 and len(r.stages) == 2 and set(r.stages[1]) == {max(length - 1, 1)}
        else:
            assert r.stages == (length,) and not r.decomposable
