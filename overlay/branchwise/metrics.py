"""Prometheus series for branch admission (scheduler process, TP rank 0, under --enable-metrics).

SGLang runs prometheus_client in multiprocess mode, so series created in the scheduler process are
served by the HTTP server's /metrics like SGLang's own scheduler metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BranchwiseMetrics:
    _last: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.admitted = Counter("branchwise:admitted_branches", "Opportunistic branch rows admitted")
        self.deferred = Counter("branchwise:deferred_branches", "Branch rows deferred")
        self.candidates = Counter("branchwise:candidate_branches", "Opportunistic branch rows ready")
        self.admission_rate = Gauge("branchwise:admission_rate", "Admitted / ready opportunistic rows",
                                    multiprocess_mode="mostrecent")
        self.budget = Gauge("branchwise:slack_budget_seconds", "Last step's slack budget",
                            multiprocess_mode="mostrecent")
        self.predicted = Gauge("branchwise:predicted_step_seconds", "Predicted latency of the last plan",
                               multiprocess_mode="mostrecent")
        buckets = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
        self.realized = Histogram("branchwise:realized_step_seconds", "Realized decode step latency",
                                  buckets=buckets)
        self.planner = Gauge("branchwise:planner_seconds_mean", "Mean planner time per planned step",
                             multiprocess_mode="mostrecent")

    def observe_step(self, latency_s: float, stats: Any) -> None:
        for name, counter in (("admitted", self.admitted), ("rows_deferred", self.deferred),
                              ("candidates", self.candidates)):
            value = float(getattr(stats, name))
            counter.inc(value - self._last.get(name, 0.0))
            self._last[name] = value
        self.admission_rate.set(stats.admission_rate)
        if stats.last_budget_s != float("inf"):
            self.budget.set(stats.last_budget_s)
        self.predicted.set(stats.last_predicted_s)
        self.realized.observe(latency_s)
        self.planner.set(stats.planner_s / max(stats.planned_steps, 1))
