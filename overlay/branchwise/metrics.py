"""Prometheus series for branch admission and TPOT SLO attainment, under every policy (TP rank 0).

Who records what, and the SLO rule (bench/metrics.py's): docs/design/code-notes.md.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from branchwise import request_meta

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

    from branchwise.config import BranchwiseConfig
    from branchwise.taper.controller import StepStats

# Step-latency histogram bounds as multiples of the TPOT SLO: densest around it, 0.1x to 10x.
SLO_FACTORS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
SLO_TOLERANCE = 1e-9  # bench/metrics.py's: the SLO boundary is inclusive, up to rounding
SLO_KINDS = ("request", "phase")
MAX_OPEN_PHASES = 4096  # a phase whose branch was aborted in the queue never completes: the oldest go
TRACKED = "bw_slo"


def current_dp_rank() -> int:
    """This scheduler's DP rank (0 without DP, or outside an SGLang scheduler process)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().dp_rank
    except Exception:  # no SGLang, or its runtime context is not published in this process
        return 0
    return int(rank) if rank is not None else 0


def configured_slo_s() -> float:
    """The server's --branch-slo-tpot-ms in seconds (the flag's default outside an SGLang scheduler)."""
    from branchwise.config import BranchwiseConfig

    try:
        from sglang.srt.runtime_context import get_schedule

        slo_ms = get_schedule().branch_slo_tpot_ms
    except Exception:  # no SGLang, its context not published here, or the flag not declared
        slo_ms = BranchwiseConfig().branch_slo_tpot_ms
    return float(slo_ms) / 1e3


def step_buckets(slo_s: float) -> tuple[float, ...]:
    """The step-latency histogram's bounds: a decode step is read against the TPOT SLO it must fit."""
    return tuple(round(factor * slo_s, 9) for factor in SLO_FACTORS)


def within_slo(wall_s: float, tokens: int, slo_s: float) -> bool:
    """bench/metrics.py's rule: wall time over tokens at most the SLO (inclusive). No tokens, no miss."""
    return tokens <= 0 or wall_s <= tokens * slo_s * (1 + SLO_TOLERANCE)


def is_abort(reason: object) -> bool:
    return reason is not None and reason.to_json().get("type") == "abort"


@dataclass(slots=True, eq=False)
class PhaseTally:
    """One phase's branch requests so far: how many entered the queue, decode, completed."""

    start_s: float  # the first branch entered the waiting queue
    slo_s: float
    fanout: int  # branches the phase announced (a client may send more: all are awaited)
    opened: int = 0
    closed: int = 0
    decoding: int = 0  # branch rows between their first token and their completion
    tokens: int = 0  # output tokens of its completed branches
    end_s: float = 0.0  # the last completion so far
    aborted: bool = False
    evicted: bool = False  # left the ledger unfinished (MAX_OPEN_PHASES): its rows count no more

    @property
    def done(self) -> bool:
        return self.closed == self.opened and self.closed >= self.fanout

    @property
    def met(self) -> bool:
        return not self.aborted and within_slo(self.end_s - self.start_s, self.tokens, self.slo_s)


@dataclass(slots=True, eq=False)
class SloLedger:
    """Open phases and branch rows decoding, for the SLO and stock's step series (pure: times passed in)."""

    phases: dict[str, PhaseTally] = field(default_factory=dict)
    decoding_rows: int = 0
    decoding_phases: int = 0
    evicted: int = 0

    @property
    def opportunistic_rows(self) -> int:
        """Branch rows beyond one per phase that could decode now (TAPER's `candidates` of a step)."""
        return self.decoding_rows - self.decoding_phases

    def open(self, key: str, fanout: int, slo_s: float, now_s: float) -> tuple[PhaseTally, bool]:
        """A branch of phase `key` entered the queue: its tally, and whether it opened the phase."""
        tally = self.phases.get(key)
        new = tally is None
        if tally is None:
            if len(self.phases) >= MAX_OPEN_PHASES:
                self._evict(next(iter(self.phases)))
            tally = self.phases[key] = PhaseTally(now_s, slo_s, fanout)
        tally.opened += 1
        return tally, new

    def first_token(self, tally: PhaseTally) -> None:
        if tally.evicted:
            return
        tally.decoding += 1
        self.decoding_rows += 1
        self.decoding_phases += tally.decoding == 1

    def close(self, key: str, tally: PhaseTally, decoded: bool, tokens: int, end_s: float,
              aborted: bool) -> bool | None:
        """A branch of the phase completed: the phase's verdict when it was the last, else None."""
        if decoded and not tally.evicted:
            tally.decoding -= 1
            self.decoding_rows -= 1
            self.decoding_phases -= tally.decoding == 0
        tally.closed += 1
        tally.tokens += tokens
        tally.end_s = max(tally.end_s, end_s)
        tally.aborted |= aborted
        if tally.evicted or not tally.done:
            return None
        if self.phases.get(key) is tally:
            del self.phases[key]
        return tally.met

    def _evict(self, key: str) -> None:
        tally = self.phases.pop(key)
        tally.evicted = True
        self.decoding_rows -= tally.decoding
        self.decoding_phases -= tally.decoding > 0
        self.evicted += 1


@dataclass(slots=True, eq=False)
class Tracked:
    """What one request's completion needs, kept on its `time_stats` (TRACKED); the Req held weakly."""

    req: weakref.ref[Req]
    metrics: BranchwiseMetrics
    slo_s: float
    key: str | None = None  # its phase's key; None: a request of its own
    phase: PhaseTally | None = None
    decoding: bool = False
    done: bool = False


@dataclass(eq=False)
class BranchwiseMetrics:
    slo_s: float = field(default_factory=configured_slo_s)
    dp_rank: int = field(default_factory=current_dp_rank)
    registry: Any = None  # prometheus_client's default registry (the multiprocess files) unless given
    ledger: SloLedger = field(default_factory=SloLedger)
    _last: dict[str, float] = field(default_factory=dict)
    _step: tuple[int, float] | None = None  # the last decode batch: forward_iter, launch time
    _stock_rate_set: bool = False

    def __post_init__(self) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = self.registry if self.registry is not None else REGISTRY
        rank = str(self.dp_rank)

        def labeled(kind: type, name: str, doc: str, *, kinds: tuple[str, ...] = (), **kw: Any) -> Any:
            labels = ("dp_rank", "kind") if kinds else ("dp_rank",)
            series = kind(name, doc, labelnames=labels, registry=registry, **kw)
            if kinds:  # every kind from the start: a panel reads 0, not "no data", before the first
                return {k: series.labels(dp_rank=rank, kind=k) for k in kinds}
            return series.labels(dp_rank=rank)

        self.admitted = labeled(Counter, "branchwise:admitted_branches", "Opportunistic branch rows admitted")
        self.deferred = labeled(Counter, "branchwise:deferred_branches", "Branch rows deferred")
        self.candidates = labeled(Counter, "branchwise:candidate_branches", "Opportunistic branch rows ready")
        self.branch_requests = labeled(Counter, "branchwise:branch_requests",
                                       "Branch requests queued (client phases, server-side fork, n > 1)")
        self.phases = labeled(Counter, "branchwise:phases", "Phases (parallel stages) opened")
        self.slo_met = labeled(Counter, "branchwise:slo_met", "Requests and phases that met their TPOT SLO",
                               kinds=SLO_KINDS)
        self.slo_missed = labeled(Counter, "branchwise:slo_missed",
                                  "Requests and phases that missed their TPOT SLO (or were aborted)",
                                  kinds=SLO_KINDS)
        self.admission_rate = labeled(Gauge, "branchwise:admission_rate", "Admitted / ready opportunistic rows",
                                      multiprocess_mode="mostrecent")
        self.budget = labeled(Gauge, "branchwise:slack_budget_seconds", "Last step's slack budget",
                              multiprocess_mode="mostrecent")
        self.predicted = labeled(Gauge, "branchwise:predicted_step_seconds",
                                 "Predicted latency of the last plan", multiprocess_mode="mostrecent")
        self.realized = labeled(Histogram, "branchwise:realized_step_seconds", "Realized decode step latency",
                                buckets=step_buckets(self.slo_s))
        self.planner = labeled(Gauge, "branchwise:planner_seconds_mean", "Mean planner time per planned step",
                               multiprocess_mode="mostrecent")
        self.orphans = labeled(Counter, "branchwise:orphans_freed",
                               "Parked server-side fork parents the idle leak check found orphaned and freed")

    def track(self, req: Req, key: str | None, fanout: int, slo_s: float, now_s: float) -> Tracked:
        """A request entered the waiting queue for the first time: count it, and open its phase."""
        tracked = Tracked(weakref.ref(req), self, slo_s, key)
        if key is not None:
            self.branch_requests.inc()
            tracked.phase, new = self.ledger.open(key, fanout, slo_s, now_s)
            if new:
                self.phases.inc()
        return tracked

    def first_token(self, tracked: Tracked) -> None:
        if tracked.decoding or tracked.done:
            return
        tracked.decoding = True
        if tracked.phase is not None:
            self.ledger.first_token(tracked.phase)

    def finished(self, tracked: Tracked, first_token_s: float, end_s: float) -> None:
        """The request completed (once: SGLang stamps a completion per ending, and this is idempotent)."""
        if tracked.done:
            return
        tracked.done = True
        req = tracked.req()
        tokens = len(req.output_ids) if req is not None else 0
        aborted = is_abort(getattr(req, "finished_reason", None))
        if tracked.phase is None:
            wall = end_s - first_token_s if first_token_s > 0 else 0.0
            self.count("request", not aborted and within_slo(wall, tokens - 1, tracked.slo_s))
            return
        met = self.ledger.close(tracked.key, tracked.phase, tracked.decoding, tokens, end_s, aborted)
        if met is not None:
            self.count("phase", met)

    def count(self, kind: str, met: bool) -> None:
        (self.slo_met if met else self.slo_missed)[kind].inc()

    def observe_batch(self, decode: bool, forward_iter: int | None, launch_ts: float | None,
                      controller: bool) -> None:
        """After every batch result: the last decode step's latency; stock: the rows offered and admitted."""
        if not decode or forward_iter is None or launch_ts is None:
            self._step = None
            return
        prev, self._step = self._step, (forward_iter, launch_ts)
        if prev is not None and forward_iter == prev[0] + 1:
            self.realized.observe(launch_ts - prev[1])
        if not controller and (rows := self.ledger.opportunistic_rows) > 0:
            self.candidates.inc(rows)
            self.admitted.inc(rows)
            if not self._stock_rate_set:
                self.admission_rate.set(1.0)
                self._stock_rate_set = True

    def observe_taper(self, stats: StepStats) -> None:
        """TAPER's cumulative `stats` after a step it timed, as series."""
        values = {name: float(getattr(stats, name)) for name in ("admitted", "rows_deferred", "candidates")}
        for name, counter in (("admitted", self.admitted), ("rows_deferred", self.deferred),
                              ("candidates", self.candidates)):
            counter.inc(values[name] - self._last.get(name, 0.0))
            self._last[name] = values[name]
        self.admission_rate.set(stats.admission_rate)
        if stats.last_budget_s != float("inf"):
            self.budget.set(stats.last_budget_s)
        self.predicted.set(stats.last_predicted_s)
        self.planner.set(stats.planner_s / max(stats.planned_steps, 1))


def on_queued(metrics: BranchwiseMetrics, req: Req, config: BranchwiseConfig) -> None:
    """A request entered the waiting queue: a client request, a fork branch, or one coming back."""
    stats = req.time_stats
    if getattr(stats, TRACKED, None) is not None:
        return
    meta = getattr(req, "bw_meta", None) or request_meta.SERIAL
    key = None
    if meta.phase is not None:  # scheduler_hook's grouping: a fork's phases and a client's apart
        track = getattr(req, "bw_fork", None)
        key = ("fork:" if track is not None and track.branch else "phase:") + meta.phase
    setattr(stats, TRACKED, metrics.track(req, key, meta.fanout, config.slo_s(meta.slo_tpot_ms),
                                          time.perf_counter()))


def observe_batch(metrics: BranchwiseMetrics, batch: ScheduleBatch, controller: bool) -> None:
    metrics.observe_batch(batch.forward_mode.is_decode(), getattr(batch, "forward_iter", None),
                          getattr(batch, "launch_ts", None), controller)


def after_set_prefill_finished_time(result: None, time_stats: SchedulerReqTimeStats, *args: Any,
                                    **kwargs: Any) -> None:
    """A request's prefill ended: its first token is out, its row decodes from now on."""
    tracked = getattr(time_stats, TRACKED, None)
    if tracked is not None:
        tracked.metrics.first_token(tracked)
    return result


def after_set_completion_time(result: None, time_stats: SchedulerReqTimeStats, *args: Any,
                              **kwargs: Any) -> None:
    """A request ended (finished, aborted in a batch, or a parked fork parent ended): its verdict."""
    tracked = getattr(time_stats, TRACKED, None)
    if tracked is not None:
        tracked.metrics.finished(tracked, time_stats.prefill_finished_time, time_stats.completion_time)
    return result
