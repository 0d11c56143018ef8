"""Branchwise's Prometheus series (overlay/branchwise/metrics.py) on hand-driven request and step
events: SLO verdicts by bench/metrics.py's rule, branch requests and phases, and the per-step series
with and without a step controller. A fresh registry per test: no SGLang, no multiprocess files."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from bench.metrics import RequestRecord, StageRecord, summarize
from branchwise import metrics as m
from branchwise.config import BranchwiseConfig
from branchwise.request_meta import RequestMeta
from branchwise.taper.controller import StepStats

SLO = 0.050
CFG = BranchwiseConfig()  # --branch-slo-tpot-ms 50


class FakeReq:
    """The Req fields the hooks read (a class: the metrics hold the request weakly)."""

    def __init__(self, meta: RequestMeta | None = None, fork_branch: bool = False) -> None:
        self.bw_meta = meta
        self.bw_fork = SimpleNamespace(branch=True) if fork_branch else None
        self.output_ids: list[int] = []
        self.finished_reason: object = None
        self.time_stats = SimpleNamespace(prefill_finished_time=0.0, completion_time=0.0)


class Reason:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def to_json(self) -> dict:
        return {"type": self.kind}


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    got = reg.get_sample_value(name, {"dp_rank": "0", **labels})
    assert got is not None, (name, labels)
    return got


def slo_counts(reg: CollectorRegistry, kind: str) -> tuple[float, float]:
    return (value(reg, "branchwise:slo_met_total", kind=kind), value(reg, "branchwise:slo_missed_total", kind=kind))


def queue(metrics: m.BranchwiseMetrics, req: FakeReq, at: float, monkeypatch) -> FakeReq:
    monkeypatch.setattr(m.time, "perf_counter", lambda: at)
    m.on_queued(metrics, req, CFG)
    return req


def first_token(req: FakeReq, at: float) -> None:
    req.time_stats.prefill_finished_time = at
    m.after_set_prefill_finished_time(None, req.time_stats)


def complete(req: FakeReq, at: float, tokens: int, reason: str = "length") -> None:
    req.output_ids = list(range(tokens))
    req.finished_reason = Reason(reason)
    req.time_stats.completion_time = at
    m.after_set_completion_time(None, req.time_stats)


def test_step_buckets_are_dense_around_the_slo():
    b = m.step_buckets(SLO)
    assert list(b) == sorted(b) and b[0] == pytest.approx(0.1 * SLO) and b[-1] == pytest.approx(10 * SLO)
    assert SLO in b
    near = [x for x in b if 0.5 * SLO <= x <= 2 * SLO]
    assert len(near) >= 10  # most bounds within a factor of 2 of the SLO
    assert m.step_buckets(0.002)[9] == 0.002


def test_the_histogram_follows_the_configured_slo(reg):
    metrics = m.BranchwiseMetrics(slo_s=0.2, dp_rank=0, registry=reg)
    metrics.observe_batch(True, 1, 10.0, controller=False)
    metrics.observe_batch(True, 2, 10.15, controller=False)
    assert value(reg, "branchwise:realized_step_seconds_bucket", le="0.2") == 1.0
    assert value(reg, "branchwise:realized_step_seconds_bucket", le="0.14") == 0.0
    assert m.configured_slo_s() == pytest.approx(CFG.branch_slo_tpot_ms / 1e3)  # outside a scheduler


@pytest.mark.parametrize("seed", range(3))
def test_within_slo_is_the_bench_rule(seed):
    """Verdicts agree with bench/metrics.py's attainment on one-stage records, boundary included."""
    rng = random.Random(seed)
    for _ in range(200):
        tokens = rng.randint(1, 40)
        wall = tokens * SLO * rng.choice([rng.uniform(0.5, 1.5), 1.0])
        rec = RequestRecord("r", 0.0, 0.0, [StageRecord(False, 0.0, wall, tokens)], True)
        bench = summarize([rec], SLO, (0.0, 1.0))["slo_attainment"] == 1.0
        assert m.within_slo(wall, tokens, SLO) == bench, (wall, tokens)
    assert m.within_slo(5.0, 0, SLO)  # no decode tokens: nothing to miss


def test_requests_meet_or_miss_on_wall_time_over_decode_tokens(reg, monkeypatch):
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    fast, slow, aborted, one = (queue(metrics, FakeReq(), 0.0, monkeypatch) for _ in range(4))
    for req in (fast, slow, aborted, one):
        first_token(req, 1.0)
    complete(fast, 1.0 + 10 * SLO, 11)  # 10 decode tokens in exactly 10 SLOs: met (inclusive)
    complete(slow, 1.0 + 10 * SLO + 0.01, 11)
    complete(aborted, 1.1, 11, reason="abort")  # fast, but an abort is no success
    complete(one, 9.0, 1)  # no decode token
    assert slo_counts(reg, "request") == (2.0, 2.0)
    complete(fast, 99.0, 11)  # a second completion stamp (quick finish paths): counted once
    assert slo_counts(reg, "request") == (2.0, 2.0)
    assert value(reg, "branchwise:branch_requests_total") == 0.0 and slo_counts(reg, "phase") == (0.0, 0.0)


def test_a_phase_is_judged_when_its_last_branch_completes(reg, monkeypatch):
    """Effective TPOT of the phase: from its first branch's queue entry to its last branch's
    completion, over every branch's tokens; branches are not requests of their own."""
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    meta = RequestMeta(phase="p", branch=0, fanout=3)
    branches = [queue(metrics, FakeReq(meta), 0.0 + 0.01 * i, monkeypatch) for i in range(3)]
    assert value(reg, "branchwise:branch_requests_total") == 3.0 and value(reg, "branchwise:phases_total") == 1.0
    for req in branches:
        first_token(req, 0.1)
    complete(branches[0], 0.5, 10)
    complete(branches[1], 0.9, 10)
    assert slo_counts(reg, "phase") == (0.0, 0.0)  # not before the last branch
    complete(branches[2], 1.5, 10)  # 30 tokens in 1.5 s = 50 ms each: met
    assert slo_counts(reg, "phase") == (1.0, 0.0) and slo_counts(reg, "request") == (0.0, 0.0)
    assert metrics.ledger.phases == {}  # its tally is gone; the id can be reused
    late = [queue(metrics, FakeReq(meta), 2.0, monkeypatch) for _ in range(3)]
    for req in late:
        complete(req, 3.6, 10)  # 30 tokens in 1.6 s
    assert slo_counts(reg, "phase") == (1.0, 1.0) and value(reg, "branchwise:phases_total") == 2.0


def test_a_phase_waits_for_branches_beyond_its_fanout_and_an_abort_misses_it(reg, monkeypatch):
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    meta = RequestMeta(phase="p", fanout=1)  # a client that stamps no fanout sends the default
    a, b = (queue(metrics, FakeReq(meta), 0.0, monkeypatch) for _ in range(2))
    complete(a, 0.1, 10)
    assert slo_counts(reg, "phase") == (0.0, 0.0)  # b is still open
    complete(b, 0.2, 10, reason="abort")
    assert slo_counts(reg, "phase") == (0.0, 1.0)


def test_client_and_fork_phases_with_one_id_are_apart(reg, monkeypatch):
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    meta = RequestMeta(phase="x", fanout=1)
    queue(metrics, FakeReq(meta), 0.0, monkeypatch)
    queue(metrics, FakeReq(meta, fork_branch=True), 0.0, monkeypatch)
    assert set(metrics.ledger.phases) == {"phase:x", "fork:x"}


def test_a_request_coming_back_to_the_queue_is_tracked_once(reg, monkeypatch):
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    req = queue(metrics, FakeReq(RequestMeta(phase="p", fanout=1)), 0.0, monkeypatch)
    first_token(req, 0.1)
    queue(metrics, req, 5.0, monkeypatch)  # retracted, or a fork parent after its join
    first_token(req, 6.0)
    assert value(reg, "branchwise:branch_requests_total") == 1.0 and metrics.ledger.decoding_rows == 1
    complete(req, 0.6, 12)  # from its first queue entry: 12 tokens in 0.6 s
    assert slo_counts(reg, "phase") == (1.0, 0.0) and metrics.ledger.decoding_rows == 0


def test_stock_counts_every_ready_branch_row_as_admitted(reg, monkeypatch):
    """Without a controller every row runs: per decode step, the rows beyond one per decoding phase
    are offered and admitted; the step latency is the gap between consecutive decode launches."""
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    p = [queue(metrics, FakeReq(RequestMeta(phase="p", fanout=4)), 0.0, monkeypatch) for _ in range(4)]
    q = [queue(metrics, FakeReq(RequestMeta(phase="q", fanout=2)), 0.0, monkeypatch) for _ in range(2)]
    queue(metrics, FakeReq(), 0.0, monkeypatch)  # a serial request is no branch row
    for req in p[:3] + q[:1]:
        first_token(req, 0.1)
    metrics.observe_batch(True, 7, 1.00, controller=False)
    assert value(reg, "branchwise:candidate_branches_total") == 2.0  # p: 3 rows - 1
    metrics.observe_batch(False, 8, 1.02, controller=False)  # a prefill: the next decode is untimed
    first_token(q[1], 1.05)
    metrics.observe_batch(True, 9, 1.06, controller=False)
    metrics.observe_batch(True, 10, 1.10, controller=False)
    assert value(reg, "branchwise:candidate_branches_total") == 2.0 + 3.0 + 3.0
    assert value(reg, "branchwise:admitted_branches_total") == 8.0
    assert value(reg, "branchwise:deferred_branches_total") == 0.0 and value(reg, "branchwise:admission_rate") == 1.0
    assert value(reg, "branchwise:realized_step_seconds_count") == 1.0
    assert value(reg, "branchwise:realized_step_seconds_sum") == pytest.approx(0.04)
    for req in p:
        complete(req, 2.0, 5)
    assert metrics.ledger.opportunistic_rows == 1 and metrics.ledger.decoding_rows == 2  # q left


def test_under_a_controller_the_rows_are_taper_s_and_the_latency_is_timed_once(reg):
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    metrics.ledger.decoding_rows = 5  # would count under stock
    metrics.observe_batch(True, 1, 1.0, controller=True)
    metrics.observe_batch(True, 2, 1.03, controller=True)
    stats = StepStats(candidates=10, admitted=4, rows_deferred=6, planner_s=0.002, planned_steps=2,
                      last_budget_s=0.04, last_predicted_s=0.03)
    metrics.observe_taper(stats)  # report_step's call
    stats.candidates, stats.admitted = 12, 6
    metrics.observe_taper(stats)
    assert value(reg, "branchwise:candidate_branches_total") == 12.0
    assert value(reg, "branchwise:admitted_branches_total") == 6.0
    assert value(reg, "branchwise:deferred_branches_total") == 6.0
    assert value(reg, "branchwise:admission_rate") == 0.5 and value(reg, "branchwise:planner_seconds_mean") == 0.001
    assert value(reg, "branchwise:realized_step_seconds_count") == 1.0  # observe_batch's, not report_step's
    assert value(reg, "branchwise:branch_requests_total") == 0.0  # counted at the queue, not from counters


def test_phases_that_never_complete_are_evicted(reg, monkeypatch):
    monkeypatch.setattr(m, "MAX_OPEN_PHASES", 2)
    metrics = m.BranchwiseMetrics(slo_s=SLO, dp_rank=0, registry=reg)
    stuck = queue(metrics, FakeReq(RequestMeta(phase="a", fanout=2)), 0.0, monkeypatch)
    first_token(stuck, 0.1)
    queue(metrics, FakeReq(RequestMeta(phase="b", fanout=2)), 0.0, monkeypatch)
    queue(metrics, FakeReq(RequestMeta(phase="c", fanout=2)), 0.0, monkeypatch)
    assert set(metrics.ledger.phases) == {"phase:b", "phase:c"}
    assert metrics.ledger.evicted == 1 and metrics.ledger.decoding_rows == 0
    complete(stuck, 1.0, 5)  # its row ends later: no verdict, no count below zero
    assert slo_counts(reg, "phase") == (0.0, 0.0) and metrics.ledger.decoding_rows == 0


def test_series_exist_from_the_start(reg):
    m.BranchwiseMetrics(slo_s=SLO, dp_rank=3, registry=reg)
    for kind in m.SLO_KINDS:
        assert reg.get_sample_value("branchwise:slo_met_total", {"dp_rank": "3", "kind": kind}) == 0.0
        assert reg.get_sample_value("branchwise:slo_missed_total", {"dp_rank": "3", "kind": kind}) == 0.0
    assert reg.get_sample_value("branchwise:phases_total", {"dp_rank": "3"}) == 0.0
