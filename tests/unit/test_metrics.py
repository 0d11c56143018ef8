"""Metrics on hand-built delivery records (bench/metrics.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.metrics import RequestRecord, StageRecord, StepLog, summarize, timeseries

SLO = 0.050


def test_effective_tpot_of_a_parallel_stage() -> None:
    # 4 branches x 10 tokens over 1.0 s: effective TPOT 25 ms, though each branch saw 100 ms/token
    times = [0.1 * (i + 1) for i in range(10)] * 4
    rec = RequestRecord.from_token_times("r", 0.0, [(False, [0.0]), (True, [1.0 + t for t in times])])
    (stage,) = rec.stages
    assert stage.parallel and stage.tokens == 40
    assert stage.start_s == 0.0 and stage.end_s == pytest.approx(2.0)  # opened by the last serial token
    assert rec.max_tpot_s == pytest.approx(2.0 / 40)


def test_from_token_times_excludes_first_token_and_chains_stages() -> None:
    rec = RequestRecord.from_token_times(
        "r", 0.5, [(False, [1.0, 1.04, 1.08]), (True, [1.1, 1.1, 1.12, 1.12]), (False, [1.3])]
    )
    assert rec.first_token_s == 1.0 and rec.output_tokens == 3 + 4 + 1
    assert [(s.parallel, s.start_s, s.end_s, s.tokens) for s in rec.stages] == [
        (False, 1.0, 1.08, 2), (True, 1.08, 1.12, 4), (False, 1.12, 1.3, 1)]
    assert rec.max_tpot_s == pytest.approx(0.18)  # the one-token serial stage after the reduce


def _rec(rid: str, arrival: float, stages: list[tuple[bool, float, float, int]], finished: bool = True):
    return RequestRecord(rid, arrival, arrival + 0.1, [StageRecord(*s) for s in stages], finished)


def test_attainment_and_goodput() -> None:
    ok = _rec("ok", 0.0, [(False, 0.1, 1.1, 25), (True, 1.1, 2.1, 50)])  # 40 ms, 20 ms
    late = _rec("late", 0.0, [(False, 0.1, 1.1, 10)])  # 100 ms per token
    par_late = _rec("par", 1.0, [(False, 1.1, 1.2, 4), (True, 1.2, 2.2, 10)])  # 25 ms, then 100 ms eff.
    m = summarize([ok, late, par_late], SLO, (0.0, 4.0))
    assert m["slo_attainment"] == pytest.approx(1 / 3)
    assert m["raw_throughput_tok_s"] == pytest.approx((76 + 11 + 15) / 4.0)
    assert m["goodput_tok_s"] == pytest.approx(76 / 4.0)
    assert m["finished_frac"] == 1.0


def test_goodput_counts_what_the_window_s_arrivals_got_wherever_delivered() -> None:
    """Equal attainment gives equal goodput: a long request that arrived in the window counts all
    its tokens, though most arrive after the window; one that arrived before counts none."""
    long = _rec("long", 1.0, [(False, 1.1, 9.1, 160)])  # 50 ms/token, mostly delivered after t = 4
    early = _rec("early", -2.0, [(False, -1.9, 2.1, 80)])  # arrived before the window
    m = summarize([long, early], SLO, (0.0, 4.0))
    assert m["goodput_tok_s"] == pytest.approx(161 / 4.0)
    assert m["goodput_delivered_tok_s"] == pytest.approx((160 * 2.9 / 8 + 1 + 80 * 2.1 / 4) / 4.0)


def test_end_to_end_and_decode_latency_per_class() -> None:
    """End to end runs from arrival to the last token of any branch, decode time from the first token;
    percentiles are over the class's finished arrivals, with the finished share beside them."""
    decomp = [RequestRecord.from_token_times(f"d{i}", float(i), [(False, [i + 0.5, i + 1.0]),
                                                                  (True, [i + 3.0 + i, i + 2.0])])
              for i in range(3)]  # e2e 3, 4, 5 s (the later branch), decode 2.5, 3.5, 4.5 s
    serial = [_rec("s", 0.0, [(False, 0.1, 0.5, 10)]), _rec("u", 0.0, [(False, 0.1, 0.9, 10)], finished=False)]
    m = summarize(decomp + serial, SLO, (0.0, 10.0))
    assert m["decomp_e2e_p50_s"] == pytest.approx(4.0) and m["decomp_e2e_p99_s"] == pytest.approx(4.98)
    assert m["decomp_decode_p50_s"] == pytest.approx(3.5) and m["decomp_finished_frac"] == 1.0
    assert m["serial_e2e_p50_s"] == pytest.approx(0.5) and m["serial_finished_frac"] == 0.5
    assert m["decomp_requests"] == 3 and m["serial_requests"] == 2
    none = summarize(serial[1:], SLO, (0.0, 10.0))
    assert none["serial_e2e_p50_s"] is None and none["decomp_e2e_p50_s"] is None


def test_slo_boundary_is_inclusive() -> None:
    exact = _rec("e", 0.0, [(False, 0.1, 0.6, 10)])  # exactly 50 ms
    assert summarize([exact], SLO, (0.0, 1.0))["slo_attainment"] == 1.0


def test_unfinished_requests_count_in_throughput_and_miss_in_attainment() -> None:
    done = _rec("d", 0.0, [(False, 0.1, 0.5, 10)])
    running = _rec("u", 0.0, [(False, 0.1, 0.9, 10)], finished=False)
    m = summarize([done, running], SLO, (0.0, 1.0))
    assert m["slo_attainment"] == 0.5 and m["finished_frac"] == 0.5
    assert m["slo_attainment_finished"] == 1.0  # the paper's reading, reported beside it
    assert m["raw_throughput_tok_s"] == pytest.approx(22.0)
    assert m["goodput_tok_s"] == pytest.approx(11.0)  # an unfinished request has not met its SLO


def test_window_splits_stage_tokens_evenly() -> None:
    r = _rec("r", 0.0, [(False, 0.0, 10.0, 100)])
    m = summarize([r], SLO, (0.0, 10.0), regimes=[("a", 0.0, 2.5), ("b", 2.5, 10.0)])
    assert m["per_regime"]["a"]["raw_throughput_tok_s"] == pytest.approx((25 + 1) / 2.5)  # + first token
    assert m["per_regime"]["b"]["raw_throughput_tok_s"] == pytest.approx(75 / 7.5)
    assert m["per_regime"]["b"]["requests"] == 0  # attainment follows arrival time


def test_per_class_p99() -> None:
    recs = [_rec(f"s{i}", 0.0, [(False, 0.0, 0.01 * (i + 1), 1)]) for i in range(100)]
    recs.append(_rec("p", 0.0, [(True, 0.0, 1.0, 100)]))
    m = summarize(recs, SLO, (0.0, 2.0))
    assert m["p99_tpot_serial_ms"] == pytest.approx(990.1)
    assert m["p99_tpot_parallel_ms"] == pytest.approx(10.0)


def test_step_log_metrics_with_run_length_rows() -> None:
    log = StepLog()
    log.add(0.0, 1, 0.020, 0.020, eligible=4, admitted=4)
    log.add(0.02, 3, 0.090, 0.031, eligible=6, admitted=0)  # 3 steps of 29, 30, 31 ms
    m = summarize([], SLO, (0.0, 1.0), steps=log)
    assert m["steps"] == 4
    assert m["step_latency_mean_ms"] == pytest.approx(27.5)
    assert m["step_latency_max_ms"] == pytest.approx(31.0)
    assert m["admission_rate"] == pytest.approx(0.4)
    assert m["slo_attainment"] is None and m["goodput_tok_s"] == 0.0


def test_timeseries_bins() -> None:
    recs = [_rec(f"r{i}", float(i), [(False, i + 0.1, i + 0.5, 10)]) for i in range(4)]
    ts = timeseries(recs, SLO, (0.0, 4.0), 2.0)
    assert ts["t_s"].tolist() == [0.0, 2.0]
    assert ts["slo_attainment"].tolist() == [1.0, 1.0]
    assert ts["raw_throughput_tok_s"].tolist() == pytest.approx([11.0, 11.0])


def test_timeseries_agrees_with_window_metrics() -> None:
    rng = np.random.default_rng(0)
    recs, log = [], StepLog()
    for i in range(300):
        t = float(rng.uniform(0, 90))
        stages, prev = [], t + 0.2
        for j in range(int(rng.integers(1, 5))):
            dur = float(rng.choice([0.0, rng.uniform(0.01, 8.0)]))
            stages.append((bool(j % 2), prev, prev + dur, int(rng.integers(1, 60))))
            prev += dur
        recs.append(RequestRecord(f"r{i}", t, t + 0.2, [StageRecord(*s) for s in stages], bool(i % 7)))
        log.add(t, int(rng.integers(1, 4)), float(rng.uniform(0.01, 0.2)), 0.05, int(rng.integers(0, 9)), 1)
    ts = timeseries(recs, SLO, (0.0, 100.0), 10.0, log)
    for b, t0 in enumerate(ts["t_s"]):
        w = summarize(recs, SLO, (t0, t0 + 10.0), steps=log)
        for key, val in w.items():
            if key != "per_regime" and key in ts and key != "step_latency_max_ms":
                want = np.nan if val is None else val
                assert ts[key][b] == pytest.approx(want, rel=1e-9, abs=1e-9, nan_ok=True), (key, b)


def test_queued_requests_are_misses_and_their_wait_counts_in_ttft() -> None:
    """A policy cannot look good by leaving requests in the queue: each one is a miss, and its TTFT
    is at least its wait up to the end of observation."""
    served = [_rec(f"s{i}", 0.0, [(False, 0.1, 0.5, 10)]) for i in range(3)]
    queued = RequestRecord("q", 1.0)  # never got a first token
    m = summarize([*served, queued], SLO, (0.0, 2.0), horizon_s=101.0)
    assert m["slo_attainment"] == 0.75 and m["finished_frac"] == 0.75 and m["unstarted"] == 1
    assert m["ttft_p50_s"] == pytest.approx(0.1)
    assert m["ttft_p99_s"] == pytest.approx(np.percentile([0.1, 0.1, 0.1, 100.0], 99))
    assert summarize([*served, queued], SLO, (0.0, 2.0))["ttft_p99_s"] < 1.0  # default horizon: last event


def test_queue_growth_counts_what_joined_the_admission_queue_over_the_window() -> None:
    """Four arrive in [10, 20): one was already waiting at 10 and started at 12, two still wait at
    20 (one starts later, one never): the queue grew by 1 per 4 arrivals. Nothing waits: 0."""
    waited = RequestRecord("w", 5.0, 12.0, [StageRecord(False, 12.0, 13.0, 10)], True)
    served = [_rec(f"s{i}", 11.0 + i, [(False, 11.2 + i, 11.5 + i, 10)]) for i in range(2)]
    late = RequestRecord("l", 18.0, 25.0, [StageRecord(False, 25.0, 26.0, 10)], True)
    never = RequestRecord("n", 19.0)
    m = summarize([waited, *served, late, never], SLO, (10.0, 20.0))
    assert m["requests"] == 4 and m["queue_growth"] == pytest.approx((2 - 1) / 4)
    assert summarize(served, SLO, (10.0, 20.0))["queue_growth"] == 0.0
    assert summarize([waited], SLO, (10.0, 20.0))["queue_growth"] is None  # no arrivals


def test_ttft_slo_counts_in_attainment_and_goodput() -> None:
    fast = _rec("f", 0.0, [(False, 0.1, 0.5, 10)])  # TTFT 0.1 s
    slow = RequestRecord("s", 0.0, 3.0, [StageRecord(False, 3.0, 3.4, 10)], True)  # TTFT 3 s
    m = summarize([fast, slow], SLO, (0.0, 5.0))
    assert m["slo_attainment"] == 1.0
    m = summarize([fast, slow], SLO, (0.0, 5.0), slo_ttft_s=2.0)
    assert m["slo_attainment"] == 0.5
    assert m["goodput_tok_s"] == pytest.approx(11 / 5.0)


def test_per_gap_tpot_is_a_second_figure() -> None:
    # stage mean 40 ms (within 50) but one 150 ms gap (a prefill-heavy step)
    times = [0.0] + [0.03 * i for i in range(1, 10)] + [0.27 + 0.15]
    rec = RequestRecord.from_token_times("r", 0.0, [(False, times)])
    assert rec.max_gap_s == pytest.approx(0.15)
    assert rec.max_tpot_s == pytest.approx(0.42 / 10)
    m = summarize([rec], SLO, (0.0, 1.0))
    assert m["slo_attainment"] == 1.0 and m["slo_attainment_gap"] == 0.0
    assert m["max_gap_p99_ms"] == pytest.approx(150.0)
    # a phase's deliveries from any branch count: two branches alternating every 30 ms
    par = RequestRecord.from_token_times("p", 0.0, [(False, [0.0]), (True, [0.03, 0.06, 0.09, 0.12])])
    assert par.max_gap_s == pytest.approx(0.03)


def test_headline_cells_side_by_side() -> None:
    from bench.report import HEADLINE, render

    m = summarize([_rec("a", 0.0, [(False, 0.1, 0.5, 10)]), RequestRecord("q", 0.5)], SLO, (0.0, 1.0),
                  horizon_s=10.0)
    head, rule, row = render({"p": m}, HEADLINE).splitlines()
    assert len(row) == len(head) == len(rule)
    assert head.split() == ["policy", "attain", "finished", "P99", "TTFT"]
    assert row.split() == ["p", "50.0%", "50.0%", f"{m['ttft_p99_s']:.2f}"]
