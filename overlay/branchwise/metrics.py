"""Prometheus series for branch admission (scheduler process, TP rank 0, under --enable-metrics).

SGLang runs prometheus_client in multiprocess mode, so series created in the scheduler process are
served by the HTTP server's /metrics like SGLang's own scheduler metrics. Every series carries a
`dp_rank` label: under `--dp-size N` each DP rank's scheduler reports its own (0 without DP).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from branchwise.taper.controller import StepStats


def current_dp_rank() -> int:
    """This scheduler's DP rank (0 without DP, or outside an SGLang scheduler process)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = get_parallel().dp_rank
    except Exception:  # no SGLang, or its runtime context is not published in this process
        return 0
    return int(rank) if rank is not None else 0


@dataclass
class BranchwiseMetrics:
    dp_rank: int = field(default_factory=current_dp_rank)
    _last: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        def labeled(kind: type, name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, labelnames=("dp_rank",), **kw).labels(dp_rank=str(self.dp_rank))

        self.admitted = labeled(Counter, "branchwise:admitted_branches", "Opportunistic branch rows admitted")
        self.deferred = labeled(Counter, "branchwise:deferred_branches", "Branch rows deferred")
        self.candidates = labeled(Counter, "branchwise:candidate_branches", "Opportunistic branch rows ready")
        self.branch_requests = labeled(Counter, "branchwise:branch_requests",
                                       "Branch (phase) requests created")
        self.admission_rate = labeled(Gauge, "branchwise:admission_rate",
                                      "Admitted / ready opportunistic rows", multiprocess_mode="mostrecent")
        self.budget = labeled(Gauge, "branchwise:slack_budget_seconds", "Last step's slack budget",
                              multiprocess_mode="mostrecent")
        self.predicted = labeled(Gauge, "branchwise:predicted_step_seconds",
                                 "Predicted latency of the last plan", multiprocess_mode="mostrecent")
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
        self.realized = labeled(Histogram, "branchwise:realized_step_seconds", "Realized decode step latency",
                                buckets=buckets)
        self.planner = labeled(Gauge, "branchwise:planner_seconds_mean", "Mean planner time per planned step",
                               multiprocess_mode="mostrecent")
        self.orphans = labeled(Counter, "branchwise:orphans_freed",
                               "Parked server-side fork parents the idle leak check found orphaned and freed")

    def observe_step(self, latency_s: float, stats: StepStats,
                     counters: Mapping[str, int] | None = None) -> None:
        """After a decode step: TAPER's cumulative `stats` and the scheduler's `counters` (as series)."""
        values = {name: float(getattr(stats, name)) for name in ("admitted", "rows_deferred", "candidates")}
        values["branch_requests"] = float((counters or {}).get("branch_requests", 0))
        for name, counter in (("admitted", self.admitted), ("rows_deferred", self.deferred),
                              ("candidates", self.candidates), ("branch_requests", self.branch_requests)):
            counter.inc(values[name] - self._last.get(name, 0.0))
            self._last[name] = values[name]
        self.admission_rate.set(stats.admission_rate)
        if stats.last_budget_s != float("inf"):
            self.budget.set(stats.last_budget_s)
        self.predicted.set(stats.last_predicted_s)
        self.realized.observe(latency_s)
        self.planner.set(stats.planner_s / max(stats.planned_steps, 1))
